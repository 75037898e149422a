"""Why EPP refuses a batch: the memory a split document needs at least (checked before the
search, :func:`refuse_unsplittable`), model states over the budget, and the message of a search
whose every slice count was over the budget (:func:`unfit_message`)."""

from __future__ import annotations

import math
from typing import Sequence

from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.options import PlanningError


def split_memory_bound(length: int, cost) -> tuple[float, int]:
    """``(bytes, stage)``: a lower bound on the peak memory per device of any plan of a document of
    ``length`` tokens, split or not, on its worst stage, under the memory model plans are checked
    against (the simulator's time line, :func:`jvarlen.plan.plan.replay_peaks`, Alg. 2's windows).

    A slice's activations stay on a stage from its forward to its backward, and that backward
    needs the dK/dV of the next slice's (:func:`jvarlen.plan.schedule.dependencies`), so while the
    last slice's backward runs, every earlier slice is live. With ``s`` tokens in the last slice
    (its context is the other ``length - s``) the stage then holds at least
    ``memory_floor + (length - s)·(a + c) + s·(t + w)``: ``a`` and ``t`` what a non-tail and a tail
    chunk keep per token, the cheaper of no and full recomputation (memory is linear in the layers
    recomputed, Eq. 19), ``w`` the least backward working memory per token and ``c`` its part per
    context token; the slices' own context terms and the other documents' chunks only add. That is
    linear in ``s``, so its least value over ``1 <= s <= length`` (``s = length``: not split) is at
    an end. Each slice's chunk on the last stage also holds its head (:meth:`CostModel.head_memory`),
    which grows less than linearly in the tokens past a tile of logits but is subadditive: the
    slices' heads hold at least the whole document's. Assumes the memory coefficients are
    non-negative (as profiled and analytic ones are)."""
    sp, layers = cost.layout.sp, cost.layers_per_stage
    whole = ChunkShape(0, (sp,), tail=True)
    w = min(cost.working_memory(whole, r) for r in (0, layers)) / sp
    c = (cost.working_memory(ChunkShape(sp, (sp,)), 0) - cost.working_memory(whole, 0)) / sp
    worst, stage = -math.inf, 0
    for p in range(cost.layout.pp):
        a = min(cost.activation_per_token(p, r, tail=False) for r in (0, layers)) + c
        t = min(cost.activation_per_token(p, r, tail=True) for r in (0, layers)) + w
        head = cost.head_memory(ChunkShape(0, (length,), tail=True)) if p == cost.layout.pp - 1 else 0.0
        need = cost.memory_floor(p) + min((length - 1) * a + t, length * t) + head
        if need > worst:
            worst, stage = need, p
    return worst, stage


def states_error(cost) -> PlanningError:
    """The error of a layout whose model states and a backward's layer gradients alone exceed the budget."""
    state = max(map(cost.memory_floor, range(cost.layout.pp))) / 2**30
    return PlanningError(
        f"the model states and a backward's layer gradients ({state:.2f} GiB per device) exceed the "
        f"memory budget ({cost.memory_budget / 2**30:.2f} GiB per device): add pipeline stages or devices"
    )


def refuse_states_over_budget(cost) -> None:
    """Raises :func:`states_error` where the model states and a backward's layer gradients of some
    stage alone reach the budget (no plan of any policy fits)."""
    if max(map(cost.memory_floor, range(cost.layout.pp))) >= cost.memory_budget:
        raise states_error(cost)


def refuse_unsplittable(lengths: Sequence[int], cost) -> None:
    """Raises :class:`PlanningError` at once where the longest document fits no plan by
    :func:`split_memory_bound` (every slicing, every recomputation); before it, the search would
    chunk, group and simulate every slice number and bucket size to find none fits."""
    longest = max(lengths)
    if longest <= cost.max_tokens(in_flight=1, tail=True):
        return  # fits unsplit
    refuse_states_over_budget(cost)
    need, p = split_memory_bound(longest, cost)
    if need <= cost.memory_budget:
        return
    floor = cost.memory_floor(p)
    raise PlanningError(
        f"a document of {longest:,} tokens cannot be split into slices that fit memory on {cost.layout}: every "
        f"earlier slice stays in memory until the last slice's backward, so stage {p} needs at least "
        f"{need / 2**30:.2f} GiB per device (model states and layer gradients {floor / 2**30:.2f} GiB + "
        f"{(need - floor) / longest:,.0f} bytes per token, the least any recomputation keeps), over the budget "
        f"({cost.memory_budget / 2**30:.2f} GiB per device); raise pp or sp, or shorten data.seq_len"
    )


def unfit_message(unfit: dict, lengths, buckets: bool) -> str:
    """Why no slice count fits: the counts tried and the reason at the fewest and most slices."""
    if not unfit:
        return "no bucket-sized slices fit memory" if buckets else "no slice number fits memory"
    tried = sorted(unfit)
    shown = ", ".join(map(str, tried)) if len(tried) <= 8 else f"{len(tried)} counts from {tried[0]} to {tried[-1]}"
    reasons = dict.fromkeys(f"N = {n}: {unfit[n]}" for n in (tried[0], tried[-1]))
    return (
        f"no slice number N gives a plan that fits memory (longest document {max(lengths):,} tokens; tried "
        f"{shown}{', and every bucket size' if buckets else ''}); {'; '.join(reasons)}. Raise pp or sp, or "
        "shorten data.seq_len"
    )
