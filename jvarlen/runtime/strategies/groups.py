"""The heterogeneous-groups strategy: each iteration runs a :class:`~jvarlen.plan.strategy.StrategyPlan`
— disjoint groups of devices, each with its own scheme ``(pp, sp)``, its own documents and its own
executor plan (micro-batches, 1F1B or gradient accumulation, recomputation) — and ends with one
update of the canonical state (Hydraulis §5.1-5.2; FlexSP and DCP groups are ``pp = 1``).

One iteration runs these compiled programs, all from the one compile cache:

* ``pull``: all devices; each device's pipeline stage's decoder layers handed to it (weight
  matrices in the compute dtype, by an all-to-all; whole, or where the plan's ``stage_weights``
  is ``sharded`` the device's chunk of them), the rest of the model all-gathered
  (:func:`jvarlen.parallel.groups.pull_stages`);
* one program per group, on the group's devices: the pipeline executor's gradients of the group's
  plan (:func:`jvarlen.parallel.pipeline.make_pipeline_grads` on the stages' own layers; a plan in
  parts runs them one after the other in this one program, each padded to its own bucket,
  docs/design/bucket-parts.md) as per-device rows: each device's own layer gradients and its own
  contribution to the rest's (no all-reduce within the group), the loss sums on the group's first
  device (:func:`jvarlen.parallel.groups.device_partials`); a sharded stage's
  rows are each device's chunk of the stage's reduce-scattered gradient;
* ``update``: all devices; the one train step of :mod:`jvarlen.runtime.step` whose "gradients"
  are the sum of every device's rows scaled by its group's share of the iteration's target
  tokens, landing in the canonical sharding (the pull's all-to-all backwards for the layers, a
  reduce-scatter for the rest).

The groups' programs are dispatched one after the other without waiting (asynchronous dispatch on
disjoint devices: they run concurrently); nothing syncs with the host until the loop reads the
metrics. Executables are cached per (scheme, devices, pipeline signature, stage weights), so a
strategy that reuses known groups compiles nothing. The pull and the update are compiled per
``K``, the iteration's largest stage (in layers), and chunk count, which every device's buffers share; a
group of shorter stages (or smaller chunks) cuts and pads its rows in small ``rows`` programs, so
its own program serves any of them; a group that splits the embedding table and head by
vocabulary over its sp devices keeps each device's rows of the pulled rest in a small ``rest_in``
program before its own and makes its rows of their gradients whole in ``rest_out`` after it
(:mod:`jvarlen.runtime.strategies.group_exchange`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.parallel.groups import (
    device_partials,
    for_group,
    gather_partials,
    group_mesh,
    shard_table,
    stage_tables,
)
from jvarlen.parallel.pipeline import make_pipeline_grads, prepare_plans, split_params
from jvarlen.parallel.pipeline.executor import DATA
from jvarlen.parallel.sharding import place_global
from jvarlen.plan import cpsat
from jvarlen.plan.strategy import SchemeCosts, StrategyPlan, plan_strategy
from jvarlen.runtime.memory_fit import ensure_fits
from jvarlen.runtime.strategies.group_exchange import SUM_KEYS, Exchange
from jvarlen.runtime.strategy import ExecutionStrategy, Planner, Prepared, StepContext, checked_residual


def strategy_options(config, pipeline, costs, say=lambda _: None):
    """The policy's options for a run: Hydraulis' candidate strategies are proposed once from the
    corpus' piece lengths (Eq. 4, §7) and cached with the corpus (``data.cache_dir``); ``auto``
    plans Hydraulis with them too; the other policies use their defaults."""
    import os
    import time

    from jvarlen.plan.auto import AutoOptions
    from jvarlen.plan.hydraulis import HydraulisOptions
    from jvarlen.plan.hydraulis_proposal import cached_proposal

    policy = config.plan.policy
    if policy not in ("hydraulis", "auto"):
        return None
    start = time.perf_counter()
    cache = os.path.join(os.path.expanduser(config.data.cache_dir or "~/.cache/jvarlen"), "proposals")
    lengths = [int(x) for x in pipeline.pieces.length]
    candidates = cached_proposal(cache, lengths, costs, config.data.seq_len, HydraulisOptions())
    say(
        f"[jvarlen] hydraulis: {len(candidates)} candidate strategies proposed from {len(lengths):,} pieces "
        f"in {time.perf_counter() - start:.1f} s"
    )
    hydraulis = HydraulisOptions(candidates=candidates)
    return hydraulis if policy == "hydraulis" else AutoOptions(options=(("hydraulis", hydraulis),))


def stage_weight_variant(config, pipeline, layout, choice: str, say=lambda _: None):
    """(SchemeCosts, the policy's options) of the run with ``parallel.stage_weights=choice``."""
    from jvarlen.runtime.strategies.pipeline import cost_model

    chosen = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, stage_weights=choice))
    costs = SchemeCosts(cost_model(chosen, layout, say), layout.num_devices)
    return costs, strategy_options(chosen, pipeline, costs, say)


