"""Lane 1 of the pipeline executor's tick: a forward op and the buffers it writes (methods of
:class:`jvarlen.parallel.pipeline.executor.StageProgram`; device code). In the per-layer form
(``StageProgram.per_layer``, a GPU step's, stage weights whole) the op runs outside any
conditional and writes each layer's residuals, input and own K/V into their slots and pool rows
as its pass goes, so it never holds a chunk's stack of them over the stage's layers (the
residuals' stack: 2.4-2.6 GiB of the llama-7b H100 step with partial recomputation,
docs/design/executor-memory.md)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jvarlen.parallel.pipeline import slots
from jvarlen.parallel.pipeline.rest import add_part
from jvarlen.parallel.pipeline.stage import KEEP, NONE, PLAIN, maybe
from jvarlen.plan.schedule import FWD, LANE_F


def forward_op(self, r, op, k, kind=None, into=None, writes=None):
    """Lane 1: the forward of chunk k, keeping the residuals of the layers it stores (and, on the
    last stage, the loss and its cotangent), or nothing (``op`` idle). ``kind``: FWD, static, or
    None (``op``, data).
    ``into``: run outside any conditional, the pass writing each layer's residuals, input and
    own K/V into their slots and pool rows of ``into``'s buffers (``res``, ``ckpt``, ``ck``,
    ``cv``) as it goes, where ``writes``; returned updated as ``into``. Without it, returned
    stacked over the stage's layers, which the forward then holds whole (``L/pp`` layers'
    residuals) before they are scattered to their slots."""
    s, fns, c = self.s, self.s.fns, self.chunk(k)
    is_f = op == FWD if kind is None else True
    run = jnp.where(c["res_slot"] != s.dummy("res"), KEEP, PLAIN) if s.stores else PLAIN
    mode = run if kind == FWD else jnp.where(is_f, run, NONE)
    embedded = maybe(is_f & self.is_first, lambda: self.rest.embed(c, after=r["x"]))
    x = jnp.where(self.is_first, embedded, r["x"])
    f = fns.layer(c["inputs"], c["local_positions"])

    def up(carry, lp, xs):
        x, acc = carry if into is not None else (carry, None)
        j, m = xs
        ctx = slots.context_of(s, r if acc is None else dict(r, **acc), c, j)  # the pools as the loop carries them
        y, k_own, v_own, res = fns.ascend(f, mode if m is None else m, lp, x, *ctx)
        if acc is None:
            return y, (k_own, v_own, res, x if s.sig.n_ckpt else None)  # x: the layer's input
        return (y, slots.keep_layer(s, acc, j, c, writes, x, res, k_own, v_own)), None

    xs = (jnp.arange(s.ls), per_layer_modes(mode, s.ls))
    if into is None:
        y, (k_own, v_own, residuals, inputs) = self.layer_pass(up, x, xs)
        stacks = dict(
            res=residuals if s.stores else [],
            layer_inputs=inputs if s.sig.n_ckpt else None,
            k_own=k_own * c["own"],
            v_own=v_own * c["own"],
        )
    else:
        (y, into), _ = self.layer_pass(up, (x, into), xs)
        stacks = dict(into=into)

    loss, d_head, dy = maybe(is_f & self.is_last, lambda: self.rest.head_vjp(c, y))
    return dict(
        self.out,
        send_act=y,
        x_in=x,
        dy_last=dy,
        **stacks,
        d_head=d_head,
        loss=loss,
        count=jnp.where(is_f, s.ls, 0).astype(jnp.int32),
    )


def forward_lane(self, carry, t, run, lane0_done):
    """Lane 1: a forward (or nothing; its pass runs where ``run``; in the per-layer form its layers
    work where the op is a forward). Files its input (first stage) and its loss cotangent (last
    stage), stores its residuals and K/V; returns the activation it sends on. Its writes wait for
    ``lane0_done`` (see :meth:`tick`)."""
    s = self.s
    op, k, c = self.lane_op(t, LANE_F)
    is_f = op == FWD
    sl = c["slots"]
    reads = self.reads(carry, c, ())
    writes = is_f & lane0_done
    if self.in_passes and (s.stores or s.sig.n_ckpt or s.Sc):
        # no conditional around the op (its layers skip the work where it is idle): each layer's
        # residuals, input and own K/V go to their slots and rows as the pass goes, in place in
        # its loop's carry
        into = dict(res=carry["res"]) if s.stores else {}
        if s.sig.n_ckpt:
            into["ckpt"] = carry["ckpt"]
        if s.Sc:
            into["ck"], into["cv"] = carry["ck"], carry["cv"]
        o = self.forward_op(reads, op, k, into=into, writes=writes)
        carry.update(o["into"])
    else:
        kind = None if s.fns.weights.dp_sharded else FWD
        o = jax.lax.cond(run, partial(self.forward_op, kind=kind), self.idle, reads, op, k)
    carry["stash"] = slots.put(
        carry["stash"], jnp.where(writes & self.is_first, sl["stash"], s.dummy("stash")), o["x_in"]
    )
    carry["grad_in"] = slots.put(
        carry["grad_in"], jnp.where(writes & self.is_last, sl["grad"], s.dummy("grad")), o["dy_last"]
    )
    if s.sig.n_ckpt and "into" not in o:  # recomputed layers' inputs (layer 0's: the stash); n_ckpt dropped
        ckpt_f = jnp.where(writes, c["ckpt_slot"], s.dummy("ckpt"))
        carry["ckpt"] = carry["ckpt"].at[ckpt_f].set(o["layer_inputs"].astype(carry["ckpt"].dtype), mode="drop")
    if s.stores and "into" not in o:
        res_f = jnp.where(writes, c["res_slot"], s.dummy("res"))  # slot n_res: dropped
        carry["res"] = [buf.at[res_f].set(r.astype(buf.dtype), mode="drop") for buf, r in zip(carry["res"], o["res"])]
    if s.Sc:
        # own K/V into the document's pool rows, and those rows' dK/dV cleared: later slices'
        # backwards add into them (a region's rows held another document's before)
        if "into" not in o:
            rows = slots.written_own_rows(s, c, writes)
            carry["ck"] = slots.put_rows(carry["ck"], rows, o["k_own"])
            carry["cv"] = slots.put_rows(carry["cv"], rows, o["v_own"])
        carry["dck"] = slots.clear_own_rows(carry["dck"], c, writes)
        carry["dcv"] = slots.clear_own_rows(carry["dcv"], c, writes)
    carry["g_rest"] = add_part(carry["g_rest"], o["d_head"])  # the last stage's
    carry["loss"] = carry["loss"] + o["loss"]
    carry["count"] = carry["count"] + o["count"]
    return o["send_act"]


def per_layer_modes(mode, layers: int):
    """A pass's ``xs`` entry for layer modes: None where the mode is static (every layer's)."""
    return None if isinstance(mode, int) else jnp.broadcast_to(mode, (layers,))
