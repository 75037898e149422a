"""The run loop, one for every execution strategy: sample (and plan ahead) → prepare the
iteration's host inputs → look up or compile its step in the one compile cache → run → record →
checkpoint. The loop knows no strategy's internals (:mod:`jvarlen.runtime.strategy`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Optional

import jax

from jvarlen.config import Config, to_dict
from jvarlen.layout import Layout, resolve_layout
from jvarlen.runtime import distributed
from jvarlen.runtime.checkpoint import abstract_like
from jvarlen.runtime.compile_cache import CompileCache
from jvarlen.runtime.cost_check import StepTimeCheck
from jvarlen.runtime.evaluate import Evaluator
from jvarlen.runtime.feed import IterationFeed
from jvarlen.runtime.model_flops import StepFlops, peak_tflops
from jvarlen.runtime.plan_exchange import PlanExchange
from jvarlen.runtime.run import (  # noqa: F401 (the errors are part of this module's interface)
    Interrupted,
    NonFiniteError,
    Run,
    TrainResult,
    close_run,
    open_run,
    step_record,
)
from jvarlen.runtime.strategy import ExecutionStrategy, StepContext
from jvarlen.runtime.trace import StepTrace


def make_strategy(
    config: Config,
    run: Run,
    layout: Layout,
    layout_for_step: Optional[Callable] = None,
    compiler_options: Optional[dict] = None,
) -> ExecutionStrategy:
    """The execution strategy of ``config``: device groups under a strategy policy, the elastic
    pipeline when ``pp > 1``, else data-parallel layouts."""
    ctx = step_context(config, run, compiler_options)
    wait = config.plan.wait
    if config.plan.uses_groups:
        from jvarlen.plan.stage_weights import CHOICES
        from jvarlen.runtime.strategies.groups import GroupsStrategy, choose_stage_weights, stage_weight_variant

        if config.parallel.stage_weights == "auto":
            chosen = choose_stage_weights(config, run.pipeline, layout, run.say)
            config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, stage_weights=chosen))
        variants = None
        if config.parallel.stage_weights == "per_iteration":
            variants = {c: stage_weight_variant(config, run.pipeline, layout, c, run.say) for c in CHOICES}
            costs, options = variants[CHOICES[0]]
        else:
            costs, options = stage_weight_variant(config, run.pipeline, layout, config.parallel.stage_weights, run.say)
        return GroupsStrategy(
            ctx,
            costs,
            config.plan.policy,
            options,
            ahead=config.plan.ahead,
            workers=config.plan.workers,
            wait=wait,
            residual=config.parallel.residual_policy,
            stage_weights=config.parallel.stage_weights,
            variants=variants,
        )
    if layout.pp > 1:
        from jvarlen.runtime.strategies.pipeline import PipelineStrategy, cost_model, planner_options

        # Each plan is solved by one process and read by the others (plan_exchange.PlanExchange): a late
        # solver's fallback is every process's plan too, so a run of several processes need not wait.
        return PipelineStrategy(
            ctx,
            layout,
            cost_model(config, layout, run.say),
            config.plan.policy,
            planner_options(config),
            config.data.rows_per_batch,
            ahead=config.plan.ahead,
            workers=config.plan.workers,
            wait=wait,
            residual=config.parallel.residual_policy,
            stage_weights=config.parallel.stage_weights,
        )
    from jvarlen.runtime.strategies.layouts import LayoutPolicy, LayoutStrategy

    policy = LayoutPolicy.from_config(config, len(run.placement.devices))
    return LayoutStrategy(
        ctx,
        policy,
        config.data.rows_per_batch,
        config.data.seq_len,
        layout_for_step,
        residual=config.parallel.residual_policy,
    )


def step_context(config: Config, run: Run, compiler_options: Optional[dict] = None) -> StepContext:
    """What every step of ``run`` compiles against (model, optimizer, canonical state placement)."""
    return StepContext(
        run.graphdef, config.model, run.optimizer, run.placement, abstract_like(run.state), compiler_options
    )


def train(
    config: Config,
    *,
    quiet: bool = False,
    stop_after: Optional[int] = None,
    layout_for_step: Optional[Callable[[int, int, int], Layout]] = None,
    compiler_options: Optional[dict] = None,
) -> TrainResult:
    """Trains up to ``config.train.steps`` (resuming first if asked) and returns the losses.

    ``stop_after`` ends the run early at that step, as a preemption would: the schedule still
    follows ``train.steps`` and the last step reached is checkpointed. ``layout_for_step(step,
    rows, seq_len)`` overrides the data-parallel layout policy. ``compiler_options`` go to every
    step compile (XLA debug options, e.g. a lower optimisation level in tests).
    """
    distributed.initialize(config.parallel)  # before jax.devices() starts the backend
    layout = resolve_layout(config, len(jax.devices()))
    run = open_run(config, quiet, stop_after)
    strategy = None
    try:
        strategy = make_strategy(config, run, layout, layout_for_step, compiler_options)
        evaluator = Evaluator.from_config(
            config, run.pipeline, run.eval_pipeline, step_context(config, run, compiler_options), strategy, run.note
        )
        distributed.check_same(
            {
                "the configuration": _config_text(config),
                "the corpus": run.pipeline.fingerprint(),
                "the resumed step": run.start,
                **strategy.fingerprint(),
            }
        )
        check = StepTimeCheck.from_config(config, run.note)  # refuses an unreadable train.cost_profile
        if check is not None:
            check.restore(run.resumed_refit)
    except BaseException:
        if strategy is not None:
            strategy.close()
        run.close(refused=True)
        raise
    run.cost_check = check
    cache = exchange = trace = None
    try:
        run.start_logging()  # config.json and metrics change only once the configuration is accepted
        cache = CompileCache(say=run.note)
        run.say(f"[jvarlen] {strategy.describe()}")
        strategy.attach(cache)
        exchange = PlanExchange.for_run()
        feed = IterationFeed(
            run.pipeline,
            strategy.planner(),
            run.start,
            run.end,
            ahead=config.plan.ahead,
            say=run.note,
            exchange=exchange,
        )
        trace = StepTrace(run.run_dir, config.logging.trace_steps, run.start, run.end, run.note)
        outcome = _run_steps(run, strategy, cache, feed, check, evaluator, trace)
    finally:
        if trace is not None:
            trace.close()
        strategy.close()
        if cache is not None:
            cache.close()
        if exchange is not None:
            exchange.close()
        run.close()
    return close_run(run, *outcome)


def _run_steps(
    run, strategy, cache: CompileCache, feed: IterationFeed, check, evaluator: Optional[Evaluator], trace: StepTrace
) -> tuple:
    """The step loop of :func:`train`: (losses, tokens seen, start time, final state, seconds in steps,
    model FLOP/s in words). ``evaluator``: the evaluation, if the run evaluates (:mod:`jvarlen.runtime.evaluate`);
    ``trace``: the profiler trace of ``logging.trace_steps`` (:mod:`jvarlen.runtime.trace`)."""
    state, run.state = run.state, None
    losses: list[float] = []
    # Signatures a step may reuse: those of the steps run so far, the same sequence on every process.
    # Not cache.keys(): what the background compile has reached depends on timing, and processes that
    # picked different signatures for one step would run different programs in one collective.
    signatures: dict = {}
    last_layout = None
    tokens_seen, seconds_in_steps, t_start = 0.0, 0.0, time.perf_counter()
    # steps of this process that found their program compiled / waited for a compile (the cache's own
    # counters count programs: a group strategy's step is several)
    step_hits = step_misses = 0
    flops = StepFlops(
        run.config.model, jax.device_count(), peak_tflops(jax.devices()[0].device_kind, run.config.logging.peak_tflops)
    )
    for step in range(run.start, run.end):
        trace.before(step)
        t0 = time.perf_counter()
        it = feed.next()
        prepared = strategy.prepare(it, list(signatures))
        arrangement = prepared.info.get("strategy") or "Layout(dp={dp}, pp={pp}, sp={sp})".format(**prepared.info)
        if arrangement != last_layout:
            run.note(f"[jvarlen] step {step + 1}: {arrangement}")
            last_layout = arrangement
        ahead = feed.peek()  # compile the next iteration's signature while this one runs
        if ahead is not None:
            cache.precompile(strategy.prepare(ahead, [*signatures, prepared.key]).key, strategy.compile)
        compiled, compile_s = cache.fetch(prepared.key, strategy.compile)  # this step's wait only
        signatures[prepared.key] = None
        step_hits, step_misses = step_hits + (compile_s == 0), step_misses + (compile_s > 0)
        t_step = time.perf_counter()
        state, metrics = compiled(state, prepared.arrays)
        metrics = jax.device_get(metrics)
        t_done = time.perf_counter()
        run_s = t_done - t_step  # the step itself: no plan wait, no compile
        beside_compile = cache.compiled_during(t_step, t_done)  # the next signature's, in the background
        dt = time.perf_counter() - t0
        lengths = [len(p.tokens) for p in it.pieces]
        real = sum(lengths)
        record = step_record(metrics, dt, run_s, run.learning_rate(step), real)
        record.update(flops.record(lengths, run_s))
        losses.append(record["loss"])
        tokens_seen += real
        seconds_in_steps += run_s
        record.update(
            pieces=len(it.pieces),
            documents=it.documents,
            plan_s=it.plan_s,
            plan_fallbacks=it.fallbacks,
            plans_fetched=it.fetched,
            **prepared.info,
            compile_s=compile_s,
            compiled=compile_s > 0,
            cache_hit=compile_s == 0,
            step_seconds=run_s,
            beside_compile=beside_compile,
            step_cache_hits=step_hits,
            step_cache_misses=step_misses,
            **strategy.record(it, prepared, metrics),
        )
        if check is not None and compile_s == 0 and not beside_compile:  # the step's own time only
            record.update(strategy.observe(check, it, prepared, dt, run_s))
        if evaluator is not None:
            if step == run.start:  # in the background, while the next steps train
                evaluator.precompile(cache)
            evaluator.check()
            if evaluator.due(step + 1, run.end):  # after the step's own time was taken
                record.update(evaluator.evaluate(state, cache, step + 1, run.signals.agreed))
                if "eval_loss" in record:  # (an evaluation a stop signal ended has none)
                    run.last_eval = (step + 1, record["eval_loss"])
        postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
        if "mfu" in record:
            postfix["mfu"] = f"{record['mfu']:.1%}"
        if run.last_eval is not None:
            postfix["eval"] = f"{run.last_eval[1]:.3f}"
        run.end_step(step, record, state, postfix, data_state=it.data_state)
        trace.after(step)
    run.checkpointer.wait()
    return losses, tokens_seen, t_start, state, seconds_in_steps, flops.summary()


def _config_text(config: Config) -> str:
    """The configuration but what may differ between the processes of one run."""
    d = to_dict(config)
    d["parallel"].pop("process_id", None)
    d["data"].pop("cache_dir", None)
    d["parallel"].pop("compilation_cache_dir", None)
    return json.dumps(d, sort_keys=True, default=str)
