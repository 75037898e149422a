"""Heterogeneous device groups in one iteration: two groups of different (pp, sp) on 8 fake devices
train their own documents and update the one canonical state once, equal to the single-device
reference and to the homogeneous data-parallel step on the same documents."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices, values_compile
from pipeline_helpers import assert_tree_close, reference_batch, tiny_config, tiny_params

from jvarlen.api import Session
from jvarlen.layout import Layout
from jvarlen.plan.api import make_cost
from jvarlen.plan.cost import ModelShape
from jvarlen.plan.plan import PlanError
from jvarlen.plan.strategy import GroupPlan, Scheme, SchemeCosts, StrategyPlan, build_group_plan
from jvarlen.runtime.state import TrainState
from jvarlen.runtime.step import make_train_step, single_program_grads

LENGTHS = (40, 7, 25, 33, 12, 18, 9, 30, 21)
# Hydraulis-like: group A a pipeline of 2 stages x sp 2 (devices 0-3), documents 0-3 in 2
# micro-batches (1F1B); group B one stage x sp 4 (devices 4-7), documents 4-8 in 3 micro-batches
# (gradient accumulation), the second recomputing one layer (as data, unfused)
GROUPS = (
    (Scheme(2, 2), (0, 1, 2, 3), (0, 1, 2, 3), [[0, 1], [2, 3]], "fit"),
    (Scheme(1, 4), (4, 5, 6, 7), (4, 5, 6, 7, 8), [[0, 1], [2], [3, 4]], [0, 1, 0]),
)
# DCP-like: an sp = 4 group with one micro-batch, two sp = 2 groups with 2 and 3 accumulated
# micro-batches and different recomputation
MIXED = (
    (Scheme(1, 4), (0, 1, 2, 3), (0, 3), [[0, 1]], [0]),
    (Scheme(1, 2), (4, 5), (2, 7, 8), [[0], [1, 2]], [2, 0]),
    (Scheme(1, 2), (6, 7), (1, 4, 5, 6), [[0, 1], [2], [3]], [0, 1, 3]),
)


# Groups in parts (docs/design/bucket-parts.md): a long micro-batch in its own bucket, then two
# short ones in a smaller one; and two single micro-batches each in its own part
PARTS = (
    (Scheme(1, 4), (0, 1, 2, 3), (0, 3, 1, 4), [[0, 1], [2], [3]], [1, 0, 0], (1, 2)),
    (Scheme(1, 2), (4, 5), (2, 5, 6), [[0], [1, 2]], [0, 0], (1, 1)),
    (Scheme(1, 2), (6, 7), (7, 8), [[0], [1]], [0, 0], ()),
)


def strategy_plan(cfg, layout=GROUPS) -> StrategyPlan:
    shape = ModelShape.from_config(cfg)
    costs = SchemeCosts(make_cost(shape, "a800", Layout(8, 1, 1)), 8)
    groups = []
    for scheme, devices, docs, micro, ckpt, *parts in layout:
        lengths = [LENGTHS[d] for d in docs]
        plan = build_group_plan("test", scheme, lengths, micro, costs, ckpt=ckpt, parts=(parts or [()])[0])
        groups.append(GroupPlan(scheme, devices, docs, plan))
    plan = StrategyPlan("test", 8, LENGTHS, tuple(groups))
    plan.validate(LENGTHS)
    return plan


@pytest.fixture(scope="module")
def setup():
    require_devices(8)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    rng = np.random.default_rng(11)
    docs = [rng.integers(1, cfg.vocab_size, size=n).astype(np.int32) for n in LENGTHS]
    return cfg, graphdef, params, docs


def _state(params, optimizer):
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.key_data(jax.random.key(0)))


def _reference(graphdef, params, optimizer, docs):
    """The single-device reference step's (state, metrics) on ``docs``, one document per row."""
    step = jax.jit(make_train_step(single_program_grads(graphdef), optimizer), compiler_options=values_compile())
    return step(_state(params, optimizer), reference_batch(docs))


