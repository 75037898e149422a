"""Heterogeneous strategies as data: device groups of different parallel schemes in one iteration.

A *scheme* ``P = (pp, sp)`` is how one group of devices runs (Hydraulis §5.1: one training
pipeline; FlexSP/DCP: an SP group, ``pp = 1``). A *strategy* ``S = Σ dᵢ × Pᵢ`` is a list of
groups on disjoint devices; each group trains its own documents of the iteration. A
:class:`StrategyPlan` is what a strategy policy (``hydraulis``, ``flexsp``, ``dcp``) returns
and what the heterogeneous executor runs:

* ``groups[g].devices``: indices into the run's ordered device list (contiguous, largest
  groups first, so that a power-of-two group never straddles a node; :func:`place_groups`);
* ``groups[g].documents``: indices into the iteration's documents (``StrategyPlan.lengths``);
  every document is in exactly one group, whole;
* ``groups[g].plan``: an ordinary :class:`~jvarlen.plan.plan.Plan` over the group's documents
  (``plan.lengths[i] = lengths[documents[i]]``) with layout ``Layout(1, pp, sp)``: its chunks
  are the group's micro-batches (gradient accumulation steps for ``pp = 1``, pipeline
  micro-batches for ``pp > 1``), its schedule and recomputation table run on the pipeline
  executor exactly as an EPP plan does.

Costs: :class:`SchemeCosts` gives each scheme its :class:`~jvarlen.plan.cost.CostModel` (the
run's coefficients, the scheme's layout, a device group's pull and push and model states sharded
over *all* devices), Hydraulis' latency model ``T(l, P)`` (App. B.2) and memory model
``MaxLen(P)`` (App. B.1). A strategy's predicted time: :func:`predicted_time`.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape, document_lengths
from jvarlen.plan.cost import CostModel
from jvarlen.plan.json_file import JsonFile
from jvarlen.plan.memo import MethodCaches, method_cache
from jvarlen.plan.plan import Plan, PlanError, _jsonable, replay_peaks

STRATEGY_VERSION = 1


@dataclasses.dataclass(frozen=True, order=True)
class Scheme:
    """Parallel scheme of one device group: ``pp`` pipeline stages of ``sp``-way Ulysses SP."""

    pp: int = 1
    sp: int = 1

    def __post_init__(self):
        for name in ("pp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheme.{name} must be a positive int, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.pp * self.sp

    @property
    def layout(self) -> Layout:
        return Layout(dp=1, pp=self.pp, sp=self.sp)

    def __str__(self) -> str:
        return f"(pp={self.pp}, sp={self.sp})"


def enumerate_schemes(
    num_devices: int,
    num_layers: int,
    num_heads: int,
    *,
    max_pp: Optional[int] = None,
    max_sp: Optional[int] = None,
    pipelines: bool = True,
) -> list[Scheme]:
    """The scheme space ℙ (Hydraulis §5.1): ``pp`` divides the layers, ``sp`` divides the heads,
    both powers of two, ``pp · sp ≤ num_devices``. ``pipelines=False`` keeps ``pp = 1`` (FlexSP/DCP)."""
    out = []
    pp = 1
    while pp <= num_devices and (max_pp is None or pp <= max_pp):
        if num_layers % pp == 0 and (pipelines or pp == 1):
            sp = 1
            while pp * sp <= num_devices and (max_sp is None or sp <= max_sp):
                if num_heads % sp == 0:
                    out.append(Scheme(pp, sp))
                sp *= 2
        pp *= 2
    return sorted(out, key=lambda s: (s.num_devices, s.pp))


def place_groups(schemes: Sequence[Scheme], num_devices: int) -> list[tuple[int, ...]]:
    """Contiguous device ranges for groups of ``schemes`` (in the given order of groups): the
    groups are laid out largest first, so that with power-of-two sizes every group starts at a
    multiple of its own size (an SP group never straddles a node boundary). Returns each group's
    device indices in the input order."""
    total = sum(s.num_devices for s in schemes)
    if total > num_devices:
        raise ValueError(f"groups need {total} devices, the run has {num_devices}")
    order = sorted(range(len(schemes)), key=lambda g: -schemes[g].num_devices)
    out: list[tuple[int, ...]] = [()] * len(schemes)
    start = 0
    for g in order:
        n = schemes[g].num_devices
        out[g] = tuple(range(start, start + n))
        start += n
    return out


@dataclasses.dataclass
class GroupPlan:
    """One device group of a strategy: its scheme, devices, documents and executor plan."""

    scheme: Scheme
    devices: tuple[int, ...]
    documents: tuple[int, ...]
    plan: Plan

    @property
    def predicted_time_s(self) -> float:
        return float(self.plan.stats.get("iteration_time_s", float("nan")))

    def to_json(self) -> dict[str, Any]:
        return {
            "scheme": dataclasses.asdict(self.scheme),
            "devices": list(self.devices),
            "documents": list(self.documents),
            "plan": self.plan.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GroupPlan":
        return cls(
            scheme=Scheme(**data["scheme"]),
            devices=tuple(int(d) for d in data["devices"]),
            documents=tuple(int(d) for d in data["documents"]),
            plan=Plan.from_json(data["plan"]),
        )


@dataclasses.dataclass
class StrategyPlan(JsonFile):
    """One iteration's heterogeneous strategy: groups on disjoint devices over disjoint documents.

    ``stats`` holds at least ``iteration_time_s`` (predicted: slowest group + pull/push), ``solve_seconds`` and
    ``policy``; ``events`` notable planning events; ``stage_weights`` how its cost model held the groups' layers,
    ``"replicated"`` or ``"sharded"`` (:func:`plan_strategy` sets it; None, built by hand: as the step is set).
    """

    policy: str
    num_devices: int
    lengths: tuple[int, ...]
    groups: tuple[GroupPlan, ...]
    stats: dict = dataclasses.field(default_factory=dict)
    events: list = dataclasses.field(default_factory=list)
    stage_weights: Optional[str] = None
    version: int = STRATEGY_VERSION

    @property
    def schemes(self) -> tuple[Scheme, ...]:
        return tuple(g.scheme for g in self.groups)

    def describe(self) -> str:
        """``"1×(pp=1, sp=4) + 2×(pp=1, sp=2)"``: Σ dᵢ × Pᵢ."""
        counts: dict[Scheme, int] = {}
        for s in self.schemes:
            counts[s] = counts.get(s, 0) + 1
        return " + ".join(f"{d}×{s}" for s, d in sorted(counts.items(), key=lambda kv: (-kv[0].num_devices, kv[0])))

    def group_summary(self) -> dict[str, Any]:
        """What every policy's plan reports alike, from its groups' simulated plans (and
        ``stats["iteration_time_s"]``): the slowest group's propagation, the overhead on top, the
        groups' makespan imbalance, the worst bubble, whether all fit memory, the highest peak
        as a fraction of its budget, and the tokens planned."""
        makespans = [g.plan.stats["makespan_s"] for g in self.groups]
        top = max(makespans)
        return dict(
            propagation_s=top,
            overhead_s=float(self.stats["iteration_time_s"]) - top,
            imbalance=(top - min(makespans)) / top if top > 0 else 0.0,
            bubble_ratio=max(g.plan.stats["bubble_ratio"] for g in self.groups),
            fits_memory=all(g.plan.stats["fits_memory"] for g in self.groups),
            peak_memory_fraction=max(
                max(g.plan.stats["peak_memory_bytes"]) / g.plan.stats["memory_budget_bytes"] for g in self.groups
            ),
            tokens_in=int(sum(self.lengths)),
        )

    def signature(self) -> tuple:
        """What distinguishes strategies for logging and caching: the schemes on their devices."""
        return tuple((g.scheme.pp, g.scheme.sp, g.devices[0]) for g in self.groups)

    # ---- JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": "strategy",
            "policy": self.policy,
            "num_devices": self.num_devices,
            "lengths": list(self.lengths),
            "groups": [g.to_json() for g in self.groups],
            "stats": _jsonable(self.stats),
            "events": list(self.events),
            "stage_weights": self.stage_weights,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StrategyPlan":
        if data.get("version") != STRATEGY_VERSION or data.get("kind") != "strategy":
            raise PlanError(
                f"not a strategy plan of version {STRATEGY_VERSION}: {data.get('kind')!r} v{data.get('version')!r}"
            )
        if data.get("stage_weights") not in (None, "replicated", "sharded"):
            raise PlanError(f"stage_weights must be replicated, sharded or absent, got {data['stage_weights']!r}")
        return cls(
            policy=data["policy"],
            num_devices=int(data["num_devices"]),
            lengths=tuple(int(x) for x in data["lengths"]),
            groups=tuple(GroupPlan.from_json(g) for g in data["groups"]),
            stats=dict(data.get("stats", {})),
            events=list(data.get("events", [])),
            stage_weights=data.get("stage_weights"),
        )

    # ---- validation
    def validate(self, lengths: Sequence[int], costs: Optional["SchemeCosts"] = None) -> None:
        """Raises :class:`PlanError` listing every violation: documents exactly once and whole,
        devices disjoint and inside the run, each group's plan valid for its documents (and within
        memory under ``costs`` when given)."""
        lengths = [int(x) for x in lengths]
        errors: list[str] = []
        if list(self.lengths) != lengths:
            errors.append("strategy lengths differ from the batch being validated")
        seen_docs: dict[int, int] = {}
        seen_devices: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            if len(group.devices) != group.scheme.num_devices:
                errors.append(
                    f"group {g} {group.scheme}: {len(group.devices)} devices, needs {group.scheme.num_devices}"
                )
            for d in group.devices:
                if not 0 <= d < self.num_devices:
                    errors.append(f"group {g}: device {d} outside [0, {self.num_devices})")
                elif d in seen_devices:
                    errors.append(f"device {d} in groups {seen_devices[d]} and {g}")
                seen_devices[d] = g
            for doc in group.documents:
                if not 0 <= doc < len(lengths):
                    errors.append(f"group {g}: document {doc} outside [0, {len(lengths)})")
                elif doc in seen_docs:
                    errors.append(f"document {doc} in groups {seen_docs[doc]} and {g}")
                seen_docs[doc] = g
            if group.plan.layout != group.scheme.layout:
                errors.append(f"group {g}: plan layout {group.plan.layout} is not the scheme's {group.scheme.layout}")
            if not errors:
                group_lengths = [lengths[d] for d in group.documents]
                cost = None if costs is None else costs.cost(group.scheme)
                try:
                    group.plan.validate(group_lengths, cost)
                except PlanError as error:
                    errors.append(f"group {g}: {error}")
        missing = [d for d in range(len(lengths)) if d not in seen_docs]
        if missing:
            errors.append(f"documents {missing[:10]}{'...' if len(missing) > 10 else ''} in no group")
        if errors:
            raise PlanError(f"{len(errors)} problem(s) in strategy ({self.policy}): " + "; ".join(errors[:20]))


class SchemeCosts(MethodCaches):
    """Cost models of every scheme on the run's devices (Hydraulis App. B), from one fitted model.

    ``base`` is any :class:`CostModel` of the run's model and coefficients; its layout is
    ignored. ``num_devices``: the run's devices (the canonical state is sharded over all).
    """

    def __init__(self, base: CostModel, num_devices: int):
        self.base = base
        self.num_devices = int(num_devices)
        self.model = base.model
        self.coeffs = base.coeffs

    @method_cache()  # a few schemes per run; the object lives as long as the run
    def cost(self, scheme: Scheme) -> CostModel:
        return self.base.with_layout(scheme.layout, state_devices=self.num_devices, group=True)

    def T(self, length: int, scheme: Scheme) -> float:
        """Hydraulis ``T(l, P)``: forward + backward of one stage for a micro-batch holding one whole
        document of ``length`` tokens (the slowest stage: the last, with the head)."""
        cost = self.cost(scheme)
        chunk = ChunkShape(0, (int(length),))
        last = scheme.pp - 1
        return cost.fwd_time(chunk, last) + cost.bwd_time(chunk, last)

    @method_cache()
    def padded_cost(self, scheme: Scheme, bucket: int) -> CostModel:
        """:meth:`cost` with every chunk's matmuls over ``bucket`` tokens (the executor's padding)."""
        return self.cost(scheme).padded(int(bucket))

    def micro_batch_time(
        self, lengths: Sequence[int], scheme: Scheme, ckpt_layers: int = 0, pad_to: Optional[int] = None
    ) -> float:
        """Forward + backward (+ recomputation of ``ckpt_layers`` layers) of one stage for one
        micro-batch packing whole documents of ``lengths`` (varlen attention: Σ lᵢ², one GEMM of Σ lᵢ);
        ``pad_to``: its matmuls over that many tokens, as the executor pads a step's chunks."""
        cost = self.cost(scheme) if pad_to is None else self.padded_cost(scheme, pad_to)
        chunk = ChunkShape(0, tuple(int(x) for x in lengths))
        last = scheme.pp - 1
        return cost.fwd_time(chunk, last) + cost.bwd_time(chunk, last) + cost.recompute_time(chunk, ckpt_layers)

    def max_len(self, scheme: Scheme, recompute: bool = True) -> int:
        """Hydraulis ``MaxLen(P)``: the longest micro-batch (tokens) that fits with ``pp`` micro-batches
        in flight on the first stage (1F1B), with full recomputation (``recompute=True``) or none."""
        cost = self.cost(scheme)
        if recompute:
            return cost.max_tokens(in_flight=scheme.pp, tail=True)
        best = None
        for stage in range(scheme.pp):
            lines = cost.chunk_memory_lines(stage, 0, in_flight=scheme.pp, tail=False)
            n = cost.fitting_tokens(cost.memory_budget - cost.memory_floor(stage), lines)
            best = n if best is None else min(best, n)
        return int(best or 0)


