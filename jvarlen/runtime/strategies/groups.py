"""The heterogeneous-groups strategy: each iteration runs a :class:`~jvarlen.plan.strategy.StrategyPlan`
— disjoint groups of devices, each with its own scheme ``(pp, sp)``, its own documents and its own
executor plan (micro-batches, 1F1B or gradient accumulation, recomputation) — and ends with one
update of the canonical state (Hydraulis §5.1-5.2; FlexSP and DCP groups are ``pp = 1``).

One iteration is four kinds of compiled programs, all from the one compile cache:

* ``pull``: all devices; the fp32 parameters all-gathered onto every device
  (:func:`jvarlen.parallel.groups.pull`);
* one program per group, on the group's devices: the pipeline executor's gradients of the group's
  plan (:func:`jvarlen.parallel.pipeline.make_pipeline_grads`; a plan in parts runs them one after
  the other in this one program, each padded to its own bucket, docs/design/bucket-parts.md)
  turned into per-device partials scaled by the group's share of the iteration's target tokens
  (:func:`jvarlen.parallel.groups.device_partials`);
* ``update``: all devices; the one train step of :mod:`jvarlen.runtime.step` whose "gradients"
  are the sum of every device's partials, landing in the canonical sharding (a reduce-scatter).

The groups' programs are dispatched one after the other without waiting (asynchronous dispatch on
disjoint devices: they run concurrently); nothing syncs with the host until the loop reads the
metrics. Executables are cached per (scheme, devices, pipeline signature), so a strategy that
reuses known groups compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.parallel.groups import GROUP_AXES, device_partials, for_group, gather_partials, group_mesh
from jvarlen.parallel.layouts import FSDP
from jvarlen.parallel.pipeline import make_pipeline_grads, prepare_plans, split_params
from jvarlen.parallel.pipeline.executor import DATA
from jvarlen.parallel.sharding import place_global, push
from jvarlen.plan import cpsat
from jvarlen.plan.strategy import SchemeCosts, StrategyPlan, plan_strategy
from jvarlen.runtime.memory_fit import ensure_fits
from jvarlen.runtime.step import CompiledStep
from jvarlen.runtime.strategy import ExecutionStrategy, Planner, Prepared, StepContext

SUM_KEYS = ("loss_sum", "target_tokens", "real_tokens")


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


def choose_stage_weights(config, pipeline, layout, say=lambda _: None, batches: int = 4) -> str:
    """``parallel.stage_weights`` for a run that sets ``auto``: :func:`jvarlen.plan.stage_weights.choose`
    on the sampler's first ``batches`` batches (from its seed, whatever step the run resumes at),
    with the run's cost model and policy options under each choice."""
    import time

    from jvarlen.data.sampler import TokenBudgetSampler
    from jvarlen.plan.stage_weights import choose
    from jvarlen.runtime.strategies.pipeline import cost_model

    start = time.perf_counter()
    sampler = TokenBudgetSampler(
        pipeline.pieces.length, config.data.rows_per_batch, config.data.seq_len, seed=config.data.seed
    )
    samples = [[int(pipeline.pieces.length[p]) for p in sampler.next().piece_ids] for _ in range(batches)]

    def variant(choice):
        chosen = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, stage_weights=choice))
        costs = SchemeCosts(cost_model(chosen, layout, lambda _: None), layout.num_devices)
        return costs, strategy_options(chosen, pipeline, costs)

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
    return isinstance(key, tuple) and len(key) == 2 and key[0] == "groups"


def all_documents(pieces, rows) -> list:
    """The feed's split for strategy policies: one plan over all of the iteration's documents."""
    return [list(pieces)]