def _batch_bytes_taken(compiled) -> int:
    """The bytes of the batch arrays a group's compiled program takes (``program(layers, rest,
    batch)``). XLA drops the inputs a program never reads (their input sharding is ``None``), and
    which those are depends on its version: JAX 0.10 drops an sp-only group's unused receive
    buffers, 0.12 also tables the program does not read (here: those of context and recomputation)."""
    (_, _, batch), _ = compiled.args_info
    (_, _, shardings), _ = compiled.input_shardings
    taken = jax.tree.leaves(shardings, is_leaf=lambda s: s is None)
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a, s in zip(jax.tree.leaves(batch), taken) if s)


def _step_equals_reference(setup, plan, inspect=None, stage_weights="replicated", **step_options):
    """One strategy step of ``plan`` (``inspect(prepared, step)``: called first; what it compiles
    through ``step.strategy`` the step then runs); its loss, gradient norm and updated parameters
    equal the single-device reference's. Returns the step's metrics."""
    cfg, graphdef, params, docs = setup
    optimizer = optax.sgd(0.5)
    expected, ref_metrics = _reference(graphdef, params, optimizer, docs)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all", stage_weights=stage_weights, **step_options)
    prepared = step.prepare(plan, docs)
    if inspect is not None:
        inspect(prepared, step)
    state, metrics = step(session.state, prepared)
    np.testing.assert_allclose(float(metrics["loss_sum"]), float(ref_metrics["loss_sum"]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5)
    assert_tree_close(state.params, expected.params)
    return metrics


def test_two_groups_of_different_schemes_equal_the_reference_and_the_homogeneous_step(setup):
    cfg, graphdef, params, docs = setup
    optimizer = optax.sgd(0.5)
    plan = strategy_plan(cfg)
    assert plan.groups[1].plan.ckpt_layers[:, 0].tolist() == [0, 1, 0]

    expected, ref_metrics = _reference(graphdef, params, optimizer, docs)

    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")
    prepared = step.prepare(plan, docs)
    state, metrics = step(session.state, prepared)
    for key in ("loss_sum", "target_tokens", "real_tokens"):
        np.testing.assert_allclose(float(metrics[key]), float(ref_metrics[key]), rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5)
    assert_tree_close(state.params, expected.params)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(session.state_sharding)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)  # the canonical sharding, unchanged
    # recomputation is real data: group B's second micro-batch ran one extra layer forward (its 3
    # micro-batches are padded to 4 chunks; the empty one runs nothing)
    forwards = [np.asarray(f).sum(0).tolist() for f in metrics["group_layer_forwards"]]
    assert forwards[1] == [3 * 4 + 1]

    # the homogeneous data-parallel step on the same documents (one per row, 8 rows)
    homogeneous = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    layout_step = homogeneous.layout_step(Layout(dp=8), rows=len(docs) + 7 - (len(docs) - 1) % 8, seq_len=40)
    batch = reference_batch(docs)
    padded = {k: np.concatenate([v, np.zeros((16 - len(docs), v.shape[1]), v.dtype)]) for k, v in batch.items()}
    hom_state, _ = layout_step(homogeneous.state, layout_step.from_arrays(padded))
    assert_tree_close(state.params, hom_state.params)


def test_known_groups_compile_nothing_and_groups_are_dispatched_without_a_host_sync(setup, monkeypatch):
    cfg, graphdef, params, docs = setup
    optimizer = optax.sgd(0.5)
    plan = strategy_plan(cfg)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")
    state, _ = step(session.state, step.prepare(plan, docs))
    compiled = len(session.cache)
    # the same groups in another iteration (a new composite key from known group programs)
    prepared = step.prepare(plan, docs)
    program = step.compiled(prepared)
    assert len(session.cache) == compiled  # nothing new compiled

    def no_sync(*args, **kwargs):
        raise AssertionError("the groups' dispatch waited on the host")

    monkeypatch.setattr(jax, "block_until_ready", no_sync)
    monkeypatch.setattr(jax, "device_get", no_sync)
    monkeypatch.setattr(jax.Array, "__array__", no_sync, raising=False)
    monkeypatch.setattr(jax.Array, "block_until_ready", no_sync, raising=False)
    state, metrics = program(state, prepared.arrays)
    monkeypatch.undo()
    assert np.isfinite(float(metrics["loss_sum"]))