def build_group_plan(
    policy: str,
    scheme: Scheme,
    lengths: Sequence[int],
    micro_batches: Sequence[Sequence[int]],
    costs: SchemeCosts,
    ckpt: str | Sequence[int] = "fit",
    simulation: str = "paired",
    solver=None,
    stats: Optional[dict] = None,
    events: Optional[list] = None,
    parts: Sequence[int] = (),
) -> Plan:
    """The executor :class:`Plan` of one group: ``micro_batches`` (lists of indices into the group's
    document ``lengths``, each packed whole into one chunk, in execution order) as one 1F1B unit
    on ``scheme``, in GPipe order where that is faster and fits (``assemble(gpipe_order=True)``; for
    ``pp = 1``: forward and backward of each micro-batch in turn, i.e. gradient accumulation).
    ``parts`` (``pp = 1``): micro-batch counts of consecutive runs of ``micro_batches``, each run
    its own unit and executor step (:attr:`Plan.parts`).

    ``ckpt``: recomputed layers per micro-batch (a sequence, one value per micro-batch, same on
    every stage; DCP-intra), ``"fit"`` (the least uniform count that fits memory), ``"milp"``
    (InfiniPipe Alg. 2 per chunk and stage) or ``"none"``. Stats come from simulating the plan
    under the scheme's cost model in ``simulation`` mode.
    """
    from jvarlen.plan.assemble import assemble
    from jvarlen.plan.units import PlannedChunk

    lengths = [int(x) for x in lengths]
    if sorted(d for mb in micro_batches for d in mb) != list(range(len(lengths))) or not all(micro_batches):
        raise ValueError(f"micro-batches must hold every document of the group exactly once, got {list(micro_batches)}")
    cost = costs.cost(scheme)
    chunks = [PlannedChunk(tuple((int(d), 0, lengths[d]) for d in mb)) for mb in micro_batches]
    shapes = [c.shape(lengths) for c in chunks]
    events = list(events or [])
    sizes = [int(x) for x in parts] or [len(chunks)]
    if sum(sizes) != len(chunks) or min(sizes) <= 0 or (len(sizes) > 1 and scheme.pp != 1):
        raise ValueError(f"parts {list(parts)} must partition {len(chunks)} micro-batches of a one-stage group")
    ends = np.cumsum(sizes).tolist()
    units = [_group_unit(policy, scheme, [[k] for k in range(e - n, e)], shapes, cost, ckpt, solver, events)
             for n, e in zip(sizes, ends)]  # fmt: skip
    parts = tuple(sizes) if len(sizes) > 1 else ()
    return assemble(policy, lengths, chunks, units, cost, stats, events, True, simulation, parts, gpipe_order=True)


