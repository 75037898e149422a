"""The planner's account of what the pipeline executor holds (jvarlen.plan.executor_memory): the
same buffer sizes the compiled signature gets, within a few per cent of XLA's memory analysis of
the compiled step, and plans that fit it under the ``"paired"`` simulation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SHIPPED_CPU_PROFILE, require_devices

from jvarlen.config import Config
from jvarlen.layout import Layout
from jvarlen.parallel import pipeline as pl
from jvarlen.parallel.pipeline.stage import stored_token_bytes
from jvarlen.plan.api import PlannerOptions, plan_iteration
from jvarlen.plan.assemble import fit_executor_memory
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.executor_memory import executor_memory, fit_executor

# the shipped CPU profile's model, as the pipeline benchmark runs it
MODEL = dataclasses.replace(Config().model, compute_dtype="float32", attention="xla")
SHAPE = ModelShape.from_config(MODEL)
COEFFS = CostCoefficients.load(SHIPPED_CPU_PROFILE)
LAYOUT = Layout(1, 2, 1)
SPLIT = [4000, 3000, 500, 700, 200, 900]  # two documents split, four whole
OPTIONS = PlannerOptions(min_slice_tokens=256, simulation="paired")


def cost_of(budget: float = 80e9) -> CostModel:
    stored = stored_token_bytes(MODEL, "dots_and_attention")
    return CostModel(SHAPE, LAYOUT, COEFFS.replace(memory_budget=budget, m_stored_token=stored))


def documents(lengths):
    rng = np.random.default_rng(0)
    return [rng.integers(1, MODEL.vocab_size, size=n).astype(np.int32) for n in lengths]


@pytest.fixture(scope="module")
def plans():
    out = {}
    for name, budget, policy in (("free", 80e9, "epp"), ("tight", 60e6, "epp"), ("dapple", 80e9, "dapple")):
        cost = cost_of(budget)
        out[name] = (plan_iteration(SPLIT, cost=cost, policy=policy, options=OPTIONS), cost)
    return out


@pytest.mark.parametrize("name", ["free", "tight", "dapple"])
def test_the_account_sizes_the_buffers_as_the_compiled_signature_does(plans, name):
    """Bucket, context window, slot counts, pool rows and the fused op: as ``prepare_plans`` sizes
    the step of the plan alone (its rounded signature)."""
    plan, cost = plans[name]
    sizes = executor_memory(plan, cost).sizes
    sig, _ = pl.prepare_plans([plan], [documents(SPLIT)], SHAPE.num_layers, chunk_multiple=1)
    for field in ("bucket", "context", "n_stash", "n_grad", "ctx_rows", "n_res", "n_ckpt", "fused"):
        assert sizes[field] == getattr(sig, field), (field, sizes, sig)


@pytest.mark.parametrize("name", ["free", "dapple"])
def test_padding_a_plan_to_more_chunks_keeps_its_buffers(plans, name):
    """The runtime pads chunk counts (``chunk_multiple``; with dp > 1, to the longest pipeline's
    count). The empty chunks hold no more than the plan already does, so the account still holds:
    DAPPLE's 3 chunks padded to 16 held 14 stash and gradient slots instead of 2 while they ran
    in a GPipe tail."""
    plan, cost = plans[name]
    sizes = executor_memory(plan, cost).sizes
    for multiple in (4, 16):
        sig, _ = pl.prepare_plans([plan], [documents(SPLIT)], SHAPE.num_layers, chunk_multiple=multiple)
        assert sig.n_chunks == -(-plan.n_chunks // multiple) * multiple  # padded
        for field in ("n_stash", "n_grad", "ctx_rows", "n_res", "n_ckpt"):
            assert getattr(sig, field) == sizes[field], (field, multiple, sig)


def test_paired_plans_fit_the_executors_buffers(plans):
    """Under 60 MB the time line of EPP's checkpointing fits but the executor's buffers (each kind
    sized by its own peak, the fused op's stack) did not: the planner recomputes more until they do."""
    plan, cost = plans["tight"]
    account = executor_memory(plan, cost)
    assert plan.stats["executor_memory_bytes"] == pytest.approx(account.total)
    assert account.total <= cost.memory_budget and plan.stats["fits_memory"]
    assert any(e.startswith("executor memory:") for e in plan.events), plan.events
    free, _ = plans["free"]
    assert free.stats["fits_memory"] and not any(e.startswith("executor memory:") for e in free.events)


def test_fitting_recomputes_the_cheapest_chunks_until_the_account_fits(plans):
    """Raising a plan's recomputation (whole chunks or a cap on stored layers, the cheaper) lowers the account to the
    budget; a budget below the fully recomputed plan's account leaves the plan as it was."""
    plan, _ = plans["free"]
    loose = cost_of()
    stored = executor_memory(plan, loose).total
    everything = dataclasses.replace(plan, ckpt_layers=np.full_like(plan.ckpt_layers, loose.layers_per_stage))
    floor = executor_memory(everything, loose).total
    assert floor < stored
    budget = (floor + stored) / 2
    ckpt, account, changed = fit_executor(plan, cost_of(budget))
    assert changed and account.total <= budget < stored
    assert (ckpt >= plan.ckpt_layers).all() and (ckpt > plan.ckpt_layers).sum() == len(changed)
    too_small = cost_of(0.5 * floor)
    kept = fit_executor_memory(dataclasses.replace(plan, stats=dict(plan.stats), events=[]), too_small)
    assert np.array_equal(kept.ckpt_layers, plan.ckpt_layers) and kept.stats["executor_memory_bytes"] > floor / 2


@pytest.mark.parametrize("name", ["tight"])
def test_the_account_is_what_the_compiled_step_needs(plans, name):
    """XLA's memory analysis of the compiled step (arguments + outputs + temporaries - donated) is
    within 6 % of the account (the 9 budgeted benchmark steps: -5.0 … +1.4 %): the buffers are
    exact, the op's transients come from the profile's working-memory terms."""
    require_devices(LAYOUT.num_devices)
    import jax

    from jvarlen.api import Session, as_pieces
    from jvarlen.config import OptimizerConfig
    from jvarlen.runtime.feed import Iteration
    from jvarlen.runtime.memory_fit import need_bytes

    plan, cost = plans[name]
    session = Session.from_config(
        Config(model=MODEL, optimizer=OptimizerConfig(warmup_steps=0)), devices=jax.devices()[: LAYOUT.pp]
    )
    step = session.plan_step(LAYOUT, chunk_multiple=1, residual_policy="dots_and_attention")
    pieces = list(as_pieces(documents(SPLIT)))
    prepared = step.strategy.prepare(
        Iteration(0, pieces, np.zeros(len(pieces), np.int64), {}, groups=[pieces], plans=[plan]), ()
    )
    need = need_bytes(step.compiled(prepared).memory_analysis())
    account = executor_memory(plan, cost).total
    assert abs(account / need - 1) < 0.06, (account, need)


@pytest.mark.parametrize("name", ["free", "dapple"])
def test_a_tick_holds_both_lanes_reads_and_the_step_the_inputs(plans, name):
    """Beside its op a tick holds the two lanes' inputs read out of the stash and the inbox
    (``T/sp`` rows of ``d`` each), and the step holds the chunks' five int32 rows
    (docs/design/executor-memory.md, "What a tick holds": XLA's buffer assignment of the 60 MB
    benchmark steps). A forward clears a continuing document's dK/dV rows in place, so context
    adds nothing here (it did: ``L/pp · T`` zero rows of ``K' · D`` until 2026-12-01). The CPU
    model: d = 128, fp32."""
    plan, cost = plans[name]
    account = executor_memory(plan, cost)
    t, context = account.sizes["bucket"], account.sizes["context"]
    assert (context > 0) == (name == "free")  # the free plan splits documents; DAPPLE's are whole
    assert account.terms["tick"] == 2 * t * 128 * 4
    assert account.terms["inputs"] == 5 * plan.n_chunks * t * 4


def test_the_fused_op_rebuilds_no_layer(plans):
    """A fused op keeps every layer's residuals in its stack and rebuilds none, so the account
    charges it a backward without recomputation beside the stack, and the program the larger of
    that and a recomputing backward (the two ops run in different ticks). Before, the stack was
    added to the recomputing backward: 2.1 MB over XLA's figure on a fused 60 MB step."""
    plan, cost = plans["free"]
    account = executor_memory(plan, cost)
    assert account.sizes["fused"] and account.sizes["context"]
    ls, t, sc = cost.layers_per_stage, account.sizes["bucket"], account.sizes["context"]
    shape = ChunkShape(sc, (t,), tail=True)
    dctx = 2 * ls * sc * 2 * 32 * 4
    stack = ls * t * cost.coeffs.m_stored_token
    fused = cost.backward_memory(shape, 0) + dctx + stack
    recomputing = cost.backward_memory(shape, ls) + dctx
    recomputes = bool((np.asarray(plan.ckpt_layers) > 0).any())
    assert account.terms["op"] == pytest.approx(max(fused, recomputing if recomputes else 0.0))
    assert fused < cost.backward_memory(shape, ls) + dctx + stack


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_a_forward_holds_its_stack_unless_it_writes_each_layer(plans, backend):
    """A forward returns its chunk's residuals stacked over the stage's layers, then scattered to
    their slots: off the per-layer form the account charges at least that stack where it is larger
    than the backward's transients (here with residuals 4× the CPU model's, DAPPLE's 4K-token chunks
    each recomputing one of two layers, so nothing is fused). The per-layer form (a GPU step's)
    writes each layer's residuals into its slot as the pass goes: only the backward is charged (on
    the H100 the stack was 2.4-2.6 GiB of the llama-7b step with partial recomputation, under the
    account until the forward wrote per layer; docs/design/executor-memory.md)."""
    plan, cost = plans["dapple"]
    coeffs = cost.coeffs.replace(m_stored_token=4 * cost.coeffs.m_stored_token)
    cost = cost.replace(coeffs=coeffs.replace(meta=dataclasses.replace(coeffs.meta, backend=backend)))
    assert cost.executor_per_layer == (backend == "gpu")
    one = dataclasses.replace(plan, ckpt_layers=np.ones_like(plan.ckpt_layers))
    account = executor_memory(one, cost)
    sizes = account.sizes
    assert not sizes["fused"] and sizes["n_res"] > 0 and not sizes["context"] and not sizes["n_ckpt"]
    ls, t = cost.layers_per_stage, sizes["bucket"]
    recomputing = cost.backward_memory(ChunkShape(0, (t,), tail=True), ls)
    stack = ls * t * coeffs.m_stored_token
    assert stack > recomputing
    assert account.terms["op"] == pytest.approx(recomputing if backend == "gpu" else stack)


def test_residual_and_checkpoint_slots_round_by_quarters_of_at_most_eight():
    """Rounded up to multiples of 2 · L/pp, a 32-layer stage storing 2 layer-chunks held 64
    residual slots; now units of min(2 · L/pp, 8) slots, by quarters (≤ 25 % more above 8 units).
    Stages of up to 4 layers round as before (the CPU plans keep their compiled signatures)."""
    import types

    from jvarlen.plan.buffers import round_buffers

    def rounded(n, ls):
        sizes = types.SimpleNamespace(context=0, n_stash=2, n_grad=2, ctx_rows=0, n_res=n, n_ckpt=n, fused=True)
        out = round_buffers(sizes, 512, ls)
        assert out["n_res"] == out["n_ckpt"]
        return out["n_res"]

    assert [rounded(n, 32) for n in (0, 2, 8, 9, 30, 64, 65, 100)] == [0, 8, 8, 16, 32, 64, 80, 112]
    for n in range(0, 33):
        assert rounded(n, 2) == -(-n // 4) * 4  # as before: multiples of 2 · L/pp = 4
    for n in range(0, 200):
        assert n <= rounded(n, 32) <= max(8, 1.25 * n + 8)


def test_group_plans_fit_the_executors_buffers():
    """The group policies simulate their plans in ``"ticks"`` and run them on the paired executor:
    their recomputation is fitted to the executor's account too. On llama-7b over 16 A800s
    (``scripts/group_memory_check.py``) FlexSP's and Hydraulis' groups held 83-129 GiB against a
    67 GiB budget while reporting that they fit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from group_memory_check import executor_costs, token_batch

    from jvarlen.config import load_config
    from jvarlen.plan.strategy import plan_strategy

    costs = executor_costs(load_config("configs/llama-7b.yaml").model, "a800", 16)
    lengths = token_batch(np.random.default_rng(0), "github", 256 * 1024, 65536)
    for policy in ("flexsp", "hydraulis"):
        plan = plan_strategy(policy, lengths, costs)
        for g in plan.groups:
            account = executor_memory(g.plan, costs.cost(g.scheme)).total
            assert account <= g.plan.stats["memory_budget_bytes"], (policy, g.scheme, account / 2**30)
            assert g.plan.stats["fits_memory"] and g.plan.stats["executor_memory_bytes"] == pytest.approx(account)


def test_one_stage_groups_keep_stored_layers_without_the_fused_stack():
    """A one-stage plan that stores every layer fuses its chunks, and the fused op holds a stack of
    a chunk's residuals over all L/pp layers (a (pp 1, sp 8) group of llama-7b on A800s, cut into
    FlexSP's micro-batches that fit without recomputation: 64.0 GiB storing every layer, 46.9 GiB
    recomputing every one). Under a budget halfway between, recomputing whole chunks only frees
    that stack once every chunk recomputes every layer; capping the layers each chunk stores
    unfuses them all, and the signature then compiles no fused op: the repair keeps the cheaper
    table, here 8 of 32 layers stored per chunk. (Until a GPU step's descents added each layer's
    gradients as they went, 2026-12-01, the group itself needed the repair at the A800's budget,
    67.1 GiB: 72.8 GiB storing everything, 16 layers stored after the cap.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from group_memory_check import executor_costs, token_batch

    from jvarlen.config import load_config
    from jvarlen.plan.chunking import chunk_group
    from jvarlen.plan.executor_memory import _repair_by_chunk
    from jvarlen.plan.homogeneous import homogeneous_groups
    from jvarlen.plan.sp_groups import GroupCosts
    from jvarlen.plan.strategy import Scheme, build_group_plan

    costs = executor_costs(load_config("configs/llama-7b.yaml").model, "a800", 16)
    lengths = token_batch(np.random.default_rng(0), "github", 256 * 1024, 65536)
    gc, scheme = GroupCosts(costs), Scheme(1, 8)
    local = [lengths[d] for d in homogeneous_groups(lengths, gc, scheme.sp)[0].documents]
    mbs = chunk_group(local, gc.cap_none(scheme))
    group = build_group_plan("flexsp", scheme, local, mbs, costs, [0] * len(mbs), "paired")
    loose = costs.cost(scheme)
    ls = loose.layers_per_stage
    assert len(mbs) > 1

    stored = dataclasses.replace(group, ckpt_layers=np.zeros_like(group.ckpt_layers))
    everything = dataclasses.replace(group, ckpt_layers=np.full_like(group.ckpt_layers, ls))
    floor, most = executor_memory(everything, loose).total, executor_memory(stored, loose).total
    budget = (floor + most) / 2
    cost = loose.replace(coeffs=loose.coeffs.replace(memory_budget=budget))
    before = executor_memory(stored, cost)
    assert before.sizes["fused"] and before.total > budget
    zero = np.zeros_like(stored.ckpt_layers)
    by_chunk, _ = _repair_by_chunk(
        zero,
        before,
        [s.tokens for s in stored.chunk_shapes()],
        ls,
        budget,
        lambda t: executor_memory(dataclasses.replace(stored, ckpt_layers=t), cost),
    )
    assert (by_chunk == ls).all()  # the stack goes only with the last stored layer

    ckpt, account, changed = fit_executor(stored, cost)
    assert account.total <= budget and not account.sizes["fused"] and account.sizes["n_res"] > 0
    assert (ckpt < ls).all() and len(changed) == (ckpt > 0).sum()
    shapes = stored.chunk_shapes()
    added = sum(cost.recompute_time(shapes[k], int(ckpt[k, 0])) for k in range(len(shapes)))
    assert added < sum(cost.recompute_time(s, ls) for s in shapes)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_the_fit_keeps_the_faster_of_the_two_repairs(plans, fraction):
    """For budgets between the fully recomputed and the stored plan's account, the fitted table
    fits, only raises the plan's recomputation, and is simulated no slower than the by-chunk
    repair (the only one before the cap)."""
    from jvarlen.plan.executor_memory import _repair_by_chunk
    from jvarlen.plan.simulator import simulate

    plan, loose = plans["free"]
    ls = loose.layers_per_stage
    everything = dataclasses.replace(plan, ckpt_layers=np.full_like(plan.ckpt_layers, ls))
    floor, stored = executor_memory(everything, loose).total, executor_memory(plan, loose).total
    cost = cost_of(floor + fraction * (stored - floor))
    ckpt, account, _ = fit_executor(plan, cost)
    assert account.total <= cost.memory_budget and (ckpt >= plan.ckpt_layers).all()

    def measure(table):
        return executor_memory(dataclasses.replace(plan, ckpt_layers=table), cost)

    start = np.asarray(plan.ckpt_layers, np.int32)
    tokens = [s.tokens for s in plan.chunk_shapes()]
    by_chunk, by_chunk_account = _repair_by_chunk(start, measure(start), tokens, ls, cost.memory_budget, measure)
    assert by_chunk_account.total <= cost.memory_budget

    def seconds(table):
        return simulate(plan.schedule, plan.chunk_shapes(), table, cost, "paired").iteration_time

    assert seconds(ckpt) <= seconds(by_chunk)


@pytest.mark.parametrize("name", ["free", "tight", "dapple"])
def test_one_account_measuring_many_tables_gives_each_tables_own_account(plans, name):
    """The repairs measure one plan under thousands of recomputation tables with one account that
    keeps a tick table per set of fusable chunks kept apart: each measurement must equal the
    account of the plan with that table, measured afresh (including where the slots peak)."""
    from jvarlen.plan.executor_memory import _Account

    plan, cost = plans[name]
    ls, (n, pp) = cost.layers_per_stage, np.shape(plan.ckpt_layers)
    accounts = _Account(plan, cost, None, True)
    rng = np.random.default_rng(0)
    table = np.asarray(plan.ckpt_layers, np.int32)
    for _ in range(40):
        table = table.copy()
        k, p = rng.integers(n), pp - 1 if rng.random() < 0.5 else rng.integers(pp)  # the last stage changes the ticks
        table[k, p] = max(table[k, p], rng.integers(ls + 1))
        kept, fresh = accounts.measure(table), executor_memory(dataclasses.replace(plan, ckpt_layers=table), cost)
        assert kept.terms == fresh.terms and kept.sizes == fresh.sizes and dict(kept.peaks) == dict(fresh.peaks)
        stage, chunks = kept.peaks.chunks("res")
        assert (stage, chunks) == (fresh.peaks["res"][0], sorted({k for k, _ in fresh.peaks["res"][2]}))


def test_the_fit_caps_the_first_stage_where_the_last_one_fuses():
    """Five whole documents of ~6K tokens on a (pp = 2, sp = 4) group of a 13B model (A800s), no
    recomputation, under a budget halfway between the fully recomputed and the stored plan's
    accounts: the residual slots peak on the first stage, which holds two chunks in flight, while
    the last stage fuses each chunk's forward and backward. A cap on the first stage alone fits
    with the last stage storing every layer, faster than recomputing whole chunks or one cap for
    both stages (which unfuses the last); the fit keeps it."""
    from jvarlen.config import load_config
    from jvarlen.plan.api import make_cost
    from jvarlen.plan.executor_memory import _repair_by_cap, _repair_by_chunk
    from jvarlen.plan.hardware import CLUSTERS
    from jvarlen.plan.simulator import simulate
    from jvarlen.plan.strategy import Scheme, SchemeCosts, build_group_plan

    shape = ModelShape.from_config(load_config("configs/llama-13b.yaml").model)
    coeffs = make_cost(shape, CLUSTERS["a800"], Layout(16, 1, 1)).coeffs
    scheme, lengths = Scheme(2, 4), [7147, 5833, 6213, 6199, 6169]

    def costs_under(budget):
        return SchemeCosts(CostModel(shape, Layout(16, 1, 1), coeffs.replace(memory_budget=budget)), 16)

    plan = build_group_plan("hydraulis", scheme, lengths, [[i] for i in range(5)], costs_under(1e12), [0] * 5)
    loose = costs_under(1e12).cost(scheme)
    ls = loose.layers_per_stage
    everything = dataclasses.replace(plan, ckpt_layers=np.full_like(plan.ckpt_layers, ls))
    floor, stored = executor_memory(everything, loose).total, executor_memory(plan, loose).total
    cost = costs_under((floor + stored) / 2).cost(scheme)
    ckpt, account, _ = fit_executor(plan, cost)
    assert account.total <= cost.memory_budget
    assert (ckpt[:, 1] == 0).all() and account.sizes["fused"]  # the last stage stores all and fuses
    assert (ckpt[:, 0] == ckpt[0, 0]).all() and 0 < ckpt[0, 0] < ls  # one cap on the first stage

    def measure(table):
        return executor_memory(dataclasses.replace(plan, ckpt_layers=table), cost)

    def seconds(table):
        return simulate(plan.schedule, plan.chunk_shapes(), table, cost, "paired").iteration_time

    start = np.asarray(plan.ckpt_layers, np.int32)
    tokens = [s.tokens for s in plan.chunk_shapes()]
    by_chunk, _ = _repair_by_chunk(start, measure(start), tokens, ls, cost.memory_budget, measure)
    by_cap, _ = _repair_by_cap(start, ls, cost.memory_budget, measure)
    assert seconds(ckpt) < min(seconds(by_chunk), seconds(by_cap))


@pytest.mark.parametrize("policy", ["all", "dots_and_attention"])
def test_stored_bytes_do_not_count_the_stage_weights_casts(policy):
    """A stage holds its weight matrices in the compute dtype, so what a stored layer keeps per token
    is the same whether the parameters are stored in fp32 or in the compute dtype (before: with fp32
    parameters the bf16 casts of a layer's weights were counted as residuals under ``all``, 3.4 MB
    per token for llama-7b's shape traced at 128 tokens, against 248 KB now)."""
    base = dict(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128)
    base.update(compute_dtype="bfloat16", attention="xla")
    mixed = stored_token_bytes(dataclasses.replace(MODEL, **base, param_dtype="float32"), policy)
    same = stored_token_bytes(dataclasses.replace(MODEL, **base, param_dtype="bfloat16"), policy)
    assert mixed == same > 0


def test_stage_layers_checkpoint_as_the_data_parallel_steps_do():
    """A stage's layer under a residual policy is a ``jax.checkpoint`` that lets XLA merge common
    subexpressions (``prevent_cse=False``), as the model's layer body is: the forward and the
    backward of the layers run in separate loops, which already keep the recomputation apart. With
    the default (``prevent_cse=True``) every recomputed value sat behind an optimization barrier and
    the executor's fused op ran 4 % slower than the data-parallel step's layers on CPU (512 tokens,
    4 layers, identical gradients; docs/design/residuals.md)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jvarlen.model import AttentionInputs
    from jvarlen.model.transformer import abstract_model, layer_body
    from jvarlen.parallel.pipeline.signature import PipelineSignature
    from jvarlen.parallel.pipeline.stage import stage_shapes

    tokens, policy = 128, "dots_and_attention"
    sig = PipelineSignature(Layout(1, 1, 1), MODEL.num_layers, tokens, 1, 1, 0, 0, 0, 0, 1)
    s = stage_shapes(None, MODEL, sig, residual_policy=policy)
    gdef, stacked = nnx.split(abstract_model(MODEL).layers, nnx.Param)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
    ids = jnp.zeros((1, tokens), jnp.int32)
    inputs = AttentionInputs(ids, ids)
    ctx = jnp.zeros((0, s.K, s.D), s.compute_dtype)
    x = jax.ShapeDtypeStruct((tokens, s.d), s.compute_dtype)
    stage_layer = s.fns.layer(inputs, ids[0])
    body = layer_body(gdef, inputs, s.fns.attention_fn, compute_dtype=s.compute_dtype, remat=False, residual=policy)

    def checkpoints(fn, *args):
        eqns = jax.make_jaxpr(fn)(*args).eqns
        return [e.params["prevent_cse"] for e in eqns if "prevent_cse" in e.params]  # the checkpoints

    assert checkpoints(lambda x, lp: body(x[None], lp), x, one) == [False]
    assert checkpoints(lambda lp, x: stage_layer(lp, x, ctx, ctx), one, x) == [False]
