"""Elastic pipeline executor: any valid plan of chunks through ``pp`` stages in one program.

See docs/design/pipeline.md. Static: the :class:`PipelineSignature` (layout, bucket,
chunk count, tick count, context bucket, slot counts). Runtime data: the chunks, the
tick table ``[ticks, pp, 2]`` from ``jvarlen.plan.schedule``, and the slot tables of
``pipeline_buffers`` (which also encode the recomputation table). Mesh axes
``(dp, pp, sp)`` of ``jvarlen.parallel.layouts``; every pipeline (``dp`` index) has its
own chunks and tables; Ulysses runs inside each stage over ``sp``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.model import AttentionInputs, cross_entropy_sums, make_attention_fn
from jvarlen.model.transformer import abstract_model, resolve_compute_dtype
from jvarlen.parallel import ulysses
from jvarlen.parallel.layouts import DP, PP, SP, layout_mesh
from jvarlen.parallel.pipeline_buffers import FUSED, assign_slots, fuse_single_stage
from jvarlen.parallel.pipeline_chunks import CHUNK_KEYS, PackedChunks, stack_pipelines
from jvarlen.parallel.pipeline_stage import StageFns, maybe, residual_shapes
from jvarlen.plan.schedule import Schedule, ScheduleError

DATA = DP  # pipelines (independent data) over the layout's dp axis
TABLE_KEYS = ("ops", "stash_slot", "grad_slot", "ctx_slot", "res_slot", "recv_act", "recv_grad")


@dataclasses.dataclass(frozen=True)
class PipelineSignature:
    """Everything that shapes the compiled step (the compiled-step cache key)."""

    layout: Layout
    num_layers: int
    bucket: int  # T, tokens per chunk
    n_chunks: int
    n_ticks: int
    context: int  # Sc, context tokens per split document in flight (0: no split document)
    n_stash: int
    n_grad: int
    n_ctx: int
    n_res: int  # stored-layer residual slots per stage

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.layout.pp


def pipeline_mesh(layout: Layout, devices=None) -> jax.sharding.Mesh:
    """The layout's ``(dp, pp, sp)`` mesh (``jvarlen.parallel.layouts``) over the first
    ``layout.num_devices`` devices."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < layout.num_devices:
        raise ValueError(f"{layout} needs {layout.num_devices} devices, have {len(devices)}")
    return layout_mesh(layout, devices[: layout.num_devices])


# --------------------------------------------------------------------------- host side


