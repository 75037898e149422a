"""The pipeline strategy through the research API (jvarlen.api): Plans + documents -> one optimizer
update per iteration, equal to the single-device train step; rounded signatures reuse the
compiled step, and a predicted signature compiles ahead of time in the background."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, values_compile
from pipeline_helpers import PLAN_A, PLAN_B, assert_tree_close, plan_documents, tiny_config, tiny_params
from pipeline_helpers import reference_batch as _reference_batch

from jvarlen.api import Session
from jvarlen.data import Piece
from jvarlen.layout import Layout
from jvarlen.parallel.pipeline import chunk_links, split_documents
from jvarlen.parallel.pipeline.prepare import pad_plan
from jvarlen.plan import schedule as sch
from jvarlen.plan.buffers import op_ticks, plan_ticks
from jvarlen.plan.plan import Plan, PlanError
from jvarlen.runtime.state import TrainState
from jvarlen.runtime.step import make_train_step, single_program_grads

LAYOUT = Layout(dp=2, pp=2, sp=2)  # all 8 devices, like the loop's layouts
# plan B without its last chunk: the runner pads that pipeline with an empty chunk
PLAN_B5 = (PLAN_B[0][:6], PLAN_B[1][:5])


def _plan(template, seed, schedule_kind, ckpt_seed):
    docs, chunks = plan_documents(template, seed)
    n = len(chunks)
    prev = chunk_links(chunks)
    sched = sch.token_level_1f1b(prev, LAYOUT.pp) if schedule_kind == "token" else sch.gpipe(n, LAYOUT.pp, prev)
    ckpt = np.random.default_rng(ckpt_seed).integers(0, 3, size=(n, LAYOUT.pp)).astype(np.int32)
    if schedule_kind == "gpipe":
        # the last stage runs GPipe's last chunk fused: its signature holds the fused op, which the
        # token-level plans below need (a plan that fuses no chunk compiles none)
        ckpt[-1, -1] = 0
    plan = Plan(
        policy="hand",
        layout=LAYOUT,
        num_layers=4,
        lengths=tuple(len(d) for d in docs),
        chunks=tuple(tuple(c) for c in chunks),
        unit_sizes=(n,),
        schedule=sched,
        ckpt_layers=ckpt,
        memory_budget_bytes=1e9,
        stats={"bubble_ratio": 0.25, "iteration_time_s": 0.01},
    )
    return plan, docs


def _unfused(*plans):
    """``plans`` with their last chunk recomputing a layer on the last stage: none is fused."""
    out = []
    for plan in plans:
        ckpt = np.array(plan.ckpt_layers)
        ckpt[-1, -1] = 1
        out.append(dataclasses.replace(plan, ckpt_layers=ckpt))
    return out


def _forwards(plan, n_chunks):
    """Layer forwards per stage the executor runs for ``plan`` padded to ``n_chunks``: the padding
    chunks hold no token and run nothing (``prepare.skip_empty``)."""
    _, sched, ckpt = pad_plan(plan, n_chunks, 2)
    tf, tb = op_ticks(plan_ticks(sched, ckpt), n_chunks)
    ckpt = np.where(tf == tb, 0, ckpt)[: plan.n_chunks]
    return plan.n_chunks * 2 + ckpt.sum(0)


def test_runner_step_equals_reference_update_and_reuses_the_executable():
    require_devices(LAYOUT.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    optimizer = optax.sgd(0.5)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.key(0)),
    )
    reference_step = jax.jit(make_train_step(single_program_grads(graphdef), optimizer))
    reference_state = state
    # the loop's canonical FSDP placement of the state stays the placement after each step
    session = Session(graphdef, cfg, optimizer, state, compiler_options=values_compile())
    state, placement, cache = session.state, session.placement, session.cache
    step = session.plan_step(LAYOUT, bucket=32, residual_policy="all")
    # the first plan's signature is predicted and compiled ahead of time in the background
    (pa, da), (pb, db) = _plan(PLAN_A, 10, "gpipe", 0), _plan(PLAN_B, 20, "gpipe", 5)
    key = step.prepare([pa, pb], [da, db]).key
    assert key.fused and not step.prepare(_unfused(pa, pb), [da, db]).key.fused
    future = cache.precompile(key, step.strategy.compile)
    future.result()
    (sig,) = cache.compiled_by
    assert cache.compiled_by[sig].startswith("step-aot")
    # token-level 1F1B fits GPipe's buffers; then plan B loses a chunk and is padded with an
    # empty one (its token-level table plus a GPipe tail: in paired ticks it still fits)
    for it, (kind, plan_b) in enumerate((("gpipe", PLAN_B), ("token", PLAN_B), ("token", PLAN_B5))):
        (pa, da), (pb, db) = _plan(PLAN_A, 10 + it, kind, it), _plan(plan_b, 20 + it, kind, 5 + it)
        expected, ref_metrics = reference_step(reference_state, _reference_batch(da + db))
        reference_state = expected
        prepared = step.prepare([pa, pb], [da, db])
        hit = prepared.key in cache
        state, metrics = step(state, prepared)
        np.testing.assert_allclose(metrics["loss_sum"], ref_metrics["loss_sum"], rtol=1e-5)
        np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
        assert_tree_close(state.params, expected.params)
        assert int(state.step) == it + 1
        for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(placement.state_sharding)):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        info = prepared.info
        assert info["chunks"] == 6 + pb.n_chunks
        assert info["split_documents"] == split_documents(pa) + split_documents(pb) == 3
        assert hit and prepared.key == sig
        assert info["predicted_bubble_ratio"] == 0.25
        # 2 layers of forwards per stage for each real chunk (B's padding chunk runs nothing), plus
        # recomputation, except chunks the last stage runs fused (paired ticks: those it recomputes
        # nothing of), which recompute nothing
        expected_forwards = [_forwards(p, 6) for p in (pa, pb)]
        np.testing.assert_array_equal(metrics["layer_forwards"], expected_forwards)
    # an epoch's last batch may leave a pipeline without documents: it runs the feed's idle piece, a
    # one-token document without a target (runtime.feed.idle_piece), and the update is plan A's alone
    (pa, da), (pi, di) = _plan(PLAN_A, 40, "token", 9), _plan(((1,), [[(0, 0, 1)]]), 41, "token", 0)
    expected, ref_metrics = reference_step(reference_state, _reference_batch(da))
    state, metrics = step(state, step.prepare([pa, pi], [da, di]))
    np.testing.assert_allclose(metrics["loss_sum"], ref_metrics["loss_sum"], rtol=1e-5)
    np.testing.assert_allclose(metrics["target_tokens"], ref_metrics["target_tokens"])
    assert_tree_close(state.params, expected.params)
    assert len(cache) == 1 and cache.stats.misses == 0


def test_research_steps_refuse_inputs_they_would_run_wrongly():
    """What the research API refuses before compiling: documents longer than their plan says (the
    executor would cut them to the plan's chunks), plans that leave tokens out or plan them twice,
    plans of another layout, a layout that does
    not fit the devices, ids outside the vocabulary; and steps whose programs differ beyond their
    signature (residual policy, stage weights) keep separate compile caches."""
    require_devices(LAYOUT.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    optimizer = optax.sgd(0.5)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.key_data(jax.random.key(0)))
    with pytest.raises(ValueError, match=r"embedding is \(64, 32\), the model config's .* is \(128, 32\)"):
        Session(graphdef, dataclasses.replace(cfg, vocab_size=128), optimizer, state)  # another model's config
    mine = dataclasses.replace(cfg)
    session = Session(graphdef, mine, optimizer, state, compiler_options=values_compile())
    mine.vocab_size = 128  # the caller's config changed later: the session keeps the model it was given
    step = session.plan_step(LAYOUT, bucket=32)
    (pa, da), (pb, db) = _plan(PLAN_A, 10, "gpipe", 0), _plan(PLAN_B, 20, "gpipe", 5)
    longer = list(da)
    longer[5] = np.concatenate([longer[5], longer[5][:10]])
    with pytest.raises(ValueError, match=r"pipeline 0: documents of \[.*\] tokens, but its plan is for"):
        step.prepare([pa, pb], [longer, db])
    with pytest.raises(ValueError, match="2 plans but 1 lists of documents"):
        step.prepare([pa, pb], [da])
    # a plan whose chunks leave a document's tokens out or hold them twice (before: trained as is,
    # the document never or twice)
    lengths, chunks = PLAN_A
    dropped = (lengths, [[(0, 0, 10)], *chunks[1:]])  # document 1's 7 tokens in no chunk
    twice = (lengths, [chunks[0], [*chunks[1], (1, 0, 7)], *chunks[2:]])  # document 1 in two chunks
    for template, problem in ((dropped, r"document 1: tokens 0\.\.7 missing"), (twice, "overlap")):
        bad, docs = _plan(template, 10, "gpipe", 0)
        with pytest.raises(PlanError, match=problem):
            step.prepare([bad, pb], [docs, db])
    with pytest.raises(ValueError, match="token id 64 is outside the model's vocabulary"):
        step.prepare([pa, pb], [[np.full(len(d), 64) for d in da], db])
    with pytest.raises(ValueError, match="next_token 64 is outside the model's vocabulary"):
        session.layout_step(Layout(dp=8), rows=8, seq_len=16).prepare([Piece(np.arange(1, 5), 0, 64)])
    # no token to predict: the update would still move the parameters (before: it did, by up to 4e-4)
    for nothing in ([], [np.array([5])]):
        with pytest.raises(ValueError, match="no token to predict"):
            session.layout_step(Layout(dp=8), rows=8, seq_len=16).prepare(nothing)
    # a plan of another model: its recomputation counts are of other stages (before: run as given)
    with pytest.raises(ValueError, match="pipeline 0: a plan for 8 layers, the model has 4"):
        step.prepare([dataclasses.replace(pa, num_layers=8), pb], [da, db])
    # a batch packed elsewhere: rows padded up to dp as prepare pads them; bad arrays refused (before:
    # JAX's IndivisibleError for 3 rows on dp = 8)
    layout_step = session.layout_step(Layout(dp=8), rows=8, seq_len=16)
    packed = layout_step.prepare([np.arange(1, 9), np.arange(2, 12)]).arrays
    three = {k: v[:3] for k, v in packed.items()}
    assert layout_step.from_arrays(three).arrays["tokens"].shape == (8, 16)
    consumed = session.state
    session.state, metrics = layout_step(consumed, layout_step.from_arrays(three))  # the state is donated
    assert np.isfinite(float(metrics["loss_sum"])) and float(metrics["target_tokens"]) == 7 + 9
    # a consumed state again (before: JAX read freed buffers; the process crashed on 8 CPU devices)
    with pytest.raises(ValueError, match="consumed by an earlier step"):
        layout_step(consumed, layout_step.from_arrays(three))
    real = three["segment_ids"] > 0
    for bad, message in (
        ({k: v for k, v in three.items() if k != "loss_mask"}, "needs the arrays"),
        ({**three, "tokens": three["tokens"][:, :8]}, "of one shape"),
        # what prepare refuses, packed elsewhere (before: a NaN loss and a skipped update, a wrapped
        # id, an update from an empty batch)
        ({**three, "tokens": np.where(real, cfg.vocab_size, 0)}, f"tokens holds id {cfg.vocab_size}, outside"),
        ({**three, "targets": np.where(three["loss_mask"] > 0, -1, 0)}, "targets holds id -1, outside"),
        ({**three, "loss_mask": np.zeros_like(three["loss_mask"])}, "loss_mask is zero everywhere"),
        ({**three, "tokens": three["tokens"].astype(np.float32)}, "tokens must hold integers"),
    ):
        with pytest.raises(ValueError, match=message):
            layout_step.from_arrays(bad)
    other = session.plan_step(Layout(dp=1, pp=2, sp=4), bucket=32)
    with pytest.raises(ValueError, match=r"a plan for Layout\(dp=2, pp=2, sp=2\) given to the pipeline step of"):
        other.prepare([pa], [da])
    with pytest.raises(ValueError, match="dp\\*pp\\*sp = 6 but there are 8 devices"):
        session.plan_step(Layout(dp=3, pp=2, sp=1))
    with pytest.raises(ValueError, match="no pipeline stages"):
        session.layout_step(Layout(dp=2, pp=4, sp=1), rows=2, seq_len=16)
    with pytest.raises(ValueError, match="seq_len divisible by sp"):
        session.layout_step(Layout(dp=2, pp=1, sp=4), rows=2, seq_len=18)
    with pytest.raises(ValueError, match="parallel.residual_policy: unknown residual policy 'bogus'"):
        session.layout_step(Layout(dp=8), rows=8, seq_len=16, residual_policy="bogus")
    assert step.cache is session.cache and other.cache is session.cache  # same options: one cache
    sharded = session.plan_step(LAYOUT, bucket=32, stage_weights="sharded")
    stored = session.plan_step(LAYOUT, bucket=32, residual_policy="all")
    assert len({id(step.cache), id(sharded.cache), id(stored.cache)}) == 3
