"""The pipeline executor against the single-device reference: all chunk kinds (one document
split into 4 slices), GPipe / 1F1B / token-level 1F1B tables, recomputation none/all/mixed,
on (pp, sp, dp) = (2, 1, 4), (4, 1, 2), (2, 2, 2), (4, 2, 1) and (1, 2, 2) (one stage:
adjacent F and B fused) — one compiled step per layout."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_devices, values_compile
from pipeline_helpers import (
    PLAN_A,
    PLAN_B,
    PLAN_C,
    PipelineGrads,
    assert_tree_close,
    pipelines,
    reference,
    tiny_config,
    tiny_params,
)

from jvarlen.layout import Layout
from jvarlen.parallel import pipeline as pl
from jvarlen.plan import schedule as sch
from jvarlen.plan.buffers import fuse_single_stage, op_ticks


def _cases(layout: Layout, num_layers: int):
    """(name, pipes, schedules, ckpt tables) for every schedule kind × recomputation kind."""
    pp, ls = layout.pp, num_layers // layout.pp
    split = pipelines(layout.dp, plans=(PLAN_A, PLAN_B))
    batched = pipelines(layout.dp, plans=(PLAN_C,), seed=200)
    rng = np.random.default_rng(7)
    kinds = {
        "gpipe": (split, lambda pk: sch.gpipe(pk.n_chunks, pp, pk.chunk_prev)),
        "1f1b": (batched, lambda pk: sch.one_f_one_b(pk.n_chunks, pp)),
        "token_1f1b": (split, lambda pk: sch.token_level_1f1b(pk.chunk_prev, pp)),
    }
    cases = []
    for kind, (pipes, build) in kinds.items():
        n = pipes[0][1].n_chunks
        for recompute in ("none", "all", "mixed"):
            if recompute == "mixed":
                ckpts = [rng.integers(0, ls + 1, size=(n, pp)).astype(np.int32) for _ in pipes]
            else:
                ckpts = [np.full((n, pp), 0 if recompute == "none" else ls, np.int32) for _ in pipes]
            cases.append((f"{kind}/{recompute}", pipes, [build(pk) for _, pk in pipes], ckpts, True))
        # the single-op table (one op per stage and tick) in the same executable
        cases.append((f"{kind}/mixed/one-op", *cases[-1][1:4], False))
    return cases


LAYOUTS = [
    Layout(dp=4, pp=2, sp=1),
    Layout(dp=2, pp=4, sp=1),
    Layout(dp=2, pp=2, sp=2),
    Layout(dp=1, pp=4, sp=2),
    Layout(dp=2, pp=1, sp=2),
]
# The default suite's layouts: every axis above 1 (dp, pp, sp together), pp = 4, and one stage;
# the slow suite runs them all.
DEFAULT_LAYOUTS = (LAYOUTS[2], LAYOUTS[3], LAYOUTS[4])


def _params(layouts):
    return [l if l in DEFAULT_LAYOUTS else pytest.param(l, marks=pytest.mark.slow) for l in layouts]


def expected_forwards(pack, sched, ckpt, layout: Layout, ls: int, paired: bool = True) -> np.ndarray:
    """Layer forwards per stage the table asks for: one per chunk and layer, plus the
    recomputed layers — except chunks whose F and B are fused (the last stage's adjacent F and B
    in the paired table; with one op per tick only with one stage; never a chunk the plan
    recomputes on the last stage), which recompute nothing."""
    ckpt = np.array(ckpt)
    keep = ckpt[:, -1] > 0
    if paired:
        ticks = sch.paired_ticks(sched, keep=keep)
    else:
        ticks = fuse_single_stage(sched.to_ticks(), keep=keep) if layout.pp == 1 else sched.to_ticks()
    tf, tb = op_ticks(ticks, pack.n_chunks)
    ckpt[tf == tb] = 0
    return pack.n_chunks * ls + ckpt.sum(axis=0)


@pytest.mark.parametrize("layout", _params(LAYOUTS), ids=str)
def test_matches_reference_under_every_table(layout):
    _matches_reference(layout)


@pytest.mark.parametrize("layout", _params([LAYOUTS[0], LAYOUTS[3]]), ids=str)
def test_per_layer_accumulation_matches_reference(layout):
    """The form a GPU step compiles (``per_layer_grads``): no conditional around lane 0's ops, each
    descent adding each layer's gradients and context dK/dV into the step's buffers as it goes;
    Ulysses inside the layers' conditionals where sp > 1."""
    _matches_reference(layout, per_layer_grads=True)