def prepare_batch(
    packs: Sequence[PackedChunks],
    schedules: Sequence[Union[Schedule, np.ndarray]],
    ckpt_layers: Sequence[np.ndarray],
    layout: Layout,
    num_layers: int,
    *,
    signature: Optional[PipelineSignature] = None,
    fuse: bool = True,
) -> tuple[PipelineSignature, dict]:
    """Numpy device inputs of one iteration (one pack, schedule, ckpt table per pipeline).

    ``schedules[i]``: a :class:`Schedule` (run as its ASAP tick table) or a tick table
    ``[ticks, pp, 2]`` from the planner (validated with ``Schedule.from_ticks``).
    ``ckpt_layers[i] [n, pp]``: layers recomputed per chunk and stage (InfiniPipe Eq. 15-16).
    ``signature``: run inside that compiled step's buffers (raises naming the stage, tick and
    chunks when the tables need more slots, ticks or context); else the smallest signature.
    ``fuse``: with one stage, run each F directly followed by its B as one fused op
    (``pipeline_buffers.fuse_single_stage``); False keeps them in separate ticks.
    Returns (signature, ``{key: [dp, ...]}``).
    """
    if not (len(packs) == len(schedules) == len(ckpt_layers) == layout.dp):
        raise ValueError(f"need one pack, schedule and ckpt table per pipeline (dp={layout.dp})")
    if num_layers % layout.pp:
        raise ValueError(f"num_layers ({num_layers}) must be divisible by pp ({layout.pp})")
    ls = num_layers // layout.pp
    tables = []
    for pack, sched, ckpt in zip(packs, schedules, ckpt_layers):
        if isinstance(sched, Schedule):
            if tuple(sched.chunk_prev) != tuple(pack.chunk_prev):
                raise ScheduleError(f"schedule links {sched.chunk_prev} differ from the chunks' {pack.chunk_prev}")
            sched.validate()
            ticks = sched.to_ticks()
        else:
            ticks = np.asarray(sched, np.int32)
            Schedule.from_ticks(ticks, pack.chunk_prev)
        if ticks.shape[1] != layout.pp:
            raise ScheduleError(f"tick table has {ticks.shape[1]} stages, layout has pp={layout.pp}")
        if layout.pp == 1 and fuse:
            ticks = fuse_single_stage(ticks)
        ckpt = np.asarray(ckpt, np.int32)
        if ckpt.shape != (pack.n_chunks, layout.pp):
            raise ValueError(f"ckpt_layers must be [n_chunks, pp] = {(pack.n_chunks, layout.pp)}, got {ckpt.shape}")
        slots = assign_slots(ticks, pack.chunk_prev, ckpt, ls, uses_context=(pack.ctx_len > 0) | (pack.has_next > 0))
        tables.append((ticks, slots))
    bucket = packs[0].bucket
    context = max(p.context_bucket() for p in packs)
    context = -(-context // bucket) * bucket if context else 0
    need = dict(
        n_ticks=max(t.shape[0] for t, _ in tables),
        context=context,
        **{name: max(getattr(s, name) for _, s in tables) for name in ("n_stash", "n_grad", "n_ctx", "n_res")},
    )
    if signature is None:
        sig = PipelineSignature(layout, num_layers, bucket, packs[0].n_chunks, **need)
    else:
        sig = signature
        _check_fits(sig, layout, num_layers, bucket, packs[0].n_chunks, need, [s for _, s in tables])
    out = stack_pipelines(packs)
    per = {key: [] for key in TABLE_KEYS}
    for ticks, slots in tables:
        slots = slots.with_counts(sig.n_stash, sig.n_grad, sig.n_ctx, sig.n_res)
        pad = sig.n_ticks - ticks.shape[0]
        idle = np.zeros((pad, layout.pp, 2), np.int32)
        idle[..., 1] = -1
        per["ops"].append(np.concatenate([ticks, idle]))
        per["recv_act"].append(np.concatenate([slots.recv_act, np.full((pad, layout.pp), sig.n_stash, np.int32)]))
        per["recv_grad"].append(np.concatenate([slots.recv_grad, np.full((pad, layout.pp), sig.n_grad, np.int32)]))
        for key in ("stash_slot", "grad_slot", "ctx_slot", "res_slot"):
            per[key].append(getattr(slots, key))
    out.update({key: np.stack(v).astype(np.int32) for key, v in per.items()})
    return sig, out


def _check_fits(sig, layout, num_layers, bucket, n_chunks, need, slot_tables) -> None:
    fixed = dict(layout=layout, num_layers=num_layers, bucket=bucket, n_chunks=n_chunks)
    for name, value in fixed.items():
        if getattr(sig, name) != value:
            raise ValueError(f"plan has {name}={value}, the compiled signature has {getattr(sig, name)}")
    for name, value in need.items():
        if value <= getattr(sig, name):
            continue
        where = ""
        kind = name[2:] if name.startswith("n_") else None
        for slots in slot_tables:
            if kind in slots.peaks and getattr(slots, name) == value:
                stage, tick, who = slots.peaks[kind]
                where = f" (stage {stage}, tick {tick}: chunks {who} live at once)"
        raise ScheduleError(
            f"window overflow: the tables need {name}={value} but the compiled signature has "
            f"{getattr(sig, name)}{where}"
        )


# --------------------------------------------------------------------------- device side


def split_params(params):
    """(stacked layer state [L, ...], the rest: embed, final norm, head)."""
    rest = nnx.State({k: v for k, v in params.items() if k != "layers"})
    return params["layers"], rest


def make_pipeline_grads(
    graphdef, cfg: ModelConfig, sig: PipelineSignature, mesh, attention_fn=None, residual_policy: Optional[str] = None
):
    """The un-jitted ``grads(params, batch) -> (sums, grads, layer_forwards [dp, pp])``.

    ``grads`` are of the mean loss over every real target of all pipelines (like
    ``jvarlen.runtime.step.loss_and_grads``), accumulated over chunks and pipelines.
    ``residual_policy``: what a stored layer keeps (see ``StageFns.residual_policy``).
    """
    layout = sig.layout
    pp, ls, T, sp = layout.pp, sig.layers_per_stage, sig.bucket, layout.sp
    if T % sp or cfg.num_heads % sp:
        raise ValueError(f"sp={sp} must divide the chunk bucket ({T}) and num_heads ({cfg.num_heads})")
    Tl = T // sp  # tokens of a chunk on one device of an sp group
    d, D = cfg.d_model, cfg.head_dim or cfg.d_model // cfg.num_heads
    repeats = ulysses.kv_repeats(cfg.num_kv_heads, sp)
    K = cfg.num_kv_heads * repeats // sp  # kv heads per device after the Ulysses all_to_all
    Sc = sig.context
    cdt = resolve_compute_dtype(cfg.compute_dtype)
    attention_fn = attention_fn or make_attention_fn(cfg.attention)
    layer_graphdef, _ = nnx.split(abstract_model(cfg).layers, nnx.Param)
    fns = StageFns(
        layer_graphdef,
        attention_fn,
        cdt,
        with_context=Sc > 0,
        sp=sp,
        kv_repeats=repeats,
        residual_policy=residual_policy,
    )
    dummy = dict(stash=sig.n_stash, grad=sig.n_grad, ctx=sig.n_ctx, res=sig.n_res)
    stores = sig.n_res > 0  # static: a signature without residual slots recomputes every layer

    def device_fn(layers, rest, b, scale):
        b = jax.tree.map(lambda a: a[0], b)
        stage = jax.lax.axis_index(PP)
        mine = jax.lax.axis_index(SP) * Tl  # first token of this device's part of a chunk
        is_first, is_last = stage == 0, stage == pp - 1

        def model_of(r):
            return nnx.merge(graphdef, r, nnx.State({"layers": layers}))

        def embed(r, tokens):
            return model_of(r).embed_tokens(tokens[None])[0]

        def head_loss(r, y, targets, mask):
            logits = model_of(r).logits(y[None])
            return cross_entropy_sums(logits, targets[None], mask[None])["loss_sum"]

        out = {}  # every op's outputs, zeros where the op has none (filled in below)

        def chunk(k):
            c = {key: jax.lax.dynamic_index_in_dim(b[key], k, 0, keepdims=False) for key in CHUNK_KEYS}
            c["C"] = b["ctx_len"][k]
            c["slots"] = {name: b[name + "_slot"][k, stage] for name in ("stash", "grad", "ctx")}
            c["res_slot"] = b["res_slot"][k, stage]
            seg, pos = c["segment_ids"], c["positions"]
            if Sc:
                # The context buffers hold a document's keys 0..C-1 at [0, C). The stage sees
                # them rolled right by Sc - C, i.e. at [Sc - C, Sc), right before the chunk's own
                # keys: the visible keys of a query are then one contiguous run and the
                # attention's tile lists skip the unused [C, Sc) part of the bucket.
                c["shift"] = Sc - c["C"]
                ar = jnp.arange(Sc, dtype=jnp.int32)
                in_ctx = ar >= c["shift"]
                kv_seg = jnp.concatenate([jnp.where(in_ctx, seg[0], 0), seg])
                kv_pos = jnp.concatenate([jnp.where(in_ctx, ar - c["shift"], 0), pos])
                c["inputs"] = AttentionInputs(seg[None], pos[None], kv_seg[None], kv_pos[None])
            else:
                c["inputs"] = AttentionInputs(seg[None], pos[None])
            c["own"] = ((b["has_next"][k] > 0) & (seg == seg[0]) & (seg > 0)).astype(cdt)[None, :, None, None]
            for key in ("tokens", "targets", "loss_mask", "positions"):  # this device's tokens
                c["local_" + key] = jax.lax.dynamic_slice_in_dim(c[key], mine, Tl)
            return c

        def roll_ctx(a, c, back=False):
            """Context K/V (or their gradients) [Ls, Sc, K, D] between the buffers' layout and the
            stage's (rolled by Sc - C); ``back`` undoes it. Identity without context."""
            if not Sc:
                return a
            return jnp.roll(a, -c["shift"] if back else c["shift"], axis=1)

        def put(buf, i, value):
            return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)

        def get(buf, i):
            return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)

        # The switch branches never see a buffer: what an op reads is gathered before it and
        # what it writes is scattered after it (to the dummy slot when it writes nothing), so
        # every buffer update is an in-place dynamic-update-slice in the tick loop's carry.
        def fwd(r, k):
            c = chunk(k)
            x = jnp.where(is_first, embed(rest, c["local_tokens"]), r["x"])
            recompute = c["res_slot"] == dummy["res"] if stores else None
            y, k_own, v_own, residuals, n = fns.forward(
                layers, x, r["ck"], r["cv"], c["inputs"], c["local_positions"], recompute
            )

            def last():
                loss, vjp_fn = jax.vjp(
                    lambda rr, yy: head_loss(rr, yy, c["local_targets"], c["local_loss_mask"]), rest, y
                )
                d_rest, dy = vjp_fn(scale.astype(loss.dtype))
                return loss, d_rest, dy

            loss, d_rest, dy = maybe(is_last, last)
            return dict(
                out,
                send_act=y,
                x_in=x,
                dy_last=dy,
                res=residuals,
                k_own=k_own * c["own"],
                v_own=v_own * c["own"],
                d_rest=d_rest,
                loss=loss,
                count=n,
            )

        def bwd(r, k):
            c = chunk(k)
            if Sc:
                at, size = (0, c["C"], 0, 0), (ls, T, K, D)
                dk_own = jax.lax.dynamic_slice(r["dck"], at, size) * c["own"]
                dv_own = jax.lax.dynamic_slice(r["dcv"], at, size) * c["own"]
            else:
                dk_own = dv_own = jnp.zeros((ls, T, K, D), cdt)
            dx, dlayers, dck, dcv, n = fns.backward(
                layers,
                r["x"],
                r["dy"],
                r["ck"],
                r["cv"],
                dk_own,
                dv_own,
                r["res"] if stores else None,
                c["res_slot"] == dummy["res"],
                c["inputs"],
                c["local_positions"],
            )

            def first():
                _, vjp_fn = jax.vjp(lambda rr: embed(rr, c["local_tokens"]), rest)
                return vjp_fn(dx)[0]

            return dict(out, send_grad=dx, d_layers=dlayers, dck=dck, dcv=dcv, d_rest=maybe(is_first, first), count=n)

        def fused(r, k):
            """pp = 1: F and B of chunk k in one tick (plain autodiff, nothing stored across ticks)."""
            c = chunk(k)

            def stage_loss(layers_, rest_, ck, cv):
                x = embed(rest_, c["local_tokens"])
                y, *_ = fns.forward(layers_, x, ck, cv, c["inputs"], c["local_positions"], None)
                return head_loss(rest_, y, c["local_targets"], c["local_loss_mask"])

            loss, vjp_fn = jax.vjp(stage_loss, layers, rest, r["ck"], r["cv"])
            d_layers, d_rest, dck, dcv = vjp_fn(scale.astype(loss.dtype))
            return dict(out, d_layers=d_layers, d_rest=d_rest, dck=dck, dcv=dcv, loss=loss, count=jnp.int32(ls))

        def idle(r, k):
            return out

        branches = [idle, fwd, bwd] + ([fused] if pp == 1 else [])

        def tick(carry, t):
            row = b["ops"][t, stage]
            op, k = jnp.clip(row[0], 0, len(branches) - 1), jnp.maximum(row[1], 0)
            is_f, is_b = op == 1, op == 2
            takes_dctx = is_b | (op == FUSED)  # ops that add to the context dK/dV accumulator
            c = chunk(k)
            s = c["slots"]
            reads = dict(
                x=get(carry["stash"], s["stash"]),
                dy=get(carry["grad_in"], s["grad"]),
                ck=roll_ctx(get(carry["ck"], s["ctx"]), c),
                cv=roll_ctx(get(carry["cv"], s["ctx"]), c),
                dck=get(carry["dck"], s["ctx"]),
                dcv=get(carry["dcv"], s["ctx"]),
                res=[]
                if not stores
                else jax.lax.cond(
                    is_b,
                    # recomputed layers (slot n_res) read a clipped slot they never use
                    lambda bufs: [jnp.take(buf, c["res_slot"], axis=0, mode="clip") for buf in bufs],
                    lambda bufs: [jnp.zeros((ls,) + buf.shape[1:], buf.dtype) for buf in bufs],
                    carry["res"],
                ),
            )
            o = jax.lax.switch(op, branches, reads, k)
            carry = dict(carry)
            carry["stash"] = put(carry["stash"], jnp.where(is_f & is_first, s["stash"], dummy["stash"]), o["x_in"])
            carry["grad_in"] = put(carry["grad_in"], jnp.where(is_f & is_last, s["grad"], dummy["grad"]), o["dy_last"])
            carry["res"] = (
                []
                if not stores
                else jax.lax.cond(
                    is_f,
                    lambda bufs, new: [
                        buf.at[c["res_slot"]].set(r.astype(buf.dtype), mode="drop") for buf, r in zip(bufs, new)
                    ],
                    lambda bufs, new: list(bufs),
                    carry["res"],
                    o["res"],
                )
            )
            if Sc:
                ctx_f = jnp.where(is_f, s["ctx"], dummy["ctx"])
                carry["ck"] = jax.lax.dynamic_update_slice(
                    carry["ck"], o["k_own"][None].astype(cdt), (ctx_f, 0, c["C"], 0, 0)
                )
                carry["cv"] = jax.lax.dynamic_update_slice(
                    carry["cv"], o["v_own"][None].astype(cdt), (ctx_f, 0, c["C"], 0, 0)
                )
                # a document's first slice clears its dK/dV accumulator; a backward adds to it
                start = is_f & (b["has_next"][k] > 0) & (c["C"] == 0)
                ctx_b = jnp.where(takes_dctx | start, s["ctx"], dummy["ctx"])
                keep = takes_dctx.astype(cdt)
                carry["dck"] = put(carry["dck"], ctx_b, keep * reads["dck"] + roll_ctx(o["dck"], c, back=True))
                carry["dcv"] = put(carry["dcv"], ctx_b, keep * reads["dcv"] + roll_ctx(o["dcv"], c, back=True))
            carry["g_layers"] = jax.tree.map(jnp.add, carry["g_layers"], o["d_layers"])
            carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], o["d_rest"])
            carry["loss"] = carry["loss"] + o["loss"]
            carry["count"] = carry["count"] + o["count"]
            if pp > 1:
                recv_act = jax.lax.ppermute(o["send_act"].astype(cdt), PP, [(i, i + 1) for i in range(pp - 1)])
                recv_grad = jax.lax.ppermute(o["send_grad"].astype(cdt), PP, [(i + 1, i) for i in range(pp - 1)])
                carry["stash"] = put(carry["stash"], b["recv_act"][t, stage], recv_act)
                carry["grad_in"] = put(carry["grad_in"], b["recv_grad"][t, stage], recv_grad)
            return carry, None

        x0 = jnp.zeros((Tl, d), cdt)
        c0 = chunk(jnp.int32(0))
        layer0 = jax.tree.map(lambda a: a[0], layers)
        ctx0 = jnp.zeros((Sc, K, D), cdt)
        res_shapes = residual_shapes(fns, layer0, x0, ctx0, ctx0, c0["inputs"], c0["local_positions"])
        zeros_ctx = jnp.zeros((sig.n_ctx + 1, ls, Sc, K, D), cdt)
        act = jnp.zeros((Tl, d), cdt)
        kv_own = jnp.zeros((ls, T, K, D), cdt)
        out.update(
            send_act=act,
            send_grad=act,
            x_in=act,
            dy_last=act,
            res=[jnp.zeros((ls,) + r.shape, r.dtype) for r in res_shapes] if stores else [],
            k_own=kv_own,
            v_own=kv_own,
            dck=zeros_ctx[0],
            dcv=zeros_ctx[0],
            d_layers=jax.tree.map(jnp.zeros_like, layers),
            d_rest=jax.tree.map(jnp.zeros_like, rest),
            loss=jnp.zeros((), jnp.float32),
            count=jnp.zeros((), jnp.int32),
        )
        carry = dict(
            stash=jnp.zeros((sig.n_stash + 1, Tl, d), cdt),
            grad_in=jnp.zeros((sig.n_grad + 1, Tl, d), cdt),
            ck=zeros_ctx,
            cv=zeros_ctx,
            dck=zeros_ctx,
            dcv=zeros_ctx,
            # no dummy residual slot: writes to slot n_res (recomputed layers) are dropped
            res=[jnp.zeros((sig.n_res,) + s.shape, s.dtype) for s in res_shapes] if stores else [],
            g_layers=jax.tree.map(jnp.zeros_like, layers),
            g_rest=jax.tree.map(jnp.zeros_like, rest),
            loss=jnp.zeros((), jnp.float32),
            count=jnp.zeros((), jnp.int32),
        )
        carry, _ = jax.lax.scan(tick, carry, jnp.arange(sig.n_ticks))
        g_layers = jax.lax.psum(carry["g_layers"], (DATA, SP))
        g_rest = jax.lax.psum(carry["g_rest"], (DATA, PP, SP))
        loss = jax.lax.psum(carry["loss"], (DATA, PP, SP))
        return g_layers, g_rest, loss, carry["count"].reshape(1, 1)

    def grads(params, batch):
        layers, rest = split_params(params)
        targets = jnp.sum(batch["loss_mask"]).astype(jnp.float32)
        scale = 1.0 / jnp.maximum(targets, 1.0)
        layer_spec = jax.tree.map(lambda _: P(PP), layers)
        rest_spec = jax.tree.map(lambda _: P(), rest)
        batch_spec = {key: P(DATA) for key in batch}
        g_layers, g_rest, loss, count = jax.shard_map(
            device_fn,
            mesh=mesh,
            in_specs=(layer_spec, rest_spec, batch_spec, P()),
            out_specs=(layer_spec, rest_spec, P(), P(DATA, PP)),
            check_vma=False,
        )(layers, rest, batch, scale)
        grads = nnx.merge_state(g_rest, nnx.State({"layers": g_layers}))
        return {"loss_sum": loss, "target_tokens": targets}, grads, count

    return grads