def test_a_mixed_iteration_of_accumulating_sp_groups_equals_the_reference(setup):
    """DCP's shape of an iteration: groups of different SP degrees accumulate different numbers of
    micro-batches with different recomputation; one update equals the single-device reference."""
    plan = strategy_plan(setup[0], MIXED)
    assert [g.plan.n_chunks for g in plan.groups] == [1, 2, 3]
    assert [g.plan.ckpt_layers[:, 0].tolist() for g in plan.groups] == [[0], [2, 0], [0, 1, 3]]
    metrics = _step_equals_reference(setup, plan)
    # layer forwards per group: 4 layers per chunk plus the recomputed layers (the chunks padding
    # the counts to an even number run nothing)
    forwards = [int(np.asarray(f).sum()) for f in metrics["group_layer_forwards"]]
    assert forwards == [4, 2 * 4 + 2, 3 * 4 + 1 + 3]


def test_a_pipeline_group_in_gpipe_order_equals_the_reference(setup):
    """A pp > 1 group's plan in GPipe order (what build_group_plan keeps where the executor's model
    runs it faster and it fits: every stage's forwards, then its backwards) trains its documents as
    the 1F1B plan does: one update equal to the single-device reference."""
    from jvarlen.plan.schedule import gpipe

    plan = strategy_plan(setup[0])
    a = plan.groups[0]
    order = gpipe(a.plan.n_chunks, a.scheme.pp, a.plan.schedule.chunk_prev, a.plan.schedule.chunk_docs)
    assert a.scheme.pp == 2 and order.stages != a.plan.schedule.stages
    groups = (dataclasses.replace(a, plan=dataclasses.replace(a.plan, schedule=order)),) + plan.groups[1:]
    plan = dataclasses.replace(plan, groups=groups)
    plan.validate(LENGTHS)
    _step_equals_reference(setup, plan)


def test_groups_in_parts_equal_the_reference(setup):
    """A group's step in parts, each padded to its own bucket with its own tables and run one after
    the other from the same accumulators in one program, updates as the single-device reference."""
    plan = strategy_plan(setup[0], PARTS)
    assert [g.plan.parts for g in plan.groups] == [(1, 2), (1, 1), ()]

    def inspect(prepared, step):
        assert prepared.info["group_parts"] == [2, 2, 1]  # in the step's record
        sigs = [k[4] for k in prepared.key[1]]
        assert isinstance(sigs[0], tuple) and [s.bucket for s in sigs[0]] == [80, 16]  # 73 tokens, then 7 and 12
        assert isinstance(sigs[1], tuple) and len(sigs[1]) == 2 and not isinstance(sigs[2], tuple)

    _step_equals_reference(setup, plan, inspect)


def test_the_strategy_step_refuses_a_plan_that_is_not_of_its_documents(setup):
    """A document in two groups would train twice, one in none never: prepare refuses both, and a
    plan for more devices than the session has, before anything compiles."""
    cfg, graphdef, params, docs = setup
    optimizer = optax.sgd(0.5)
    plan = strategy_plan(cfg)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")
    a, b = plan.groups
    twice = dataclasses.replace(b, documents=(3, *b.documents[1:]))  # document 3 in both, 4 in none
    with pytest.raises(PlanError, match=r"document 3 in groups 0 and 1[\s\S]*\[4\] in no group"):
        step.prepare(dataclasses.replace(plan, groups=(a, twice)), docs)
    with pytest.raises(PlanError, match="strategy lengths differ"):
        step.prepare(plan, docs[:-1])
    with pytest.raises(PlanError, match="for 16 devices, the session has 8"):
        step.prepare(dataclasses.replace(plan, num_devices=16), docs)
    assert len(session.cache) == 0


