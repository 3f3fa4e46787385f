"""fit_in_chunks (memsaving.planners.chunk_fit) on scripted planners: a plan
that fits its target as the allocator holds it, or the lowest one."""

import pytest

from memsaving.errors import BudgetError
from memsaving.planners.chunk_fit import fit_in_chunks
from memsaving.planners.planning import Plan


class ScriptedPlanner:
    """Plans predicted at the target (within [lowest, highest]), holding ``waste`` more in chunks."""

    def __init__(self, lowest: int, highest: int, waste: float):
        self.lowest, self.highest, self.waste = lowest, highest, waste
        self.calls = []

    def __call__(self, target: int, or_lowest: bool) -> Plan:
        self.calls.append((target, or_lowest))
        if target < self.lowest and not or_lowest:
            raise BudgetError.carrying(f"no plan under {target}", self.lowest)
        peak = max(min(target, self.highest), self.lowest)
        return Plan("budget", [], [], [], peak, 2 * self.highest, 1.0, chunk_peak=int(peak * (1 + self.waste)))


def test_a_plan_whose_chunks_go_over_is_replaced_by_a_lower_one():
    planner = ScriptedPlanner(lowest=500, highest=1000, waste=0.2)
    plan = fit_in_chunks(planner, 960, or_lowest=False)
    assert plan.device_peak <= 960
    assert len(planner.calls) == 2


def test_the_planners_lowest_plan_is_not_asked_for_twice():
    # nothing is predicted under the target: the first answer is the planner's lowest plan already
    planner = ScriptedPlanner(lowest=900, highest=1000, waste=0.2)
    plan = fit_in_chunks(planner, 800, or_lowest=True)
    assert plan.predicted_peak == 900 and plan.planned_for == 900
    assert planner.calls == [(800, True)]


def test_without_or_lowest_a_budget_nothing_meets_is_refused_with_the_budget_it_needs():
    planner = ScriptedPlanner(lowest=900, highest=1000, waste=0.2)
    with pytest.raises(BudgetError) as caught:
        fit_in_chunks(planner, 950, or_lowest=False)
    assert caught.value.smallest_budget >= 1080  # the lowest plan's 900 in 1080 bytes of chunks
