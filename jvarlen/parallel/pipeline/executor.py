"""Device side of the elastic pipeline executor: any valid plan of chunks through ``pp`` stages in
one program.

See docs/design/pipeline.md. Static: the :class:`PipelineSignature` (layout, bucket, chunk count,
tick count, context bucket, slot counts). Runtime data: the chunks, the tick table ``[ticks, pp,
2]`` from ``jvarlen.plan.schedule`` and the slot tables of :mod:`jvarlen.plan.buffers` (which also
encode the recomputation table), built on the host by :mod:`jvarlen.parallel.pipeline.prepare`.
Mesh axes ``(dp, pp, sp)`` of :mod:`jvarlen.parallel.layouts`; every pipeline (``dp`` index) has
its own chunks and tables; Ulysses runs inside each stage over ``sp``.

Inside ``shard_map`` one device runs a loop over paired ticks (:class:`StageProgram`): in each
tick lane 0 (a backward or the fused F and B of the last stage) and then lane 1 (a forward) gather
what their op reads from the stage's buffers (the context and residual buffers are read one layer
at a time inside its passes), run it, scatter what it wrote and add its gradients
(:mod:`jvarlen.parallel.pipeline.slots`); then two ``ppermute`` pass activations / cotangents to
the neighbouring stages. An op is a few passes over the stage's layers (scans), each layer's work
in a conditional on its mode (``stage.StageFns.ascend``/``descend``); where the stage's weights are
sharded, each layer's gather over the stage's dp × sp devices runs between those conditionals
(``StageWeights.layer_pass``).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jvarlen.model import AttentionInputs
from jvarlen.parallel.layouts import DP, PP, SP
from jvarlen.parallel.pipeline import slots
from jvarlen.parallel.pipeline.forward import forward_lane, forward_op, per_layer_modes
from jvarlen.parallel.pipeline.fused import fused_op
from jvarlen.parallel.pipeline.rest import StageRest, add_part
from jvarlen.parallel.pipeline.signature import CHUNK_KEYS
from jvarlen.parallel.pipeline.stage import KEEP, NONE, StageShapes, maybe, residual_shapes
from jvarlen.plan.schedule import BWD, FUSED, FWD, LANE_B, LANE_F

DATA = DP  # pipelines (independent data) over the layout's dp axis


def split_params(params):
    """(stacked layer state [L, ...], the rest: embed, final norm, head)."""
    rest = nnx.State({k: v for k, v in params.items() if k != "layers"})
    return params["layers"], rest


ACCUMULATORS = ("g_layers", "g_rest", "loss", "count")  # what a step's parts carry from one to the next


class StageProgram:
    """One device's tick program (built inside ``shard_map``): the stage's layers, the rest of the
    model (embedding, final norm, head), this pipeline's tables and chunks ``b``, and the loss
    ``scale`` (1 / all real targets of the iteration).

    No buffer leaves an op's conditional: what an op reads is gathered before it (or, for the
    context and residual buffers, read one layer at a time inside it) and what it writes is
    scattered after it (to the dummy slot, or dropped, when it writes nothing), so every buffer
    update is in place in the tick loop's carry. In the per-layer form lane 0's ops, and lane 1's
    where they store residuals or inputs, run outside any conditional, and the buffers they read,
    add to and write go through their passes' loop carries."""

    def __init__(self, s: StageShapes, layers, rest, b, scale, cpu: bool = True, per_layer: Optional[bool] = None):
        self.s, self.layers, self.scale = s, layers, scale
        # lane 0 adds each layer's gradients as it goes (:meth:`backward_lane`); None: off XLA:CPU
        self.per_layer = not cpu if per_layer is None else per_layer
        # the per-layer form as both lanes run it: stage weights whole, each op outside a conditional
        # adding and writing into the step's buffers inside its passes
        self.in_passes = self.per_layer and not s.fns.weights.group
        self.b = jax.tree.map(lambda a: a[0], b)
        self.stage = jax.lax.axis_index(PP)
        self.mine = jax.lax.axis_index(SP) * s.Tl  # first token of this device's part of a chunk
        self.is_first, self.is_last = self.stage == 0, self.stage == s.pp - 1
        # collectives inside conditionals (Ulysses; sharded layers' gathers): order them (see
        # :meth:`tick`); a layer's gather waits for the previous layer's compute only where that is
        # needed (XLA:CPU); elsewhere it is issued ahead, to overlap the compute
        self.ordered = s.sig.layout.sp > 1 or s.fns.weights.dp_sharded
        self.gathers_wait = self.ordered and cpu
        self.out: dict = {}  # every op's outputs, zeros where the op has none (:meth:`init`)
        # the embedding, final norm and head: whole, or split by vocabulary over sp
        self.rest = StageRest(
            s.graphdef, layers, rest, s.compute_dtype, scale, s.vocab_shards, self.mine, s.Tl, self.ordered
        )

    # ---- one chunk's view
    def chunk(self, k) -> dict:
        s, b, cdt = self.s, self.b, self.s.compute_dtype
        c = {key: jax.lax.dynamic_index_in_dim(b[key], k, 0, keepdims=False) for key in CHUNK_KEYS}
        c["C"] = b["ctx_len"][k]
        c["slots"] = {name: b[name + "_slot"][k, self.stage] for name in ("stash", "grad")}
        c["ctx_base"] = b["ctx_base"][k, self.stage]
        c["res_slot"] = b["res_slot"][k, self.stage]
        c["ckpt_slot"] = b["ckpt_slot"][k, self.stage]
        seg, pos = c["segment_ids"], c["positions"]
        if s.Sc:
            # The context pools hold a document's keys 0..C-1 at its region's rows. The stage sees
            # them at [Sc - C, Sc), right before the chunk's own keys: the visible keys of a query
            # are then one contiguous run and the attention's tile lists skip the unused [C, Sc)
            # part of the bucket.
            c["shift"] = s.Sc - c["C"]
            ar = jnp.arange(s.Sc, dtype=jnp.int32)
            in_ctx = ar >= c["shift"]
            kv_seg = jnp.concatenate([jnp.where(in_ctx, seg[0], 0), seg])
            kv_pos = jnp.concatenate([jnp.where(in_ctx, ar - c["shift"], 0), pos])
            c["inputs"] = AttentionInputs(seg[None], pos[None], kv_seg[None], kv_pos[None])
        else:
            c["inputs"] = AttentionInputs(seg[None], pos[None])
        c["own"] = ((b["has_next"][k] > 0) & (seg == seg[0]) & (seg > 0)).astype(cdt)[None, :, None, None]
        if s.Sc:
            c["ctx_rows"] = slots.context_rows(s, c)
        for key in ("tokens", "targets", "loss_mask", "positions"):  # this device's tokens
            c["local_" + key] = jax.lax.dynamic_slice_in_dim(c[key], self.mine, s.Tl)
        return c

    # ---- passes over the stage's layers
    def layer_pass(self, step, init, xs, reverse=False, reduce=False):
        """``step(carry, lp, x_j) -> (carry, y_j)`` over the stage's layers (``StageWeights.layer_pass``)."""
        return self.s.fns.weights.layer_pass(self.layers, step, init, xs, reverse, self.gathers_wait, reduce)

    def lane_flags(self, t):
        """Whether lane 0 and lane 1 run their passes in tick ``t``: where this stage has an op there,
        and, sharded over dp, where any pipeline's stage has one (their gathers are matched)."""
        ops = self.b["ops"][t, self.stage, :, 0]
        run = jnp.stack([(ops[LANE_B] == BWD) | (ops[LANE_B] == FUSED), ops[LANE_F] == FWD])
        if self.s.fns.weights.dp_sharded:
            run = jax.lax.psum(run.astype(jnp.int32), DP) > 0
        return run

    # ---- the ops: reads -> outputs (:attr:`out` where a lane does not run)
    def backward_op(self, r, op, k, kind=None, into=None):
        """Lane 0: the backward of chunk k, or the fused F and B of the last stage (its forward keeps
        every layer's residuals; with one stage its input is the embedding), or nothing (``op`` idle).
        ``kind``: the op, static (BWD or FUSED), or None: ``op``, data.
        ``into``: run outside any conditional as ``kind`` where ``op`` is that kind, the descent
        adding each layer's gradients into ``into``'s accumulators and dK/dV pools (``g_layers``,
        ``dck``, ``dcv``; with the buffers the op reads) as it goes, returned updated as ``into``;
        without it, returned stacked over the stage's layers (``d_layers``, ``dck``, ``dcv``).

        A backward descends the stage's layers once: a recomputed layer is rebuilt from its input
        (the stash for layer 0, else its checkpoint slot) under ``jax.vjp`` and applied at once, a
        stored one is rebuilt from its residual slots, so at most one layer's rebuilt residuals are
        held (docs/design/pipeline-recompute.md). Only a fused op has an ascending pass."""
        s, fns, r_op = self.s, self.s.fns, r
        if kind == FUSED and not fns.weights.group and not s.Sc and into is None:
            return self.fused_op(r, k)
        c = self.chunk(k)
        is_b, is_fused = (op == BWD, op == FUSED) if kind is None else (kind == BWD, kind == FUSED)
        if into is not None:  # the kind's structure, run where the op is that kind
            is_b, is_fused = is_b & (op == BWD), is_fused & (op == FUSED)
        active = is_b | is_fused
        fusable = kind == FUSED or (kind is None and s.sig.fused)  # static: the op may be a fused one
        f = fns.layer(c["inputs"], c["local_positions"])
        if fusable:
            x = r["x"]
            if s.pp == 1:
                x = jnp.where(is_fused, maybe(is_fused, lambda: self.rest.embed(c, after=x)), x)
            mode = KEEP if kind == FUSED and into is None else jnp.where(is_fused, KEEP, NONE)

            def up(x, lp, xs):
                j, m = xs
                y, _, _, res = fns.ascend(f, mode if m is None else m, lp, x, *slots.context_of(s, r, c, j))
                return y, res

            y, residuals = self.layer_pass(up, x, (jnp.arange(s.ls), per_layer_modes(mode, s.ls)))
            loss, d_head, dy_head = maybe(is_fused, lambda: self.rest.head_vjp(c, y))
            dy = jnp.where(is_fused, dy_head, r["dy"])
        else:
            residuals, loss, d_head, dy = None, self.out["loss"], self.out["d_head"], r["dy"]
        # per layer: rebuilt from its input (recomputed, in a backward) or from stored residuals
        recompute = c["res_slot"] == s.dummy("res") if s.stores else jnp.ones((s.ls,), bool)
        if kind == FUSED:
            rebuilds = None
        elif kind == BWD:
            rebuilds = recompute if s.stores else True
        else:
            rebuilds = recompute & ~is_fused if s.stores or fusable else True

        def down(carry, lp, xs):
            dy, acc = carry if into is not None else (carry, None)
            j, kept, slot, ckpt_slot, rebuild = xs
            rebuild = rebuilds if static else rebuild
            r = r_op if acc is None else dict(r_op, **acc)  # the buffers it reads, as the loop carries them
            ck, cv = slots.context_of(s, r, c, j)
            dk, dv = slots.own_context_grads(s, r, c, j)

            def from_input():
                x_j = r["x"] if not s.sig.n_ckpt else jnp.where(j == 0, r["x"], slots.get(r["ckpt"], ckpt_slot))
                return fns.rebuild(f, active, lp, x_j.astype(r["x"].dtype), ck, cv, dy, dk, dv)

            def from_residuals():
                res = kept
                if s.stores and kind != FUSED:  # a stored layer's residuals, read from the slots here
                    stored = [slots.get(buf, slot) for buf in r["res"]]
                    res = (
                        stored
                        if kept is None
                        else [jnp.where(is_fused, a, b.astype(a.dtype)) for a, b in zip(kept, stored)]
                    )
                return fns.descend(active, lp, ck, cv, res, dy, dk, dv)

            if rebuild is None:
                dlp, dx, dck, dcv = from_residuals()
            elif rebuild is True:
                dlp, dx, dck, dcv = from_input()
            else:
                dlp, dx, dck, dcv = jax.lax.cond(rebuild, from_input, from_residuals)
            if acc is None:
                return dx, ((dck, dcv), dlp)  # the context's gradients as the stage sees them (rows: ctx_rows)
            acc = slots.add_layer(s, acc, j, c, active, dlp, dck, dcv)
            ran = is_fused if rebuild is None else is_fused | (is_b & rebuild)
            acc["count"] = acc["count"] + ran.astype(jnp.int32)  # in the loop: lane 1's writes wait for it
            return (dx, acc), None

        static = rebuilds is None or isinstance(rebuilds, bool)
        per_layer = (c["res_slot"] if s.stores else None, c["ckpt_slot"] if s.sig.n_ckpt else None)
        xs = (jnp.arange(s.ls), residuals) + per_layer + (None if static else rebuilds,)
        if into is None:
            dx, ((dck, dcv), d_layers) = self.layer_pass(down, dy, xs, reverse=True, reduce=True)
            grads = dict(d_layers=d_layers, dck=dck, dcv=dcv)
            forwards = jnp.where(is_fused, s.ls, jnp.sum(jnp.where(is_b, recompute, False)))
        else:
            (dx, into), _ = self.layer_pass(down, (dy, dict(into, count=jnp.zeros((), jnp.int32))), xs, reverse=True)
            forwards = into.pop("count")
            grads = dict(into=into)

        return dict(
            self.out,
            send_grad=dx,
            lookup_cotangent=self.rest.lookup_cotangent(dx, active & self.is_first),
            d_head=d_head,
            loss=loss,
            count=forwards.astype(jnp.int32),
            **grads,
        )

    fused_op = fused_op  # lane 0's fused F and B as one ``jax.vjp`` (no context, whole weights)

    forward_op = forward_op  # lane 1's op (:mod:`.forward`)

    def idle(self, r, op, k):
        return self.out

    # ---- one tick: lane 0 (B or FUSED), then lane 1 (F), then the two ppermutes
    def reads(self, carry, c, kinds: tuple) -> dict:
        """What an op of the lane may read from its chunk's slots: ``kinds`` of ``x`` (stash),
        ``dy`` (cotangent inbox), ``dctx`` (context dK/dV), ``res`` (what a backward rebuilds its
        layers from: the stored residuals and the recomputed layers' inputs); always the context K/V. Buffers whose rows
        an op reads layer by layer inside its passes (context, residuals) are passed whole."""
        s, sl = self.s, c["slots"]
        reads = dict(x=slots.get(carry["stash"], sl["stash"]), res=[], ck=carry["ck"], cv=carry["cv"])
        if "dy" in kinds:
            reads["dy"] = slots.get(carry["grad_in"], sl["grad"])
        if "dctx" in kinds:
            reads["dck"], reads["dcv"] = carry["dck"], carry["dcv"]
        if "res" in kinds and s.sig.n_ckpt:  # recomputed layers' inputs, read in the backward's pass
            reads["ckpt"] = carry["ckpt"]
        if "res" in kinds and s.stores:
            # the whole buffers: a backward reads its stored layers' rows one layer at a time inside
            # its pass (a gather of all of them first would hold a stage's residuals of a chunk
            # twice); recomputed layers (slot n_res) read a clipped slot they never use
            reads["res"] = carry["res"]
        return reads

    def lane_op(self, t, lane):
        """(op code, chunk, chunk view) of this stage's op in ``lane`` of tick ``t``."""
        row = self.b["ops"][t, self.stage, lane]
        op, k = row[0], jnp.maximum(row[1], 0)
        c = self.chunk(k)
        return op, k, c

    def backward_lane(self, carry, t, run):
        """Lane 0: a backward or fused op (or nothing; its passes run where ``run``, see
        :meth:`lane_flags`). Adds its gradients and its context dK/dV; returns the cotangent it
        sends to the previous stage and a flag that exists only once the lane has run (always
        true; see :meth:`tick`)."""
        s = self.s
        op, k, c = self.lane_op(t, LANE_B)
        takes_dctx = (op == BWD) | (op == FUSED)
        reads = self.reads(carry, c, ("dy", "dctx", "res") if s.Sc else ("dy", "res"))
        if s.fns.weights.dp_sharded:  # one pass for every op kind: its layers' gathers are matched
            o = jax.lax.cond(run, self.backward_op, self.idle, reads, op, k)
        elif not self.in_passes:
            # a branch per op kind: the layers' gathers only where one runs; the fused op of a
            # signature without context, one ``jax.vjp`` of the stage (:meth:`fused_op`)
            fused = partial(self.backward_op, kind=FUSED) if s.sig.fused else self.idle
            kinds = [self.idle, partial(self.backward_op, kind=BWD), fused]
            o = jax.lax.switch(jnp.clip(op - 1, 0, 2), kinds, reads, op, k)
        else:
            # no conditional around the ops (their layers' skip the work), each descent adding each
            # layer's gradients in place as it goes (docs/design/executor-memory.md); the buffers it
            # reads go through its loop's carry too, which lane 1 then updates in place
            into = {name: carry[name] for name in ("g_layers", "dck", "dcv", "ck", "cv", "res", "ckpt")}
            o = self.backward_op(dict(reads, **into), op, k, kind=BWD, into=into)
            if s.sig.fused:  # after the backward, reading what it returns (its collectives in order):
                # the fused op's stack of residuals is then never held beside a recomputing backward
                if self.ordered:  # its input after the count, an output of the backward's loop
                    o["count"], reads["x"] = jax.lax.optimization_barrier((o["count"], reads["x"]))
                f = self.backward_op(dict(reads, **o["into"]), op, k, kind=FUSED, into=o["into"])
                o = dict(f, **{key: o[key] + f[key] for key in ("send_grad", "lookup_cotangent", "count")})
            carry.update(o["into"])
        if "into" not in o:  # the op's stacks (an op without context's pool rows: past the pool, dropped)
            if s.Sc:
                rows = slots.dctx_rows(s, c, takes_dctx)
                carry["dck"] = slots.add_rows(carry["dck"], rows, o["dck"])
                carry["dcv"] = slots.add_rows(carry["dcv"], rows, o["dcv"])
            carry["g_layers"] = jax.tree.map(lambda g, d: g + d.astype(g.dtype), carry["g_layers"], o["d_layers"])
        g_rest = add_part(carry["g_rest"], o["d_head"])
        carry["g_rest"] = self.rest.embed_grad(g_rest, c, o["lookup_cotangent"], takes_dctx & self.is_first)
        carry["loss"] = carry["loss"] + o["loss"]
        carry["count"] = carry["count"] + o["count"]
        return o["send_grad"], o["count"] >= 0

    forward_lane = forward_lane  # lane 1: its op, then the buffers it writes (:mod:`.forward`)

    def tick(self, carry, t):
        s, b = self.s, self.b
        carry = dict(carry)
        ordered = self.ordered
        run = self.lane_flags(t)
        # Lane 1's buffer writes depend on ``lane0_done``, a value lane 0's op computes, so the data
        # flow orders them after every read of lane 0. Without that dependency XLA:CPU cannot prove
        # the reads done before the in-place update and copies each buffer that both lanes touch,
        # whole, every tick (measured: +35 % step time with 28 residual slots).
        send_grad, lane0_done = self.backward_lane(carry, t, run[0])
        if ordered:
            # Ulysses all-to-alls (and, sharded, the layers' gathers) run inside the lanes'
            # conditionals, and XLA:CPU (jax 0.12) may start independent conditionals and collectives
            # in a different order on each device: two devices then wait in different collectives for
            # ever. The barriers order lane 0, lane 1, then the ppermutes (collectives outside
            # conditionals keep program order).
            send_grad, carry = jax.lax.optimization_barrier((send_grad, carry))
        send_act = self.forward_lane(carry, t, run[1], lane0_done)
        if ordered:
            send_act, send_grad = jax.lax.optimization_barrier((send_act, send_grad))
        if s.pp > 1:
            cdt = s.compute_dtype
            recv_act = jax.lax.ppermute(send_act.astype(cdt), PP, [(i, i + 1) for i in range(s.pp - 1)])
            recv_grad = jax.lax.ppermute(send_grad.astype(cdt), PP, [(i + 1, i) for i in range(s.pp - 1)])
            carry["stash"] = slots.put(carry["stash"], b["recv_act"][t, self.stage], recv_act)
            carry["grad_in"] = slots.put(carry["grad_in"], b["recv_grad"][t, self.stage], recv_grad)
        return carry, None

    # ---- the whole program
    def init(self, acc: Optional[dict] = None) -> dict:
        """Zero outputs of every op (:attr:`out`) and the initial carry: the stage's buffers
        (zero-initialised every step: temporaries, not state) and the accumulators
        (:data:`ACCUMULATORS`: zeros, or ``acc``, a previous part's of the same step)."""
        s, cdt, layers = self.s, self.s.compute_dtype, self.layers
        sig = s.sig
        x0 = jnp.zeros((s.Tl, s.d), cdt)
        c0 = self.chunk(jnp.int32(0))
        layer0 = jax.eval_shape(s.fns.weights.gather, jax.tree.map(lambda a: a[0], layers))
        ctx0 = jnp.zeros((s.Sc, s.K, s.D), cdt)
        res_shapes = residual_shapes(s.fns, layer0, x0, ctx0, ctx0, c0["inputs"], c0["local_positions"])
        # the context pools (rows past the last: dropped on write, zeros on read)
        pool = jnp.zeros((s.ls, sig.ctx_rows if s.Sc else 0, s.K, s.D), cdt)
        dctx = jnp.zeros((s.ls, s.Sc, s.K, s.D), cdt)  # what one op adds to them
        act = jnp.zeros((s.Tl, s.d), cdt)
        kv_own = jnp.zeros((s.ls, s.T, s.K, s.D), cdt)
        self.out.update(
            send_act=act,
            send_grad=act,
            lookup_cotangent=act if self.rest.vocab is None else jnp.zeros((s.T, s.d), cdt),
            x_in=act,
            dy_last=act,
            res=[jnp.zeros((s.ls,) + r.shape, r.dtype) for r in res_shapes] if s.stores else [],
            layer_inputs=jnp.zeros((s.ls, s.Tl, s.d), cdt) if sig.n_ckpt else None,
            k_own=kv_own,
            v_own=kv_own,
            dck=dctx,
            dcv=dctx,
            d_layers=s.fns.weights.reduced_zeros(layers),
            d_head=self.rest.head_zeros(),
            loss=jnp.zeros((), jnp.float32),
            count=jnp.zeros((), jnp.int32),
        )
        return dict(
            stash=jnp.zeros((sig.n_stash + 1, s.Tl, s.d), cdt),
            grad_in=jnp.zeros((sig.n_grad + 1, s.Tl, s.d), cdt),
            ck=pool,
            cv=pool,
            dck=pool,
            dcv=pool,
            # no dummy residual slot: writes to slot n_res (recomputed layers) are dropped
            res=[jnp.zeros((sig.n_res,) + r.shape, r.dtype) for r in res_shapes] if s.stores else [],
            # no dummy slot either: writes to slot n_ckpt are dropped
            ckpt=jnp.zeros((sig.n_ckpt, s.Tl, s.d), cdt) if sig.n_ckpt else None,
            **(
                acc
                or dict(
                    g_layers=s.fns.weights.accumulators(layers),
                    g_rest=self.rest.accumulators(),
                    loss=jnp.zeros((), jnp.float32),
                    count=jnp.zeros((), jnp.int32),
                )
            ),
        )

    def accumulate(self, acc: Optional[dict] = None) -> dict:
        """Runs the plan's ticks -> this device's accumulators (:data:`ACCUMULATORS`, not yet
        reduced), started from ``acc`` (a previous part of the step) or zeros."""
        carry = self.init(acc)
        # a while loop over the plan's ticks: the signature's rounding ticks (idle, up to 7 of them)
        # would still pay the ppermutes and the slot traffic
        carry = jax.lax.fori_loop(0, self.b["live_ticks"], lambda t, c: self.tick(c, t)[0], carry)
        return {k: carry[k] for k in ACCUMULATORS}

    def finish(self, acc: dict):
        """-> (grads of the layers (this device's canonical chunks; with stage-own weights, this
        device's contribution as a ``[1, L/pp, ...]`` row), of the rest (summed over the layout; with
        stage-own weights this device's contribution as a ``[1, ...]`` row, which the groups' update
        adds with every other device's: no all-reduce of the embedding and head within the group),
        loss sum, layer forwards [1, 1]) from the step's accumulators."""
        weights = self.s.fns.weights
        if weights.canonical:
            g_layers = weights.push(acc["g_layers"])  # summed, in the canonical placement
            # the vocabulary-split table and head are summed over the pipelines and stages only
            g_rest, done = self.rest.sum_over_layout(acc["g_rest"], g_layers, (DATA, PP))
        else:
            g_layers = jax.tree.map(lambda g: g[None], weights.push_rows(acc["g_layers"]))
            g_rest = done = jax.tree.map(lambda g: g[None], acc["g_rest"])
        loss = acc["loss"]
        if self.ordered:  # after the other sums (see :meth:`tick`)
            _, loss = jax.lax.optimization_barrier((done, loss))
        loss = jax.lax.psum(loss, (DATA, PP, SP))
        return g_layers, g_rest, loss, acc["count"].reshape(1, 1)

    def run(self):
        return self.finish(self.accumulate())