def test_a_group_program_that_cannot_fit_beside_the_state_is_refused_before_it_runs(setup, monkeypatch):
    """On a device whose allocator reports a limit (a GPU), a group's step that needs more than the
    limit once the canonical state is counted raises DeviceMemoryError naming the group, before it
    runs (the update program had this check; a group's step died in the allocator)."""
    from jvarlen.runtime import memory_fit

    cfg, graphdef, params, docs = setup
    optimizer = optax.sgd(0.5)
    plan = strategy_plan(cfg)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")
    prepared = step.prepare(plan, docs)
    state_bytes = step.strategy.exchange.state_bytes_per_device()
    leaves = jax.tree.leaves(params)
    assert state_bytes >= sum(a.size * a.dtype.itemsize for a in leaves) / 8  # fp32 weights, sharded over 8
    # a limit the group's step alone fits, but not beside the state
    group_key = prepared.key[1][0]
    compiled, _, _ = step.strategy._compile_group(group_key)
    alone = memory_fit.need_bytes(compiled.memory_analysis())
    monkeypatch.setattr(memory_fit, "_memory_stats", lambda device: {"bytes_limit": alone + state_bytes // 2})
    with pytest.raises(memory_fit.DeviceMemoryError, match=r"the group \(pp=2, sp=2\) on devices \[0, 1, 2, 3\]"):
        step(session.state, prepared)


# two pipelines of 2 stages: every device needs half of the 4 layers
HALVES = (
    (Scheme(2, 2), (0, 1, 2, 3), (0, 1, 2, 3), [[0, 1], [2, 3]], "fit"),
    (Scheme(2, 2), (4, 5, 6, 7), (4, 5, 6, 7, 8), [[0, 1], [2], [3, 4]], "fit"),
)


def test_a_device_receives_its_stages_layers_and_no_more(setup):
    """With every group a pipeline of 2 stages, the pull hands each device 2 of the 4 layers (before:
    every parameter); a strategy with a whole-model stage (pp = 1) pads every device to 4. The
    steps still equal the single-device reference."""
    cfg, graphdef, params, docs = setup
    layer_bytes = sum(a.nbytes for a in jax.tree.leaves(params["layers"])) // cfg.num_layers
    rest_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) - cfg.num_layers * layer_bytes
    pulled = {}

    def inspect(prepared, step):
        stage_layers = prepared.arrays["stage_layers"].shape[1]
        pull = step.strategy.compile(prepared.key).pull
        pulled[stage_layers] = pull.memory_analysis().output_size_in_bytes  # one device's

    halves, mixed = strategy_plan(cfg, HALVES), strategy_plan(cfg)
    _step_equals_reference(setup, halves, inspect)
    _step_equals_reference(setup, mixed, inspect)  # its second group: one stage of all 4 layers
    assert sorted(pulled) == [2, 4]
    assert pulled[4] - pulled[2] == 2 * layer_bytes
    assert 0 <= pulled[2] - (2 * layer_bytes + rest_bytes) < 256  # the output tuple's pointers
    # the first group is the same in both: its compiled step serves either K (its rows are resized
    # outside it), so the second iteration compiles only what K and the other group need
    optimizer = optax.sgd(0.5)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")
    first, second = step.prepare(halves, docs), step.prepare(mixed, docs)
    assert first.key[1][0] == second.key[1][0] and (first.key[2], second.key[2]) == (2, 4)
    step.strategy.compile(first.key)
    before = set(step.cache.keys())
    step.strategy.compile(second.key)
    new = {k[0] for k in set(step.cache.keys()) - before}
    # "rest": the new group's program that makes its devices' vocabulary rows of the table's gradient whole
    assert second.key[1][0] in before and new == {"pull", "update", "group", "rows", "rest_in", "rest_out"}


def test_groups_with_sharded_stage_weights_are_handed_their_chunks_and_equal_the_reference(setup):
    """With ``stage_weights=sharded`` each device of a group is handed its ``1/sp`` chunk of its
    stage's layers and returns its chunk of their gradient (ZeRO-3 within the stage; before, whole
    stages both ways): the group's compiled step holds ``1/sp`` of what a replicated stage's does
    for every leaf split on a weight axis. GROUPS' stages are split in 2 and 4, so the exchange
    moves halves and the sp = 4 group cuts and pads them; MIXED's in 4, 2 and 2."""
    cfg, graphdef, params, docs = setup
    layer_leaves = jax.tree.leaves(params["layers"])
    rest_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) - sum(a.nbytes for a in layer_leaves)
    table = cfg.vocab_size * cfg.d_model * 4  # the embedding (tied), fp32
    for layout in (GROUPS, MIXED):
        plan = strategy_plan(cfg, layout)
        programs = []

        def inspect(prepared, step, programs=programs):
            strategy = step.strategy
            programs.append((strategy.compile(prepared.key), strategy.ctx.placement.state_sharding))

        _step_equals_reference(setup, plan, inspect, stage_weights="sharded")
        ((program, sharding),) = programs
        # leaves split on a weight axis in the canonical state: chunked; the rest whole
        specs = [s.spec for s in jax.tree.leaves(sharding.params["layers"])]
        chunked = [any(e is not None for e in spec[1:]) for spec in specs]
        assert any(chunked)
        for (compiled, *_), group in zip(program.groups, plan.groups):
            stage = sum(
                a.nbytes / group.scheme.pp / (group.scheme.sp if c else 1) for a, c in zip(layer_leaves, chunked)
            )
            m = compiled.memory_analysis()
            batch = _batch_bytes_taken(compiled)
            held = m.argument_size_in_bytes + m.output_size_in_bytes - batch
            # the handed chunks and their gradient rows (fp32 both), the rest and its rows split
            rows = rest_bytes - table * (1 - 1 / group.scheme.sp)  # by vocabulary over sp
            assert 0 <= held - (2 * stage + 2 * rows) < 512, group.scheme  # and the output tuple's pointers