def _group_unit(policy, scheme, families, shapes, cost, ckpt, solver, events):
    """One unit of :func:`build_group_plan`: ``families`` (one chunk each) and their recomputation
    (``ckpt``: as there, a sequence indexed by chunk)."""
    from jvarlen.plan.assemble import uniform_unit
    from jvarlen.plan.checkpointing import CkptSolution, SolverOptions
    from jvarlen.plan.grouping import Unit, solve_unit
    from jvarlen.plan.units import unit_schedule

    layers = cost.layers_per_stage
    if isinstance(ckpt, str) and ckpt == "fit":
        unit, fits = uniform_unit(families, shapes, cost)
        if not fits:
            events.append(f"{policy}: group {scheme} out of memory even with full recomputation")
    elif isinstance(ckpt, str) and ckpt in ("milp", "none"):
        unit = solve_unit(families, shapes, cost, scheme.pp, layers, solver or SolverOptions(), ckpt)
    elif isinstance(ckpt, str):
        raise ValueError(f"ckpt must be 'fit', 'milp', 'none' or one count per micro-batch, got {ckpt!r}")
    else:
        per = np.asarray([int(x) for x in ckpt], dtype=np.int64)
        if per.shape != (len(shapes),) or per.min(initial=0) < 0 or per.max(initial=0) > layers:
            raise ValueError(f"ckpt needs one value in [0, {layers}] per micro-batch, got {list(per)}")
        ids, schedule = unit_schedule(families, scheme.pp)
        # One value per micro-batch on every stage, as given. (Eq. 15's diagonal variables would tie
        # micro-batch k on stage p to micro-batch k + p on stage 0 and spread one long micro-batch's
        # recomputation over its pp - 1 neighbours.) Memory is checked window by window.
        table = np.repeat(per[list(ids)][:, None], scheme.pp, axis=1).astype(np.int32)
        fits = bool(np.all(replay_peaks([shapes[k] for k in ids], schedule, table, cost) <= cost.memory_budget))
        source = "given" if fits else "infeasible"
        values = per[list(ids)].astype(np.int64)
        rec_s = sum(cost.recompute_time(shapes[k], int(per[k])) for k in ids) * scheme.pp
        solution = CkptSolution(values, table, rec_s, source, "per micro-batch")
        unit = Unit(tuple(tuple(f) for f in families), tuple(ids), schedule, solution)
        if source == "infeasible":
            events.append(f"{policy}: group {scheme} recomputation {[int(per[k]) for k in ids]} does not fit memory")
    return unit


