"""Layouts, the logical-axis rules, the canonical sharding, the layout policy and the compile cache."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jvarlen.config import Config, ConfigError, ModelConfig, ParallelConfig, parse_config
from jvarlen.layout import Layout
from jvarlen.parallel.layouts import (
    COMPUTE_RULES,
    STATE_RULES,
    batch_sharding,
    layout_mesh,
    logical_to_spec,
    state_mesh,
)
from jvarlen.parallel.sharding import param_axes, param_shardings, state_shardings
from jvarlen.runtime.compile_cache import CompileCache
from jvarlen.runtime.state import create_train_state
from jvarlen.runtime.strategies.layouts import LayoutPolicy, pad_rows, per_device_tokens, shape_bucket

N = 8


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices, have {jax.device_count()}")


def test_layout_mesh_orders_sp_fastest():
    mesh = layout_mesh(Layout(dp=2, sp=4))
    assert dict(mesh.shape) == {"dp": 2, "pp": 1, "sp": 4}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids.reshape(-1), sorted(d.id for d in jax.devices()))
    # one SP group = consecutive devices
    assert list(ids[1, 0]) == sorted(d.id for d in jax.devices())[4:]


@pytest.mark.parametrize(
    "layout, kwargs, message",
    [
        (Layout(dp=2, sp=2), {}, r"dp\*pp\*sp = 4 but there are 8 devices"),
        (Layout(dp=1, sp=8), {"num_heads": 4}, r"num_heads \(4\) divisible by sp \(8\)"),
        (Layout(dp=2, pp=4), {"num_layers": 2}, r"num_layers \(2\) must be divisible by pp \(4\)"),
    ],
)
def test_invalid_layouts_name_the_constraint(layout, kwargs, message):
    with pytest.raises(ValueError, match=message):
        layout.validate(N, **kwargs)


def test_layout_rejects_non_positive_degrees():
    with pytest.raises(ValueError, match="Layout.sp must be a positive int"):
        Layout(dp=8, sp=0)
    with pytest.raises(ValueError, match=r"dp\*pp\*sp = 16"):
        layout_mesh(Layout(dp=4, sp=4))


def test_logical_rules():
    mesh = state_mesh()
    # FSDP: the first listed logical axis the device count divides takes all devices
    assert logical_to_spec(("vocab", "embed"), (320, 32), STATE_RULES, mesh) == P(None, "fsdp")
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 12, 2, 8), STATE_RULES, mesh) == P(
        None, None, None, "fsdp"
    )
    assert logical_to_spec(("embed",), (6,), STATE_RULES, mesh) == P()  # indivisible: replicated
    lmesh = layout_mesh(Layout(dp=2, sp=4))
    assert logical_to_spec(("batch", "seq", "embed"), (4, 64, 32), COMPUTE_RULES, lmesh) == P("dp", "sp")
    assert logical_to_spec(("embed", "heads", "head_dim"), (32, 8, 4), COMPUTE_RULES, lmesh) == P()
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("embed",), (4, 4), STATE_RULES, mesh)


def test_canonical_state_is_fully_sharded_and_layout_independent():
    config = Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2, mlp_dim=64))
    _, optimizer, state = create_train_state(config)
    abstract = jax.eval_shape(lambda: state)
    shardings = state_shardings(abstract, optimizer, state_mesh())
    axes = param_axes(state.params)
    assert ("layers", "embed", "heads", "head_dim") in axes
    for leaf, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(shardings.params)):
        assert sharding.spec != P(), leaf.shape  # every parameter of this model is split 8 ways
        assert sharding.shard_shape(leaf.shape) != leaf.shape
    # AdamW moments follow their parameters; the step counter is replicated
    moment_specs = {s.spec for s in jax.tree.leaves(shardings.opt_state)}
    assert {s.spec for s in jax.tree.leaves(shardings.params)} <= moment_specs
    assert shardings.step.spec == P()
    # the same device order under every layout: one fixed sharding for the run
    assert jax.tree.leaves(param_shardings(state.params, state_mesh()))[0] == jax.tree.leaves(shardings.params)[0]


def _policy(**parallel) -> LayoutPolicy:
    config = Config(model=ModelConfig(num_heads=8, num_kv_heads=2, d_model=64), parallel=ParallelConfig(**parallel))
    return LayoutPolicy.from_config(config, N)


def test_policy_picks_smallest_sp_that_fits_the_token_budget():
    policy = _policy(tokens_per_device=1024)
    assert [str(x) for x in policy.candidates(4096)] == [str(Layout(dp=N // s, sp=s)) for s in (1, 2, 4, 8)]
    assert policy.choose(0, rows=16, seq_len=512) == Layout(dp=8, sp=1)  # 2 rows x 512 per device
    assert policy.choose(0, rows=2, seq_len=4096) == Layout(dp=2, sp=4)  # one row split 4 ways
    assert policy.choose(0, rows=1, seq_len=8192) == Layout(dp=1, sp=8)
    assert per_device_tokens(Layout(dp=2, sp=4), 3, 4096) == 2 * 1024  # rows padded up to dp
    with pytest.raises(ConfigError, match="no layout fits parallel.tokens_per_device=1024"):
        policy.choose(0, rows=1, seq_len=16384)
    # the config's own batch shape ([8, 1024] by default: 1,024 tokens per device at best) is
    # checked when the policy is made, before the run starts
    with pytest.raises(ConfigError, match=r"no layout fits parallel.tokens_per_device=100 for a \[8, 1024\] batch"):
        _policy(tokens_per_device=100)


def test_policy_fixed_and_cycle_and_config_errors():
    assert _policy(sp=2).choose(5, 8, 128) == Layout(dp=4, sp=2)
    cycle = _policy(sp_cycle=[1, 4])
    assert [cycle.choose(i, 8, 128).sp for i in range(4)] == [1, 4, 1, 4]
    with pytest.raises(ConfigError, match=r"num_heads \(8\) divisible by sp \(16\)|dp\*pp\*sp"):
        _policy(sp_cycle=[1, 16])
    with pytest.raises(ConfigError, match=r"pp\*sp = 3 must divide the 8 devices"):
        _policy(sp=3)
    with pytest.raises(ConfigError, match="set only one"):
        parse_config(["--parallel.tokens_per_device=64", "--parallel.sp_cycle=[1,2]"])
    with pytest.raises(ConfigError, match="tokens_per_device must be > 0"):
        parse_config(["--parallel.tokens_per_device=0"])
    # rows Ulysses cannot split: refused at the start (before: a JAX IndivisibleError at step 1)
    for parallel in ({"sp": 4}, {"sp_cycle": [1, 4]}):
        config = parse_config(["--data.seq_len=102", "--data.tokens_per_batch=816"])
        config = dataclasses.replace(config, parallel=ParallelConfig(**parallel))
        with pytest.raises(ConfigError, match=r"data.seq_len \(102\) must be divisible by sp \(4\)"):
            LayoutPolicy.from_config(config, N)


def test_pad_rows_adds_padding_rows_only():
    batch = {"tokens": np.ones((3, 4), np.int32), "loss_mask": np.ones((3, 4), np.float32)}
    padded = pad_rows(batch, 4)
    assert padded["tokens"].shape == (4, 4) and padded["loss_mask"][3].sum() == 0
    assert pad_rows(batch, 3) is batch


def test_compile_cache_hits_misses_and_buckets():
    built = []

    def compile_fn(key):
        layout, bucket = key
        built.append(layout)
        sharding = batch_sharding(layout_mesh(layout))
        batch = {name: jax.ShapeDtypeStruct(shape, np.dtype(dt), sharding=sharding) for name, shape, dt in bucket}
        fn = jax.jit(lambda state, batch: (state + 1, jnp.sum(batch["tokens"])))
        return fn.lower(jax.ShapeDtypeStruct((), jnp.float32), batch).compile()

    messages = []
    cache = CompileCache(say=messages.append)
    a, b = Layout(dp=8), Layout(dp=2, sp=4)
    small, big = {"tokens": np.ones((8, 16), np.int32)}, {"tokens": np.ones((8, 32), np.int32)}
    for layout, batch in [(a, small), (b, small), (a, small), (a, big), (b, small)]:
        cache.get((layout, shape_bucket(batch)), compile_fn)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (3, 2, 3)
    assert built == [a, b, a]
    assert cache.stats.compile_s > 0 and len(messages) == 3 and "compiled in" in messages[0]
    step = cache.get((b, shape_bucket(small)), compile_fn)
    state, total = step(jnp.zeros(()), jax.device_put(small, {"tokens": batch_sharding(layout_mesh(b))}))
    assert float(state) == 1.0 and int(total) == 8 * 16
    # a signature compiled ahead of time in the background is a hit once it is done
    future = cache.precompile((b, shape_bucket(big)), compile_fn)
    future.result()
    assert cache.compiled_by[(b, shape_bucket(big))].startswith("step-aot")
    cache.get((b, shape_bucket(big)), compile_fn)
    assert (cache.stats.misses, cache.stats.hits) == (3, 4)
    cache.close()


def test_pull_casts_matrices_and_push_returns_canonical_fp32():
    from jvarlen.parallel.sharding import pull, push

    config = Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2, mlp_dim=64))
    _, optimizer, state = create_train_state(config)
    canonical = state_shardings(jax.eval_shape(lambda: state), optimizer, state_mesh()).params
    mesh = layout_mesh(Layout(dp=2, sp=4))

    def roundtrip(params):
        pulled = pull(params, mesh, jnp.bfloat16)
        return pulled, push(pulled, canonical, params, mesh)

    params = jax.device_put(state.params, canonical)
    pulled, pushed = jax.jit(roundtrip)(params)
    for axes, x, y, s in zip(
        param_axes(state.params), jax.tree.leaves(pulled), jax.tree.leaves(pushed), jax.tree.leaves(canonical)
    ):
        matrix = len([a for a in axes if a != "layers"]) >= 2 and tuple(axes) != ("vocab", "embed")
        assert x.dtype == (jnp.bfloat16 if matrix else jnp.float32), axes  # the gathered embedding stays fp32
        assert x.sharding.is_fully_replicated  # whole weights for propagation (no tensor parallelism)
        assert y.dtype == jnp.float32 and y.sharding == s


def test_a_signature_another_thread_is_compiling_is_waited_for_not_compiled_again():
    """Two threads asking for one signature (the step and a background compile that needs the same
    group program) compile it once; a compile that fails raises in both and is retried by the next get."""
    import threading

    calls, started = [], threading.Event()

    def slow_compile(key):
        calls.append(key)
        started.set()
        time.sleep(0.3)
        if key == "bad" and calls.count("bad") == 1:
            raise RuntimeError("compile failed")
        return object()

    cache = CompileCache(say=lambda _: None)
    for key in ("good", "bad"):
        started.clear()
        results = []

        def ask(key=key, results=results):
            try:
                results.append(cache.get(key, slow_compile))
            except RuntimeError as error:
                results.append(error)

        first = threading.Thread(target=ask)
        first.start()
        started.wait()
        ask()
        first.join()
        assert calls.count(key) == 1 and len(results) == 2
        if key == "good":
            assert results[0] is results[1]
        else:
            assert all(isinstance(r, RuntimeError) for r in results)
    assert cache.get("bad", slow_compile) is not None and calls.count("bad") == 2  # retried, now compiles
    cache.close()


def test_a_step_is_charged_only_its_own_compile_wait():
    """A background compile that compiles a program inside (a group's, in a composite step) moves the
    cache's counters while the step's own key is a hit: the step's compile seconds stay 0 (the loop
    used to charge it the other thread's compile and subtract it from its step time)."""
    import threading

    cache = CompileCache(say=lambda _: None)
    cache.get("step", lambda key: object())
    inside = threading.Event()

    def composite(key):
        cache.get("group", lambda k: (inside.set(), time.sleep(0.3), object())[2])
        return object()

    future = cache.precompile("next", composite)
    inside.wait()
    compiled, seconds = cache.fetch("step", lambda key: object())
    future.result()
    assert seconds == 0.0 and cache.stats.misses == 2  # "step" and the group: counted, not charged
    compiled, seconds = cache.fetch("fresh", lambda key: (time.sleep(0.05), object())[1])
    assert seconds >= 0.05
    cache.close()


def test_the_cache_says_whether_a_compile_ran_beside_a_step():
    """A step that ran while the next signature compiled in the background shared the host's cores
    with it: :meth:`CompileCache.compiled_during` tells the loop, which leaves such a step out of the
    cost refit (before: counted as a clean step, 25-45 % slow on CPU)."""
    import threading

    cache = CompileCache(say=lambda _: None)
    release = threading.Event()
    before = time.perf_counter()
    future = cache.precompile("next", lambda key: (release.wait(10), object())[1])
    time.sleep(0.05)
    now = time.perf_counter()
    assert cache.compiled_during(now, now)  # still compiling
    release.set()
    future.result()
    after = time.perf_counter()
    assert cache.compiled_during(before, after) and cache.compiled_during(now, after)
    assert not cache.compiled_during(after + 1.0, after + 2.0)  # a step after it
    assert not cache.compiled_during(before - 2.0, before - 1.0)  # a step before it
    cache.close()