def test_each_plan_runs_with_the_stage_weights_it_names_one_step_after_the_other(setup):
    """``parallel.stage_weights=per_iteration``: a step runs each plan as its ``stage_weights`` say,
    whatever the step's own setting. MIXED sharded (its groups' stages split in 4, 2 and 2), then
    the same groups replicated on the state that step left: each step equals the single-device
    reference step from the same state; the replicated step's group programs and exchange are
    compiled anew (keys of their own), not the sharded ones reused."""
    cfg, graphdef, params, docs = setup
    optimizer = optax.sgd(0.5)
    reference = jax.jit(make_train_step(single_program_grads(graphdef), optimizer), compiler_options=values_compile())
    expected = _state(params, optimizer)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")  # replicated where a plan does not say
    state, keys = session.state, []
    for mode in ("sharded", "replicated"):
        plan = dataclasses.replace(strategy_plan(cfg, MIXED), stage_weights=mode)
        prepared = step.prepare(plan, docs)
        assert prepared.info["stage_weights"] == mode
        keys.append({k for k in session.cache.keys() if isinstance(k, tuple)})
        state, metrics = step(state, prepared)
        expected, ref_metrics = reference(expected, reference_batch(docs))
        np.testing.assert_allclose(float(metrics["loss_sum"]), float(ref_metrics["loss_sum"]), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-5)
        assert_tree_close(state.params, expected.params)
        assert [k[5] for k in prepared.key[1]] == [mode] * 3  # the group programs' keys
        assert prepared.key[3] == (2 if mode == "sharded" else 1)  # the exchange's parts
    new = {k for k in session.cache.keys() if isinstance(k, tuple)} - keys[1]
    assert {k[0] for k in new} >= {"group", "pull", "update"}
    assert all(k[5] == "replicated" for k in new if k[0] == "group")
    assert all(k[3] is False for k in new if k[0] in ("pull", "update"))  # no chunks to read