def predicted_time(groups: Sequence[GroupPlan], costs: SchemeCosts) -> float:
    """A strategy's predicted iteration time: its slowest group's, whose step overhead includes the
    pull and push of its stage; every device moves as many layers as the iteration's largest stage
    (jvarlen/parallel/groups.py), so a group of smaller stages also pays for the padding."""
    rows = max((costs.model.num_layers // g.scheme.pp for g in groups), default=0)
    pad = {g.scheme: costs.cost(g.scheme).sync_time(rows) - costs.cost(g.scheme).sync_time() for g in groups}
    return float(max((g.predicted_time_s + pad[g.scheme] for g in groups), default=0.0))


# ---- policies that return a StrategyPlan ------------------------------------------------------------

StrategyPolicy = Callable[[Sequence[int], SchemeCosts, Any], StrategyPlan]
_POLICIES: dict[str, tuple[StrategyPolicy, type]] = {}
_POLICY_MODULES = ("jvarlen.plan.hydraulis", "jvarlen.plan.flexsp", "jvarlen.plan.dcp", "jvarlen.plan.auto")


def register_policy(name: str, options_type: type):
    """Decorator: ``@register_policy("flexsp", FlexSPOptions)`` on ``plan(lengths, costs, options) ->
    StrategyPlan``. ``options_type`` is a frozen dataclass whose defaults are the policy's defaults.

    A policy must be a pure function of its arguments (seeded randomness only): every process of a
    multi-process run and a resumed run must plan the same iteration identically."""

    def wrap(fn: StrategyPolicy) -> StrategyPolicy:
        _POLICIES[name] = (fn, options_type)
        return fn

    return wrap


def strategy_policies() -> dict[str, tuple[StrategyPolicy, type]]:
    """``{name: (plan function, options type)}`` of every strategy policy (importing their modules)."""
    import importlib

    for module in _POLICY_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
    return dict(_POLICIES)


def plan_strategy(policy: str, lengths: Sequence[int], costs: SchemeCosts, options: Any = None) -> StrategyPlan:
    """Plans one iteration of ``lengths`` with the strategy policy ``policy`` (default options when None);
    its stats hold :meth:`StrategyPlan.group_summary` whatever the policy."""
    policies = strategy_policies()
    if policy not in policies:
        raise ValueError(f"unknown strategy policy {policy!r}; choose one of {', '.join(sorted(policies))}")
    fn, options_type = policies[policy]
    plan = fn(document_lengths(lengths), costs, options_type() if options is None else options)
    plan.stage_weights = "sharded" if costs.base.stage_weights_sharded else "replicated"
    for key, value in plan.group_summary().items():  # what a policy leaves out, from its groups
        plan.stats.setdefault(key, value)
    return plan


def load_any(path: str | os.PathLike):
    """A :class:`Plan` or :class:`StrategyPlan` from a JSON file written by either."""
    with open(path) as f:
        data = json.load(f)
    return StrategyPlan.from_json(data) if data.get("kind") == "strategy" else Plan.from_json(data)


__all__ = [
    "GroupPlan",
    "build_group_plan",
    "Scheme",
    "SchemeCosts",
    "StrategyPlan",
    "enumerate_schemes",
    "load_any",
    "place_groups",
    "plan_strategy",
    "predicted_time",
    "register_policy",
    "strategy_policies",
]
