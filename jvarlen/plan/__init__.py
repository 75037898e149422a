"""Host-side planning: cost model, chunking, schedules, solvers, simulator (pure numpy/OR-Tools, no JAX).

Entry points: :func:`plan_iteration` turns a batch of document lengths into a
validated :class:`Plan`; :func:`simulate` replays a plan under a cost model;
:class:`PlanningService` solves plans in background processes.
"""

from jvarlen.plan.api import POLICIES, PlannerOptions, PlanningError, make_cost, plan_iteration, simulate
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.plan import PLAN_VERSION, Plan, PlanError
from jvarlen.plan.schedule import Schedule
from jvarlen.plan.sequence_processor import chunk_batch, split_mesh
from jvarlen.plan.service import PlanningService
from jvarlen.plan.simulator import SimResult
from jvarlen.plan.units import PlannedChunk
from jvarlen.plan.workloads import sample_batch, stdlib_lengths

__all__ = [
    "POLICIES",
    "PLAN_VERSION",
    "ChunkShape",
    "CostCoefficients",
    "CostModel",
    "ModelShape",
    "Plan",
    "PlanError",
    "PlannedChunk",
    "PlannerOptions",
    "PlanningError",
    "PlanningService",
    "Schedule",
    "SimResult",
    "SolverOptions",
    "chunk_batch",
    "make_cost",
    "plan_iteration",
    "sample_batch",
    "simulate",
    "split_mesh",
    "stdlib_lengths",
]