def test_weight_matrices_travel_in_the_compute_dtype_and_the_update_is_the_same(setup, monkeypatch):
    """With a bf16 compute dtype the pull moves the weight matrices in bf16 (half the bytes, as the
    cost model's ``sync_bytes_per_param`` charges) and the group's program takes them back to fp32
    exactly: the update is bitwise the one of an fp32 pull, and the gradients accumulate in fp32."""
    from jvarlen.runtime.strategies import group_exchange

    cfg = dataclasses.replace(setup[0], compute_dtype="bfloat16")
    graphdef, params = tiny_params(cfg)
    docs = setup[3]
    plan = strategy_plan(cfg)

    def step_and_pulled_bytes():
        optimizer = optax.sgd(0.5)
        session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
        step = session.strategy_step(residual_policy="all")
        prepared = step.prepare(plan, docs)
        state, metrics = step(session.state, prepared)
        program = step.strategy.compile(prepared.key)
        partial_dtypes = {np.dtype(d) for _, d in program.partial_shapes.values()}
        return state, program.pull.memory_analysis().output_size_in_bytes, partial_dtypes, program

    state, pulled, partial_dtypes, program = step_and_pulled_bytes()
    assert partial_dtypes == {np.dtype(np.float32)}
    # what a group's compiled step holds beyond its batch (arguments and outputs): its stage's
    # layers as handed (bf16 matrices, fp32 vectors: the stage's compute copy itself), the embedding
    # (fp32) and tied head's norm, and fp32 gradient rows of all of them, the table and its rows
    # split by vocabulary over sp; the planner's memory model charges the copy and the
    # accumulators, which the rows are (docs/design/heterogeneous.md)
    layer_leaves = jax.tree.leaves(params["layers"])
    rest_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) - sum(a.nbytes for a in layer_leaves)
    table = cfg.vocab_size * cfg.d_model * 4
    for (compiled, *_), group in zip(program.groups, plan.groups):
        share = 1 / group.scheme.pp
        rest = rest_bytes - table * (1 - 1 / group.scheme.sp)
        handed = sum(a.nbytes // (2 if a.ndim >= 3 else 1) for a in layer_leaves) * share + rest
        rows = sum(a.nbytes for a in layer_leaves) * share + rest
        m = compiled.memory_analysis()
        batch = _batch_bytes_taken(compiled)
        held = m.argument_size_in_bytes + m.output_size_in_bytes - batch
        assert 0 <= held - (handed + rows) < 512, group.scheme  # and the output tuple's pointers
    own = lambda part, compute: [a.dtype for a in jax.tree.leaves(part)]  # noqa: E731
    monkeypatch.setattr(group_exchange, "pulled_dtypes", own)
    fp32_state, fp32_pulled, _, _ = step_and_pulled_bytes()
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(fp32_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # every layer (K = 4) moves its matrices in half the bytes; vectors and the embedding table in fp32
    matrices = sum(a.nbytes for a in jax.tree.leaves(params["layers"]) if a.ndim >= 3)
    assert fp32_pulled - pulled == matrices // 2


def test_a_strategy_that_leaves_devices_idle_equals_the_reference(setup):
    """Devices in no group (4-7 here) receive no layers (their table rows are padding), send zero
    rows and count for nothing in the update."""
    idle = ((Scheme(2, 2), (0, 1, 2, 3), tuple(range(len(LENGTHS))), [[0, 1, 2], [3, 4], [5, 6], [7, 8]], "fit"),)

    def inspect(prepared, step):
        assert (prepared.arrays["stage_layers"][4:] == -1).all()
        assert (prepared.arrays["device_weights"][4:] == 0).all() and prepared.arrays["device_weights"][0] == 1

    _step_equals_reference(setup, strategy_plan(setup[0], idle), inspect)


def test_a_group_returns_its_devices_rest_gradients_without_reducing_them(setup):
    """Each device of a group returns its own contribution to the embedding's (and a tied head's)
    gradient as a row, which the update adds with every other device's, as for its layers: the
    group's step has no all-reduce of it (before: the executor all-reduced it over the group and
    the group's first device alone returned it, 1.05 GB of fp32 per step for Llama-2-7B)."""
    cfg, _, params, _ = setup
    embedding = [a for a in jax.tree.leaves(params) if a.shape == (cfg.vocab_size, cfg.d_model)]
    assert embedding, "the embedding's shape is the test's handle on the rest's gradient"
    checked = []

    def inspect(prepared, step):
        program = step.strategy.compile(prepared.key)  # the programs the step then runs
        for key, (compiled, *_) in zip(prepared.key[1], program.groups):
            shape = f"f32[{cfg.vocab_size // key[2]},{cfg.d_model}]"  # a device's rows: split by vocabulary over sp
            text = compiled.as_text()
            assert shape in text
            reduced = [line for line in text.splitlines() if "all-reduce" in line and shape in line]
            assert not reduced, reduced[:2]
            checked.append(key[2])

    # the step whose group programs these are equals the reference (each device's row counted once)
    _step_equals_reference(setup, strategy_plan(cfg), inspect)
    assert checked == [2, 4]


def test_a_group_splits_an_untied_head_by_vocabulary_and_equals_the_reference(setup):
    """The groups' executors split the embedding table and an untied head by vocabulary over their
    sp devices (64 rows: 32 per device of the (2, 2) group, 16 of the sp = 4 one); each device
    returns its rows of their gradients, which the ``rest`` program puts in place: the step still
    equals the single-device reference."""
    _, _, _, docs = setup
    cfg = dataclasses.replace(tiny_config(num_layers=4), tie_embeddings=False)
    graphdef, params = tiny_params(cfg)
    assert all(g.scheme.sp > 1 and cfg.vocab_size % g.scheme.sp == 0 for g in strategy_plan(cfg).groups)
    _step_equals_reference((cfg, graphdef, params, docs), strategy_plan(cfg))


def test_a_group_step_holds_its_share_of_the_vocabulary(setup):
    """Each group's compiled step with a vocabulary its sp divides allocates less (arguments,
    outputs and temporaries) than with one row more (whole on every device): at least
    ``1 - 1/sp`` of the copy it is handed of the untied table and head (its rows of the pull's,
    kept by ``Exchange.compile_rest_in``) and of their fp32 accumulators (its rows of their
    gradients)."""
    _, _, _, docs = setup
    allocated = {}
    for vocab in (8192, 8193):
        cfg = dataclasses.replace(tiny_config(num_layers=4), vocab_size=vocab, tie_embeddings=False)
        graphdef, params = tiny_params(cfg)
        optimizer = optax.sgd(0.5)
        session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
        step = session.strategy_step(residual_policy="all")
        prepared = step.prepare(strategy_plan(cfg), docs)
        for key in prepared.key[1]:  # the (2, 2) and the (1, 4) group
            m = step.strategy._compile_group(key)[0].memory_analysis()
            allocated[vocab, key[2]] = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    copy = accumulators = 2 * 8192 * cfg.d_model * 4  # fp32 compute dtype: the head's copy in fp32 too
    for sp in (2, 4):
        saved = allocated[8193, sp] - allocated[8192, sp]
        assert saved >= (1 - 1 / sp) * (copy + accumulators), (sp, allocated, accumulators)


def test_no_whole_copy_of_the_table_is_held_on_a_groups_devices_while_its_program_runs(setup):
    """A group that splits the table and head by vocabulary keeps its rows of the pulled copy
    before its program runs (``Exchange.compile_rest_in``), and nothing else holds the whole copy
    on its devices: when each group's program is called, no live array holds the untied table or
    head whole on any of the group's devices (the canonical state holds chunks of them)."""
    _, _, _, docs = setup
    cfg = dataclasses.replace(tiny_config(num_layers=4), tie_embeddings=False)
    graphdef, params = tiny_params(cfg)
    optimizer = optax.sgd(0.5)
    session = Session(graphdef, cfg, optimizer, _state(params, optimizer), compiler_options=values_compile())
    step = session.strategy_step(residual_policy="all")
    plan = strategy_plan(cfg)
    prepared = step.prepare(plan, docs)
    program = step.strategy.compile(prepared.key)
    whole = {(cfg.vocab_size, cfg.d_model), (cfg.d_model, cfg.vocab_size)}
    held = {}

    def watched(compiled, devices, name):
        def run(*args):
            held[name] = [
                a.shape
                for a in jax.live_arrays()
                if a.shape in whole
                and len(a.sharding.device_set) > 1  # not the tests' parameters, on one device
                and any(s.device in devices and s.data.shape == a.shape for s in a.addressable_shards)
            ]
            return compiled(*args)

        return run

    for g, group in enumerate(plan.groups):
        compiled, mesh, *others = program.groups[g]
        program.groups[g] = (watched(compiled, set(mesh.devices.flat), group.scheme), mesh, *others)
    state, _ = program(session.state, prepared.arrays)
    jax.block_until_ready(state)
    assert held == {g.scheme: [] for g in plan.groups}, held


def test_a_group_whose_sp_spans_nodes_holds_the_vocabulary_whole(setup):
    """With nodes of 2 devices (``vocab_max_sp=2``, as a profile's ``gpus_per_node``) the (2, 2)
    group splits the table by vocabulary and the sp = 4 group holds it whole (its collectives
    would cross nodes): their programs return 32 and 64 rows of its gradient per device, and the
    step equals the reference."""
    cfg, graphdef, params, _ = setup
    rows = {}

    def inspect(prepared, step):
        for key in prepared.key[1]:
            _, rest_rows, *_ = step.strategy._compile_group(key)[0].out_info  # the table's and the norm's
            rows[key[2]] = sorted(a.shape for a in rest_rows)

    _step_equals_reference(setup, strategy_plan(cfg), inspect, vocab_max_sp=2)
    assert rows == {2: [(4, 32), (4, 32, 32)], 4: [(4, 32), (4, 64, 32)]}, rows