def choose_stage_weights(config, pipeline, layout, say=lambda _: None, batches: int = 4) -> str:
    """``parallel.stage_weights`` for a run that sets ``auto``: :func:`jvarlen.plan.stage_weights.choose`
    on the sampler's first ``batches`` batches (from its seed, whatever step the run resumes at),
    with the run's cost model and policy options under each choice."""
    import time

    from jvarlen.data.sampler import TokenBudgetSampler
    from jvarlen.plan.stage_weights import choose

    start = time.perf_counter()
    sampler = TokenBudgetSampler(
        pipeline.pieces.length, config.data.rows_per_batch, config.data.seq_len, seed=config.data.seed
    )
    samples = [[int(pipeline.pieces.length[p]) for p in sampler.next().piece_ids] for _ in range(batches)]
    variant = functools.partial(stage_weight_variant, config, pipeline, layout)
    chosen, why = choose(config.plan.policy, samples, variant)
    say(f"[jvarlen] parallel.stage_weights=auto: {why}; chosen in {time.perf_counter() - start:.1f} s")
    return chosen


def _estimate(v: dict):
    """A policy's ``auto`` estimate for the step record: its time, the ceiling it could not beat,
    or why it could not plan."""
    if "iteration_time_s" in v:
        return v["iteration_time_s"]
    if "not_faster_than_s" in v:
        return f"not faster than {v['not_faster_than_s']:.4g}"
    return v.get("error")


def _is_composite(key) -> bool:
    return isinstance(key, tuple) and len(key) == 4 and key[0] == "groups"


def all_documents(pieces, rows) -> list:
    """The feed's split for strategy policies: one plan over all of the iteration's documents."""
    return [list(pieces)]