@pytest.mark.parametrize("per_layer_grads", [False, True])
def test_whole_documents_match_reference(per_layer_grads):
    """A signature without context (whole documents, 1F1B, the last stage fusing each chunk): on
    XLA:CPU the fused op is one ``jax.vjp`` of the stage (``fused_op``); in the per-layer form it
    runs as passes, adding each layer's gradients as it descends and writing each layer's
    residuals and (recomputed layers past the first) input to their slots as it ascends."""
    layout = Layout(dp=2, pp=2, sp=1)
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    pipes = pipelines(layout.dp, plans=(PLAN_C,), seed=300)
    n = pipes[0][1].n_chunks
    scheds = [sch.one_f_one_b(pk.n_chunks, layout.pp) for _, pk in pipes]
    mixed = np.broadcast_to(1 + np.arange(n)[:, None] % 2, (n, layout.pp)).astype(np.int32)  # 1 or 2 of 2 layers
    ckpts = [np.zeros((n, layout.pp), np.int32), mixed]
    sig, batch = pl.prepare_batch([pk for _, pk in pipes], scheds, ckpts, layout, cfg.num_layers)
    assert sig.context == 0 and sig.fused and sig.n_res > 0 and sig.n_ckpt > 0
    grads_of = PipelineGrads(graphdef, cfg, sig, params, per_layer_grads=per_layer_grads)
    sums, grads, _ = grads_of(params, batch)
    ref_sums, ref_grads = reference(graphdef, params, [d for docs, _ in pipes for d in docs])
    np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5)
    assert_tree_close(grads, ref_grads)


def _matches_reference(layout, per_layer_grads=None):
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    ls = cfg.num_layers // layout.pp
    cases = _cases(layout, cfg.num_layers)
    sig = pl.cover(
        *[
            pl.prepare_batch([pk for _, pk in pipes], scheds, ckpts, layout, cfg.num_layers, paired=paired)[0]
            for _, pipes, scheds, ckpts, paired in cases
        ]
    )
    assert sig.context > 0 and sig.n_res > 0 and sig.fused
    grads_of = PipelineGrads(
        graphdef, cfg, sig, params, compiler_options=values_compile(), per_layer_grads=per_layer_grads
    )  # new tables: same executable
    refs = {}
    for name, pipes, scheds, ckpts, paired in cases:
        _, batch = pl.prepare_batch(
            [pk for _, pk in pipes], scheds, ckpts, layout, cfg.num_layers, signature=sig, paired=paired
        )
        sums, grads, forwards = grads_of(params, batch)
        key = id(pipes)
        if key not in refs:
            refs[key] = reference(graphdef, params, [d for docs, _ in pipes for d in docs])
        ref_sums, ref_grads = refs[key]
        np.testing.assert_allclose(sums["target_tokens"], ref_sums["target_tokens"], err_msg=name)
        np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5, err_msg=name)
        assert_tree_close(grads, ref_grads)
        # recomputation is real: forwards + recomputed layers, per pipeline and stage
        expected = np.stack(
            [expected_forwards(pk, sc, ck, layout, ls, paired) for (_, pk), sc, ck in zip(pipes, scheds, ckpts)]
        )
        np.testing.assert_array_equal(np.asarray(forwards), expected, err_msg=name)
