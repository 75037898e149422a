"""Execution strategies: how the gradients of one iteration are computed.

One iteration = sampled documents -> plan -> execution -> gradients -> one update of the one
canonical state. The run loop (:mod:`jvarlen.runtime.loop`) drives every strategy the same way;
a strategy says only

* what the planner solves for an iteration, if anything (:meth:`ExecutionStrategy.planner`),
* how an iteration becomes host arrays and the signature of its compiled step
  (:meth:`ExecutionStrategy.prepare`, numpy only),
* how a signature is compiled (:meth:`ExecutionStrategy.compile`, through
  :meth:`StepContext.compile`: the one train step of :mod:`jvarlen.runtime.step`), and
* what it logs and how its time is predicted (:meth:`ExecutionStrategy.observe`).

The strategies: :mod:`jvarlen.runtime.strategies.layouts` (a ``(dp, sp)`` layout of all devices)
and :mod:`jvarlen.runtime.strategies.pipeline` (the elastic pipeline executor).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Hashable, Optional, Sequence

from jvarlen.config import ConfigError, ModelConfig
from jvarlen.parallel.sharding import Placement
from jvarlen.runtime.step import (
    CompiledStep,
    GradsFn,
    SumsFn,
    compile_train_step,
    lower_train_step,
    make_eval_step,
    make_train_step,
)


def checked_residual(name: Optional[str]) -> Optional[str]:
    """``parallel.residual_policy`` as the strategies take it: None where a layer keeps every residual
    (None or ``"all"``: plain autodiff), else the policy's name, checked
    (:func:`jvarlen.model.transformer.residual_policy`; an unknown name is a :class:`ConfigError`)."""
    if name in (None, "all"):
        return None
    from jvarlen.model.transformer import residual_policy

    try:
        residual_policy(name)
    except ValueError as error:
        raise ConfigError(f"parallel.residual_policy: {error}") from None
    return name


@dataclasses.dataclass
class StepContext:
    """What every strategy compiles against: the model, the optimizer and the canonical placement
    of the train state (fixed for the run; ``abstract_state`` gives its shapes and shardings)."""

    graphdef: Any
    model: ModelConfig
    optimizer: Any
    placement: Placement
    abstract_state: Any
    compiler_options: Optional[dict] = None  # e.g. {"xla_backend_optimization_level": 0} in tests

    def _args(self, step_fn, batch_shapes: dict, batch_shardings: dict) -> tuple:
        state = (self.abstract_state, self.placement.state_sharding)
        return (step_fn, *state, batch_shapes, batch_shardings, self.placement.replicated)

    def compile(self, grads_fn: GradsFn, batch_shapes: dict, batch_shardings: dict) -> CompiledStep:
        """The one train step (:func:`jvarlen.runtime.step.make_train_step`) with these gradients,
        compiled ahead of time for these inputs: state in and out canonical, metrics replicated."""
        train_step = make_train_step(grads_fn, self.optimizer)
        args = self._args(train_step, batch_shapes, batch_shardings)
        return compile_train_step(*args, compiler_options=self.compiler_options)

    def compile_eval(self, sums_fn: SumsFn, batch_shapes: dict, batch_shardings: dict) -> CompiledStep:
        """The evaluation step (:func:`jvarlen.runtime.step.make_eval_step`: the train step's forward
        pass, no update) with these loss sums, compiled the same way; it returns the sums only."""
        args = (*self._args(make_eval_step(sums_fn), batch_shapes, batch_shardings), True)
        return compile_train_step(*args, compiler_options=self.compiler_options)

    def lower(self, grads_fn: GradsFn, batch_shapes: dict, batch_shardings: dict):
        """The same step lowered, not compiled (deviceless GPU checks read its compilation)."""
        return lower_train_step(*self._args(make_train_step(grads_fn, self.optimizer), batch_shapes, batch_shardings))


@dataclasses.dataclass
class Prepared:
    """One iteration ready to run: the signature of its compiled step, its numpy inputs, and the
    strategy's fields for the step record (``info``)."""

    key: Hashable
    arrays: dict
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Planner:
    """What the feed plans for a strategy: ``split(pieces, rows)`` -> the documents of each plan
    (one plan per pipeline, say); ``solve(lengths)`` plans inline; ``service`` solves ahead in
    worker processes (:class:`jvarlen.plan.service.PlanningService`); ``wait``: never take a
    fallback plan."""

    split: Callable
    solve: Callable
    service: Any = None
    wait: bool = False


class ExecutionStrategy(abc.ABC):
    """One way of computing an iteration's gradients (see the module docstring)."""

    name: str = ""

    def attach(self, cache) -> None:
        """The run's one compile cache (a strategy whose step is several programs caches them there)."""
        self.cache = cache

    def planner(self) -> Optional[Planner]:
        return None

    @abc.abstractmethod
    def prepare(self, iteration, known: Sequence[Hashable]) -> Prepared:
        """Host arrays and signature of ``iteration``; ``known``: signatures already compiled
        (or being compiled), which the strategy may reuse when they cover the iteration."""

    @abc.abstractmethod
    def compile(self, key: Hashable) -> CompiledStep:
        """The executable of signature ``key``."""

    def record(self, iteration, prepared: Prepared, metrics: dict) -> dict:
        """Fields of this strategy in the step record (besides ``prepared.info``)."""
        return {}

    def observe(self, check, iteration, prepared: Prepared, step_s: float, run_s: float) -> dict:
        """The online cost check's prediction for this step (``check``: a
        :class:`jvarlen.runtime.cost_check.StepTimeCheck`)."""
        return {}

    def describe(self) -> str:
        return self.name

    def fingerprint(self) -> dict:
        """What every process of a distributed run must have alike for this strategy (the planner's
        cost model, its options): name -> text (:func:`jvarlen.runtime.distributed.check_same`)."""
        return {}

    def close(self) -> None:  # noqa: B027 (most strategies start nothing)
        """Releases what the strategy started (planner processes)."""