class GroupsStep:
    """The executable of one strategy: pull, the groups' programs, update (see the module docstring)."""

    def __init__(self, exchange: Exchange, pull, groups: Sequence, update, rows: int, parts: int):
        self.ctx, self.pull, self.groups, self.update = exchange.ctx, pull, list(groups), update
        self.exchange = exchange
        here = jax.process_index()  # a process dispatches only the groups with devices of its own
        self.local = [any(d.process_index == here for d in g[1].devices.flat) for g in self.groups]
        self.partial_shapes = exchange.partial_shapes(rows, parts)
        self.table_sharding = self.ctx.placement.replicated

    def __call__(self, state, arrays: dict):
        table, shards = arrays["stage_layers"], arrays["stage_shards"]
        tables = [place_global(t, self.table_sharding) for t in (table, shards)]
        layers, rest = self.pull(state.params, *tables)
        layer_def = jax.tree.structure(layers)
        local = [(g, group) for g, group in enumerate(self.groups) if self.local[g]]  # others: their process's
        # every group's views of the pulled buffers first (the same device buffers), then nothing
        # else holds them: a buffer goes once the programs that read it are done, the whole rest of
        # a group that keeps its rows (rest_in) before the group's program runs
        views = [self.exchange.views(jax.tree.leaves(layers), group[1], *group[4]) for _, group in local]
        rests = [jax.tree.leaves(jax.tree.map(lambda a, m=group[1]: for_group(a, m), rest)) for _, group in local]
        rest_def = jax.tree.structure(rest)
        del layers, rest
        outs = []
        for at, (g, (program, _, batch_shardings, resize, (layout, _), rest_io)) in enumerate(local):
            g_layers, g_rest = views[at], rests[at]
            views[at] = rests[at] = None  # this group's views: held by the calls below only
            g_layers = layer_def.unflatten(g_layers if resize is None else resize[0](g_layers))
            if rest_io is not None:  # its rows of the table and head
                split = [j for j, p in enumerate(self.exchange.rest_in_specs(layout)) if len(p)]
                for j, x in zip(split, rest_io[0]([g_rest[j] for j in split])):
                    g_rest[j] = x
            g_rest = rest_def.unflatten(g_rest)
            parts = [
                {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
                for prefix in (f"{g}/{i}/" for i in range(len(batch_shardings)))
            ]
            batch = parts[0] if len(parts) == 1 else tuple(parts)
            shardings = batch_shardings[0] if len(parts) == 1 else tuple(batch_shardings)
            out = program(g_layers, g_rest, place_global(batch, shardings))
            if resize is not None:
                out = (resize[1](out[0]), *out[1:])
            if rest_io is not None:  # each device's vocabulary rows of the table and head, in place
                out = (out[0], rest_io[1](out[1]), *out[2:])
            outs.append(out)
        placement = self.ctx.placement
        columns = {f"l/{i}": [o[0][i] for o in outs] for i in range(len(outs[0][0]) if outs else 0)}
        columns.update({f"r/{i}": [o[1][i] for o in outs] for i in range(len(outs[0][1]) if outs else 0)})
        columns.update({f"s/{key}": [o[2][key] for o in outs] for key in SUM_KEYS})
        partials = {
            name: gather_partials(columns.get(name, []), placement.state_mesh, placement.devices, shape, dtype)
            for name, (shape, dtype) in self.partial_shapes.items()
        }
        state, metrics = self.update(state, {**partials, "t": table, "c": shards, "w": arrays["device_weights"]})
        # layer forwards of this process's groups (all of them in a single-process run)
        return state, {**metrics, "group_layer_forwards": [o[3] for o in outs]}

    def memory_analysis(self):
        return self.update.memory_analysis()


class GroupsStrategy(ExecutionStrategy):
    """Device groups of different schemes per iteration, chosen by a strategy policy
    (``hydraulis``, ``flexsp``, ``dcp``, ``homogeneous``, ``auto``; :mod:`jvarlen.plan.strategy`).

    ``stage_weights``: how the groups hold their stages' layers where a plan does not say
    (``StrategyPlan.stage_weights``; the planner's plans do); ``per_iteration`` plans every
    iteration under both, ``variants[choice] = (costs, options)``, and runs the one it picks
    (:func:`jvarlen.plan.stage_weights.plan_each`)."""

    name = "groups"

    def __init__(
        self,
        ctx: StepContext,
        costs,
        policy: str,
        options: Any = None,
        *,
        ahead: int = 2,
        workers: int = 1,
        wait: bool = False,
        residual: Optional[str] = "dots_and_attention",
        stage_weights: str = "replicated",
        chunk_multiple: int = 2,
        fallback_policy: str = "homogeneous",
        vocab_max_sp: Optional[int] = None,
        variants: Optional[dict] = None,
    ):
        self.ctx, self.costs, self.policy, self.options = ctx, costs, policy, options
        self.ahead, self.workers, self.wait, self.chunk_multiple = ahead, workers, wait, chunk_multiple
        self.residual = checked_residual(residual)
        if stage_weights not in ("replicated", "sharded", "per_iteration"):
            raise ValueError(f"stage_weights must be replicated, sharded or per_iteration, got {stage_weights!r}")
        if (stage_weights == "per_iteration") != (variants is not None):
            raise ValueError("stage_weights=per_iteration plans with variants (both choices' costs), and only it")
        self.stage_weights, self.variants = stage_weights, variants
        # the vocabulary is split over a group's sp within a node, as the planner's account assumes
        if vocab_max_sp is None and costs is not None:
            vocab_max_sp = costs.coeffs.gpus_per_node
        self.vocab_max_sp = vocab_max_sp
        self.exchange = Exchange(ctx, self.vocab_max_sp)
        self.fallback_policy = fallback_policy
        self._service = None
        self.cache = None

    # ---- planning
    def planner(self) -> Planner:
        if self.variants is not None:
            from jvarlen.plan.stage_weights import plan_each

            solve = functools.partial(plan_each, self.policy, variants=self.variants)
            costs_only = {choice: (costs, None) for choice, (costs, _) in self.variants.items()}
            fallback = functools.partial(plan_each, self.fallback_policy, variants=costs_only)
        else:
            solve = functools.partial(plan_strategy, self.policy, costs=self.costs, options=self.options)
            fallback = functools.partial(plan_strategy, self.fallback_policy, costs=self.costs)
        if self.ahead > 0 and self._service is None:
            from jvarlen.plan.service import PlanningService

            self._service = PlanningService(
                None,
                fallback_policy=self.fallback_policy,  # named in its events and log lines
                workers=self.workers,
                solve=solve,
                fallback=fallback,
                reproducible=self.wait,
            )
        inline = functools.partial(cpsat.call_reproducibly, solve) if self.wait else solve
        return Planner(all_documents, inline, self._service, self.wait)

    # ---- host side
    def plan_stage_weights(self, plan: StrategyPlan) -> str:
        """How ``plan``'s groups hold their stages: as the plan says, else as this strategy is set."""
        if plan.stage_weights is not None:
            return plan.stage_weights
        if self.stage_weights == "per_iteration":
            raise ValueError("stage_weights=per_iteration runs plans that say their stage_weights; this one does not")
        return self.stage_weights

    def prepare(self, iteration, known=()) -> Prepared:
        plan: StrategyPlan = iteration.plans[0]
        docs = iteration.groups[0]
        num_layers = self.ctx.model.num_layers
        mode = self.plan_stage_weights(plan)
        keys, arrays, targets, stages = [], {}, [], []
        known = [k for key in known for k in (key[1] if _is_composite(key) else (key,))]  # a step's group programs
        for g, group in enumerate(plan.groups):
            ids = (group.scheme.pp, group.scheme.sp, tuple(group.devices))
            same = [
                k[4] for k in known if isinstance(k, tuple) and k[:1] == ("group",) and k[1:4] == ids and k[5] == mode
            ]
            same = [s for k in same for s in (k if isinstance(k, tuple) else (k,))]  # a part may reuse any
            sigs, target = [], 0.0
            for i, part in enumerate(group.plan.part_plans()):  # each part its own bucket and tables
                sig, batch = prepare_plans(
                    [part], [[docs[d] for d in group.documents]], num_layers, same, chunk_multiple=self.chunk_multiple
                )
                sigs.append(sig)
                target += float(batch["loss_mask"].sum())
                arrays.update({f"{g}/{i}/{k}": v for k, v in batch.items()})
            keys.append(("group", *ids, sigs[0] if len(sigs) == 1 else tuple(sigs), mode))
            targets.append(target)
            stages.append((sigs[0].layout, group.devices))
        table = stage_tables(stages, len(self.ctx.placement.devices), num_layers)
        arrays["stage_layers"] = table
        chunks = [self.exchange.shards(layout, mode == "sharded") for layout, _ in stages]
        parts = min(chunks, default=1)  # the exchange's buffers: 1/parts of each weight axis
        stages = [(layout, devices, c) for (layout, devices), c in zip(stages, chunks)]
        arrays["stage_shards"] = shard_table(stages, len(self.ctx.placement.devices))
        total = max(sum(targets), 1.0)  # each device's rows count by its group's share of the targets
        weights = np.zeros(len(self.ctx.placement.devices), np.float32)
        for group, t in zip(plan.groups, targets):
            weights[list(group.devices)] = t / total
        arrays["device_weights"] = weights
        info = {
            "strategy": plan.describe(),
            "groups": len(plan.groups),
            "chunks": sum(g.plan.n_chunks for g in plan.groups),
            "group_parts": [max(1, len(g.plan.parts)) for g in plan.groups],  # bucket parts per group's step
            "predicted_iteration_time_s": float(plan.stats.get("iteration_time_s", float("nan"))),
            "stage_weights": mode,
            "policy_chosen": str(plan.stats.get("policy_chosen", plan.policy)),
        }
        estimates = plan.stats.get("auto_estimates")
        if estimates:  # auto: every policy's estimate of this iteration (or why it could not plan it)
            info["policy_estimates_s"] = {k: _estimate(v) for k, v in estimates.items()}
        if "stage_weights_estimates" in plan.stats:  # per_iteration: both choices', as auto's
            info["stage_weights_estimates_s"] = {
                k: _estimate(v) for k, v in plan.stats["stage_weights_estimates"].items()
            }
        return Prepared(("groups", tuple(keys), table.shape[1], parts), arrays, info)  # size pull and update

    # ---- compiled programs
    def compile(self, key) -> GroupsStep:
        if self.cache is None:
            raise RuntimeError("GroupsStrategy.attach(cache) first: its programs live in the one compile cache")
        _, group_keys, rows, parts = key
        exchange, groups, chunked = self.exchange, [], False
        for k in group_keys:
            program, mesh, batch_shardings = self.cache.get(k, self._compile_group)
            layout, sharded = k[4][0].layout if isinstance(k[4], tuple) else k[4].layout, k[5] == "sharded"
            per_stage, where, chunks = self.ctx.model.num_layers // k[1], k[1:4], exchange.shards(layout, sharded)
            chunked = chunked or chunks > 1
            resize = None  # the pulled buffers to the stage's layers and chunks, its partial rows back
            if (per_stage, chunks) != (rows, parts):
                resize = (
                    self.cache.get(("rows", *where, "stage", rows, per_stage, parts, chunks), exchange.compile_rows),
                    self.cache.get(("rows", *where, "partial", per_stage, rows, chunks, parts), exchange.compile_rows),
                )
            rest_io = None  # the rest split by vocabulary over sp: its rows of the copy, the gradient made whole
            if exchange.vocab_shards(layout) > 1:
                rest_io = (
                    self.cache.get(("rest_in", *where), exchange.compile_rest_in),
                    self.cache.get(("rest_out", *where), exchange.compile_rest_out),
                )
            groups.append((program, mesh, batch_shardings, resize, (layout, sharded), rest_io))
        pull = self.cache.get(("pull", rows, parts, chunked), exchange.compile_pull)
        update = self.cache.get(("update", rows, parts, chunked), exchange.compile_update)
        return GroupsStep(exchange, pull, groups, update, rows, parts)

    def _devices(self, indices) -> list:
        return [self.ctx.placement.devices[i] for i in indices]

    def _compile_group(self, key):
        _, pp, sp, devices, sig, mode = key  # sig: one signature, or the step's parts' (a tuple)
        ctx = self.ctx
        sigs = sig if isinstance(sig, tuple) else (sig,)
        sharded = mode == "sharded"
        mesh = group_mesh(sigs[0].layout, self._devices(devices))
        grads = make_pipeline_grads(
            ctx.graphdef,
            ctx.model,
            sig,
            mesh,
            residual_policy=self.residual,
            stage_weights=mode,
            canonical=False,
            group_axes=self.exchange.group_axes(sigs[0].layout, sharded),
            vocab_max_sp=self.vocab_max_sp,
        )
        _, rest_dtype = split_params(ctx.abstract_state.params)

        def program(layers, rest, batch):
            # the layers as handed: the stage's copy in the compute dtype (the executor accumulates
            # their gradients in the parameters'); the rest back in the parameters' dtype, exactly,
            # since its gradients accumulate in its own
            rest = jax.tree.map(lambda x, a: x.astype(a.dtype), rest, rest_dtype)
            params = nnx.merge_state(rest, nnx.State({"layers": layers}))
            sums, g, layer_forwards = grads(params, batch)
            real = sum(jnp.sum(b["segment_ids"] > 0) for b in (batch if isinstance(batch, tuple) else (batch,)))
            sums = {**sums, "real_tokens": real.astype(jnp.float32)}
            g_layers, g_rest = split_params(g)  # a row per device already, the layers and the rest
            p_sums = device_partials(mesh, sums)
            # replicated over the group: a process holding any of its devices can read the counts
            # (sharded by stage, the stages of another process could not be fetched)
            forwards = jax.lax.with_sharding_constraint(layer_forwards, replicated)
            return jax.tree.leaves(g_layers), jax.tree.leaves(g_rest), p_sums, forwards

        replicated = NamedSharding(mesh, P())
        batch_sharding = NamedSharding(mesh, P(DATA))
        layers, rest = self.exchange.pulled
        leaves, layer_def = jax.tree.flatten(layers)
        specs = self.exchange.stage_specs(sigs[0].layout, sharded)  # as the pull's views (or resizes) hand them
        layers = layer_def.unflatten(
            [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p)) for a, p in zip(leaves, specs)]
        )
        rest_specs = self.exchange.rest_in_specs(sigs[0].layout)  # split by vocabulary: rest_in's output
        rest = jax.tree.structure(rest).unflatten(
            [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, p))
                for a, p in zip(jax.tree.leaves(rest), rest_specs)
            ]
        )
        batches = [
            {k: jax.ShapeDtypeStruct(v, np.int32, sharding=batch_sharding) for k, v in s.input_shapes().items()}
            for s in sigs
        ]
        batch = batches[0] if len(sigs) == 1 else tuple(batches)
        compiled = jax.jit(program).lower(layers, rest, batch).compile(compiler_options=ctx.compiler_options)
        here = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        if here:  # the group's step runs beside the canonical state: both must fit (GPU; CPU has no limit)
            what = f"the group (pp={pp}, sp={sp}) on devices {list(devices)}: "
            ensure_fits(compiled, here[0], resident_bytes=self.exchange.state_bytes_per_device(), what=what)
        return compiled, mesh, [{k: batch_sharding for k in b} for b in batches]

    # ---- records and the cost check
    def record(self, iteration, prepared: Prepared, metrics: dict) -> dict:
        return {"layer_forwards": [np.asarray(f).sum(0).tolist() for f in metrics.get("group_layer_forwards", [])]}

    def observe(self, check, iteration, prepared: Prepared, step_s: float, run_s: float) -> dict:
        plans = [g.plan for g in iteration.plans[0].groups]
        sharded = self.plan_stage_weights(iteration.plans[0]) == "sharded"
        return {"groups_s": run_s, **check.observe_plans(plans, run_s, group=True, sharded=sharded)}

    def fingerprint(self) -> dict:
        if self.variants is not None:  # per_iteration: both choices' cost models and options
            text = " / ".join(costs.base.fingerprint() for costs, _ in self.variants.values())
            return {
                "the planner's cost models": text,
                "the policy's options": repr([o for _, o in self.variants.values()]),
            }
        text = self.costs.base.fingerprint() if self.costs is not None else ""
        return {"the planner's cost model": text, "the policy's options (Hydraulis' candidates)": repr(self.options)}

    def describe(self) -> str:
        return f"heterogeneous device groups: policy {self.policy} on {len(self.ctx.placement.devices)} devices"

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            self._service = None


__all__ = ["GroupsStep", "GroupsStrategy"]
