"""A budget plan that fits its target as the allocator holds it, not only
as its tensors ask (no TensorFlow).

The budget planners search plans by their predicted peak: the bytes the
step's live tensors ask for.  The device holds more: TensorFlow's allocator
gives a request a free chunk of up to twice its size whole, so a plan
predicted just under its target can hold 10-25% more (a DenseNet-style net:
13.2 MiB predicted, 15.4 MiB in the allocator model, 15.5-17.8 measured).
Under a hard memory limit that is an out-of-memory error.

:func:`fit_in_chunks` asks the planner again for a lower target, by as much
as the allocator model (:attr:`memsaving.planners.planning.Plan.chunk_peak`)
went over, until a plan's :attr:`~memsaving.planners.planning.Plan.device_peak`
fits, and otherwise refuses (or hands back the lowest plan found, when
asked for it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from memsaving.errors import BudgetError, feasible_budget
from memsaving.planners.budget import no_plan_fits
from memsaving.planners.planning import Plan

TRIES = 3
"""Lower targets tried after the first plan, before the planner's lowest plan."""

STEP_DOWN = 0.02
"""The least a next target is lowered by, as a fraction of the first
target's room above the resident bytes (doubling with each try): a plan
whose chunks went over by a few bytes is not asked for again a few bytes
lower."""


def fit_in_chunks(plan_at: Callable[[int, bool], Plan], target: int, resident: int, or_lowest: bool,
                  tries: int = TRIES) -> Plan:
    """The plan ``plan_at(target, or_lowest)`` makes, or a lower one, whose
    device peak (chunks included) fits ``target``.

    ``plan_at(t, lowest)`` plans for ``t``; with ``lowest`` False it raises
    ``BudgetError`` when nothing is predicted under ``t``, with ``lowest``
    True it returns the lowest plan it finds instead.  Lower targets are
    tried, each lower by what the last plan's chunks went over (at least
    :data:`STEP_DOWN` of the room above the ``resident`` bytes, doubling),
    and last the planner's lowest plan (``plan_at(resident, True)``, the
    floor), whose chunks may fit where a plan predicted higher does not.
    When none fits, the one of lowest device peak is returned if
    ``or_lowest``, else a ``BudgetError`` names the budget the floor needs.

    A target nothing is predicted under goes straight to the floor, and its
    error names the floor's device peak too: the budget an error names is
    passed back by callers, and the call at that budget judges the floor by
    its chunks, so the figure must be the floor's in chunks, not its
    predicted peak (else the budget passed back is refused again).

    Examples
    --------
    A planner whose plans hold 20% more in chunks than predicted:

    >>> from memsaving.planners.planning import Plan
    >>> def plan_at(target, lowest):
    ...     peak = max(min(target, 1000), 600)
    ...     return Plan("budget", [], [], [], peak, 1200, 1.0, chunk_peak=int(peak * 1.2))
    >>> plan = fit_in_chunks(plan_at, 960, 0, False)
    >>> plan.device_peak <= 960, plan.planned_for  # 960 less the 192 its first plan went over
    (True, 768)
    >>> fit_in_chunks(plan_at, 700, 0, True).device_peak  # nothing fits: the lowest
    720
    """
    tried = []
    try:
        plan = plan_at(target, or_lowest)
    except BudgetError:
        plan = None  # nothing is predicted under the target: only the floor is left to weigh
    if plan is not None:
        plan = replace(plan, planned_for=target)
        if plan.device_peak <= target:
            return plan
        tried.append(plan)
        lowered = target
        for attempt in range(tries):
            lowered -= max(plan.device_peak - target, int(STEP_DOWN * (target - resident)) << attempt)
            if lowered <= resident:
                break
            try:
                plan = plan_at(lowered, False)
            except BudgetError:
                break
            plan = replace(plan, planned_for=lowered)
            if plan.device_peak <= target:
                return plan
            tried.append(plan)
    floor = plan_at(resident, True)  # nothing fits the resident bytes alone: the planner's lowest plan
    floor = replace(floor, planned_for=floor.predicted_peak)
    if floor.device_peak <= target:
        return floor
    if or_lowest:
        return min(tried + [floor], key=lambda p: p.device_peak)
    # the floor's, though a plan tried may hold less in chunks: a call at this budget reaches the floor
    # whatever it tries first, so the budget named is one that call keeps
    raise no_plan_fits("checkpoint plan", target, feasible_budget(floor.device_peak),
                       " (predicted as the allocator holds it, in whole chunks)")
