"""Knobs of the Hydraulis two-stage assignment and its scheme space ℙ (§5.1), shared by the
``hydraulis`` and ``homogeneous`` policies (:mod:`jvarlen.plan.hydraulis`) and the strategy
proposal (:mod:`jvarlen.plan.hydraulis_proposal`).

Pure Python: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jvarlen.plan.hydraulis_pack import PackOptions
from jvarlen.plan.strategy import Scheme, SchemeCosts, enumerate_schemes

RECOMPUTE = ("auto", "none")
SIMULATIONS = ("paired", "ticks", "async")


@dataclasses.dataclass(frozen=True)
class AssignmentOptions:
    """Knobs shared by ``hydraulis`` and ``homogeneous`` (the two-stage assignment).

    ``schemes``: the scheme space ℙ (None: powers of two with ``pp ≤ max_pp`` dividing the layers,
    ``sp ≤ max_sp`` dividing the heads; the default lets SP cross nodes, as Hydraulis' TP ranges up to
    N (§5.1): the longest documents need it; ``max_sp = 0`` keeps SP inside a node). ``trials``:
    Alg. 1 trials (the paper uses 100) for the ``pack_top`` candidates ranked best after a first
    dispatch of every candidate with ``rank_trials`` trials. ``recompute``: ``"auto"`` lets a document above a scheme's
    no-recomputation capacity run alone with the layers it must recompute (MaxLen with full
    recomputation), ``"none"`` never recomputes. ``pack_top``: candidates packed after dispatch;
    ``simulate_top``: of those, the best by Eq. 1 (within ``simulate_margin`` of the best estimate)
    are planned and simulated, and then every other candidate whose (packed) estimate is below the
    fastest simulated time; the fastest is returned. The margin is 20 %: Eq. 1 charges a
    pipeline up to ~15 % more than the lock-step simulation, and a pp = 1 group's simulation adds
    its executor-memory recomputation (docs/design/heterogeneous.md, "One iteration").
    ``homogeneous_top``: among the candidates, the best this many homogeneous ones (every group
    of one scheme) are also packed and simulated (within the margin of the best of them). Their
    estimates rank each other worst (pipelines of different depths): on 64 H100s, 2×(pp=4, sp=8)
    ranked fourth by estimate and simulated 8 % below the chosen layout. So ``hydraulis``, whose
    candidates include the homogeneous layouts, simulates what ``homogeneous`` does (0: off).
    ``simulation``: the executor model the group plans are simulated in: ``"paired"`` (the
    executor's: paired ticks, every chunk of a group's step padded to one bucket), ``"ticks"`` (one
    op per tick, no padding: these policies' model before 2026-11-28, up to 2× below the
    executor's time on the strategies benchmark) or ``"async"``.
    ``prune``: skip building a pipeline cut or a candidate that a lower bound, or one of its groups
    simulated, shows slower than a fitting plan already built (the same plan; False builds every
    one, to check that or to time it: ``scripts/hydraulis_search_check.py``).
    """

    schemes: Optional[tuple[Scheme, ...]] = None
    max_pp: int = 8
    max_sp: int = 64
    trials: int = 32
    rank_trials: int = 2
    lpt_trial: bool = True
    local_search: bool = True  # improve the best trial by moves/swaps off the slowest pipeline
    seed: int = 0
    recompute: str = "auto"
    util_threshold: float = 0.85
    pack: PackOptions = PackOptions()
    pack_top: int = 3
    simulate_top: int = 2
    simulate_margin: float = 0.2
    homogeneous_top: int = 4
    simulation: str = "paired"
    prune: bool = True

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.simulation not in SIMULATIONS:
            raise ValueError(f"simulation must be one of {SIMULATIONS}, got {self.simulation!r}")
        if min(self.trials, self.rank_trials, self.pack_top, self.simulate_top) < 1:
            raise ValueError("trials, rank_trials, pack_top and simulate_top must be >= 1")
        if self.homogeneous_top < 0:
            raise ValueError(f"homogeneous_top must be >= 0, got {self.homogeneous_top}")
        if not 0 < self.util_threshold < 1:
            raise ValueError(f"util_threshold must be in (0, 1), got {self.util_threshold}")


def scheme_space(costs: SchemeCosts, options: AssignmentOptions) -> list[Scheme]:
    """ℙ (Hydraulis §5.1) for ``costs``: ``options.schemes`` or the enumerated powers of two."""
    if options.schemes is not None:
        return sorted(set(options.schemes), key=lambda s: (s.num_devices, s.pp))
    max_sp = options.max_sp or costs.coeffs.gpus_per_node
    m = costs.model
    return enumerate_schemes(costs.num_devices, m.num_layers, m.num_heads, max_pp=options.max_pp, max_sp=max_sp)