class GroupsStep:
    """The executable of one strategy: pull, the groups' programs, update (see the module docstring)."""

    def __init__(self, ctx: StepContext, pull, groups: Sequence, update: CompiledStep):
        self.ctx, self.pull, self.groups, self.update = ctx, pull, list(groups), update
        here = jax.process_index()  # a process dispatches only the groups with devices of its own
        self.local = [any(d.process_index == here for d in mesh.devices.flat) for _, mesh, _ in self.groups]
        n = len(ctx.placement.devices)  # the update's per-device partials: [N, *param] and [N] sums
        self.partial_shapes = [((n, *a.shape), a.dtype) for a in jax.tree.leaves(ctx.abstract_state.params)]
        self.partial_shapes += [((n,), np.float32)] * len(SUM_KEYS)

    def __call__(self, state, arrays: dict):
        pulled = self.pull(state.params)
        outs = []
        for g, (program, mesh, batch_shardings) in enumerate(self.groups):
            if not self.local[g]:
                continue  # another process's group: that process dispatches it
            params = jax.tree.map(lambda a, mesh=mesh: for_group(a, mesh), pulled)
            weight = place_global(arrays[f"{g}/weight"], NamedSharding(mesh, P()))
            parts = [
                {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
                for prefix in (f"{g}/{i}/" for i in range(len(batch_shardings)))
            ]
            batch = parts[0] if len(parts) == 1 else tuple(parts)
            shardings = batch_shardings[0] if len(parts) == 1 else tuple(batch_shardings)
            outs.append(program(params, place_global(batch, shardings), weight))
        placement = self.ctx.placement
        columns = [[o[0][i] for o in outs] for i in range(len(self.partial_shapes) - len(SUM_KEYS))]
        columns += [[o[1][key] for o in outs] for key in SUM_KEYS]
        names = [f"g/{i}" for i in range(len(columns) - len(SUM_KEYS))] + [f"s/{key}" for key in SUM_KEYS]
        partials = {
            name: gather_partials(column, placement.state_mesh, placement.devices, shape, dtype)
            for name, column, (shape, dtype) in zip(names, columns, self.partial_shapes)
        }
        state, metrics = self.update(state, partials)
        # layer forwards of this process's groups (all of them in a single-process run)
        return state, {**metrics, "group_layer_forwards": [o[2] for o in outs]}

    def memory_analysis(self):
        return self.update.memory_analysis()


class GroupsStrategy(ExecutionStrategy):
    """Device groups of different schemes per iteration, chosen by a strategy policy
    (``hydraulis``, ``flexsp``, ``dcp``, ``homogeneous``, ``auto``; :mod:`jvarlen.plan.strategy`)."""

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
    ):
        self.ctx, self.costs, self.policy, self.options = ctx, costs, policy, options
        self.ahead, self.workers, self.wait, self.chunk_multiple = ahead, workers, wait, chunk_multiple
        self.residual = None if residual == "all" else residual
        self.stage_weights = stage_weights
        self.fallback_policy = fallback_policy
        self._service = None
        self.cache = None

    # ---- planning
    def planner(self) -> Planner:
        solve = functools.partial(plan_strategy, self.policy, costs=self.costs, options=self.options)
        if self.ahead > 0 and self._service is None:
            from jvarlen.plan.service import PlanningService

            fallback = functools.partial(plan_strategy, self.fallback_policy, costs=self.costs)
            self._service = PlanningService(
                None, workers=self.workers, solve=solve, fallback=fallback, reproducible=self.wait
            )
        inline = functools.partial(cpsat.call_reproducibly, solve) if self.wait else solve
        return Planner(all_documents, inline, self._service, self.wait)

    # ---- host side
    def prepare(self, iteration, known=()) -> Prepared:
        plan: StrategyPlan = iteration.plans[0]
        docs = iteration.groups[0]
        num_layers = self.ctx.model.num_layers
        keys, arrays, targets = [], {}, []
        known = [k for key in known for k in (key[1] if _is_composite(key) else (key,))]  # a step's group programs
        for g, group in enumerate(plan.groups):
            ids = (group.scheme.pp, group.scheme.sp, tuple(group.devices))
            same = [k[4] for k in known if isinstance(k, tuple) and k[:1] == ("group",) and k[1:4] == ids]
            same = [s for k in same for s in (k if isinstance(k, tuple) else (k,))]  # a part may reuse any
            sigs, target = [], 0.0
            for i, part in enumerate(group.plan.part_plans()):  # each part its own bucket and tables
                sig, batch = prepare_plans(
                    [part], [[docs[d] for d in group.documents]], num_layers, same, chunk_multiple=self.chunk_multiple
                )
                sigs.append(sig)
                target += float(batch["loss_mask"].sum())
                arrays.update({f"{g}/{i}/{k}": v for k, v in batch.items()})
            keys.append(("group", *ids, sigs[0] if len(sigs) == 1 else tuple(sigs)))
            targets.append(target)
        total = max(sum(targets), 1.0)
        for g, t in enumerate(targets):
            arrays[f"{g}/weight"] = np.float32(t / total)
        info = {
            "strategy": plan.describe(),
            "groups": len(plan.groups),
            "chunks": sum(g.plan.n_chunks for g in plan.groups),
            "group_parts": [max(1, len(g.plan.parts)) for g in plan.groups],  # bucket parts per group's step
            "predicted_iteration_time_s": float(plan.stats.get("iteration_time_s", float("nan"))),
            "policy_chosen": str(plan.stats.get("policy_chosen", plan.policy)),
        }
        estimates = plan.stats.get("auto_estimates")
        if estimates:  # auto: every policy's estimate of this iteration (or why it could not plan it)
            info["policy_estimates_s"] = {k: _estimate(v) for k, v in estimates.items()}
        return Prepared(("groups", tuple(keys)), arrays, info)

    # ---- compiled programs
    def compile(self, key) -> GroupsStep:
        if self.cache is None:
            raise RuntimeError("GroupsStrategy.attach(cache) first: its programs live in the one compile cache")
        _, group_keys = key
        groups = [self.cache.get(k, self._compile_group) for k in group_keys]
        pull = self.cache.get(("pull",), self._compile_pull)
        update = self.cache.get(("update",), self._compile_update)
        return GroupsStep(self.ctx, pull, groups, update)

    def _devices(self, indices) -> list:
        return [self.ctx.placement.devices[i] for i in indices]

    def _compile_pull(self, key):
        placement = self.ctx.placement
        replicated = jax.tree.map(lambda _: placement.replicated, self.ctx.abstract_state.params)
        fn = jax.jit(lambda params: params, in_shardings=(placement.state_sharding.params,), out_shardings=replicated)
        return fn.lower(self.ctx.abstract_state.params).compile(compiler_options=self.ctx.compiler_options)

    def _compile_group(self, key):
        _, pp, sp, devices, sig = key  # sig: one signature, or the step's parts' (a tuple)
        ctx = self.ctx
        sigs = sig if isinstance(sig, tuple) else (sig,)
        mesh = group_mesh(sigs[0].layout, self._devices(devices))
        grads = make_pipeline_grads(
            ctx.graphdef, ctx.model, sig, mesh, residual_policy=self.residual, stage_weights=self.stage_weights
        )
        num_layers = ctx.model.num_layers

        def program(params, batch, weight):
            sums, g, layer_forwards = grads(params, batch)
            real = sum(jnp.sum(b["segment_ids"] > 0) for b in (batch if isinstance(batch, tuple) else (batch,)))
            sums = {**sums, "real_tokens": real.astype(jnp.float32)}
            layers, rest = split_params(g)
            p_layers, p_rest, p_sums = device_partials(mesh, layers, rest, sums, weight, num_layers)
            partial_grads = nnx.merge_state(p_rest, nnx.State({"layers": p_layers}))
            # replicated over the group: a process holding any of its devices can read the counts
            # (sharded by stage, the stages of another process could not be fetched)
            return jax.tree.leaves(partial_grads), p_sums, jax.lax.with_sharding_constraint(layer_forwards, replicated)

        replicated = NamedSharding(mesh, P())
        batch_sharding = NamedSharding(mesh, P(DATA))
        params = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), ctx.abstract_state.params
        )
        batches = [
            {k: jax.ShapeDtypeStruct(v, np.int32, sharding=batch_sharding) for k, v in s.input_shapes().items()}
            for s in sigs
        ]
        batch = batches[0] if len(sigs) == 1 else tuple(batches)
        weight = jax.ShapeDtypeStruct((), np.float32, sharding=replicated)
        compiled = jax.jit(program).lower(params, batch, weight).compile(compiler_options=ctx.compiler_options)
        here = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        if here:  # the group's step runs beside the canonical state: both must fit (GPU; CPU has no limit)
            what = f"the group (pp={pp}, sp={sp}) on devices {list(devices)}: "
            ensure_fits(compiled, here[0], resident_bytes=self._state_bytes_per_device(), what=what)
        return compiled, mesh, [{k: batch_sharding for k in b} for b in batches]

    def _state_bytes_per_device(self) -> int:
        """Bytes of the canonical train state (master weights, optimizer moments) on one device."""
        return sum(
            math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
            for a in jax.tree.leaves(self.ctx.abstract_state)
            if getattr(a, "sharding", None) is not None
        )

    def _compile_update(self, key) -> CompiledStep:
        ctx = self.ctx
        placement = ctx.placement
        n = len(placement.devices)
        leaves = jax.tree.leaves(ctx.abstract_state.params)
        treedef = jax.tree.structure(ctx.abstract_state.params)
        canonical = placement.state_sharding.params

        def sum_partials(params, batch):
            summed = [batch[f"g/{i}"].sum(0) for i in range(len(leaves))]
            grads = push(jax.tree.unflatten(treedef, summed), canonical, params)
            return {k: batch[f"s/{k}"].sum(0) for k in SUM_KEYS}, grads, {}

        rows = NamedSharding(placement.state_mesh, P(FSDP))
        shapes = {f"g/{i}": jax.ShapeDtypeStruct((n, *a.shape), a.dtype) for i, a in enumerate(leaves)}
        shapes.update({f"s/{k}": jax.ShapeDtypeStruct((n,), np.float32) for k in SUM_KEYS})
        return ctx.compile(sum_partials, shapes, {k: rows for k in shapes})

    # ---- records and the cost check
    def record(self, iteration, prepared: Prepared, metrics: dict) -> dict:
        return {"layer_forwards": [np.asarray(f).sum(0).tolist() for f in metrics.get("group_layer_forwards", [])]}

    def observe(self, check, iteration, prepared: Prepared, step_s: float, run_s: float) -> dict:
        return {"groups_s": run_s, **check.observe_plans([g.plan for g in iteration.plans[0].groups], run_s)}

    def fingerprint(self) -> dict:
        text = self.costs.base.fingerprint() if self.costs is not None else ""
        return {"the planner's cost model": text, "the policy's options (Hydraulis' candidates)": repr(self.options)}

    def describe(self) -> str:
        return f"heterogeneous device groups: policy {self.policy} on {len(self.ctx.placement.devices)} devices"

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            self._service = None


__all__ = ["GROUP_AXES", "GroupsStep", "GroupsStrategy"]
