"""Fitting a budget plan in the allocator's whole chunks (memsaving.planners.chunk_fit), without TensorFlow."""

import pytest

from memsaving.errors import BudgetError, feasible_budget
from memsaving.planners.budget import no_plan_fits
from memsaving.planners.chunk_fit import fit_in_chunks
from memsaving.planners.planning import Plan

MIB = 2 ** 20
RESIDENT = 50 * MIB
LOWEST = 60 * MIB  # the lowest plan the fake planner can make, as its tensors ask


def _planner(chunk_ratio: float):
    """A planner like the budget search: plans predicted at the target (between LOWEST and 100 MiB),
    holding ``chunk_ratio`` times their step memory in chunks; under LOWEST it raises with the
    smallest budget its own search knows, the lowest plan's predicted peak."""

    def plan_at(target: int, lowest: bool) -> Plan:
        if target < LOWEST and not lowest:
            raise no_plan_fits("plan", target, feasible_budget(LOWEST))
        peak = max(min(target, 100 * MIB), LOWEST)
        chunks = RESIDENT + int((peak - RESIDENT) * chunk_ratio)
        return Plan("budget", [], [], [], peak, 120 * MIB, 1.0, resident_bytes=RESIDENT, chunk_peak=chunks)

    return plan_at


@pytest.mark.parametrize("chunk_ratio", [1.0, 1.2, 1.5])
def test_the_budget_an_error_names_is_kept_when_passed_back(chunk_ratio):
    """A budget under every plan, refused, names a smallest budget; planned for that budget, a plan
    fits it in chunks.  Before, a target nothing was predicted under reported the planner's lowest
    predicted peak, and the call at that budget judged the same plan by its chunks: refused again."""
    plan_at = _planner(chunk_ratio)
    with pytest.raises(BudgetError) as refused:
        fit_in_chunks(plan_at, RESIDENT + MIB, RESIDENT, or_lowest=False)
    smallest = refused.value.smallest_budget
    plan = fit_in_chunks(plan_at, smallest, RESIDENT, or_lowest=False)
    assert plan.device_peak <= smallest


def test_a_budget_the_chunks_go_over_names_the_floors_chunked_peak():
    """Between the lowest predicted peak and its chunks, nothing fits: the budget named is the floor's
    as the allocator holds it."""
    plan_at = _planner(1.5)
    with pytest.raises(BudgetError) as refused:
        fit_in_chunks(plan_at, LOWEST + MIB, RESIDENT, or_lowest=False)
    assert refused.value.smallest_budget == feasible_budget(RESIDENT + int((LOWEST - RESIDENT) * 1.5))


def test_or_lowest_hands_back_the_floor_when_nothing_is_predicted_under_the_target():
    plan = fit_in_chunks(_planner(1.2), RESIDENT, RESIDENT, or_lowest=True)
    assert plan.predicted_peak == LOWEST
