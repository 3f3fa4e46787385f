"""The planning_time allowance (memsaving.sim.allowance): searches stop when the
simulation they may spend is used up, keep the best plan found so far, and do
so at the same point on every run (work is counted, not read off a clock)."""

import pytest

from memsaving.errors import BudgetError
from memsaving.model.graph import chain_model
from memsaving.planners.budget import plan_for_budget
from memsaving.planners.modes import memory_proposal
from memsaving.sim.allowance import REPLAYED_ACTIONS_PER_SECOND, planning_allowance
from memsaving.sim.simulate import simulate

SIZES = [8, 1, 8, 8, 1, 8, 8, 1, 8, 8, 1, 8, 8, 1, 8, 8, 1, 8] * 3


def _model():
    return chain_model(SIZES)


def _budget(model):
    plain = simulate(model).peak_bytes
    lowest = memory_proposal(model).peak
    return lowest + (plain - lowest) // 3


def _one_replay() -> float:
    """Seconds of allowance one replay of the plain step costs (on a model
    that has replayed nothing: a model replays each plan once)."""
    with planning_allowance(None) as allowance:
        simulate(_model())
    return allowance.spent_seconds


def test_a_search_without_limit_counts_its_work_and_finishes():
    model = _model()
    with planning_allowance(None) as allowance:
        unlimited = plan_for_budget(model, list(range(len(SIZES))), _budget(model))
    assert allowance.spent_actions > 0 and not allowance.stopped
    assert unlimited.peak <= _budget(model)
    assert _one_replay() * REPLAYED_ACTIONS_PER_SECOND == len(simulate(_model()).timeline)


def test_a_spent_allowance_keeps_the_best_plan_found_so_far():
    """A few replays' worth of time: the search stops early, the plan still fits (the first DP
    plan is always scored) and is no better than the unlimited search's."""
    model = _model()
    budget = _budget(model)
    full = plan_for_budget(_model(), list(range(len(SIZES))), budget)
    with planning_allowance(3 * _one_replay()) as allowance:
        short = plan_for_budget(model, list(range(len(SIZES))), budget)
    assert allowance.stopped
    assert allowance.spent_seconds < 10 * _one_replay()
    assert short.peak <= budget
    assert short.recompute_cost >= full.recompute_cost
    assert simulate(_model(), short.checkpoint_ops).peak_bytes == short.peak


def test_the_same_allowance_gives_the_same_plan():
    plans = []
    for _ in range(2):
        model = _model()
        with planning_allowance(4 * _one_replay()):
            plans.append(plan_for_budget(model, list(range(len(SIZES))), _budget(model)).checkpoint_ops)
    assert plans[0] == plans[1]


def test_memory_mode_under_a_spent_allowance_scores_at_least_one_plan():
    model = _model()
    with planning_allowance(1e-9) as allowance:
        found = memory_proposal(model)
    assert allowance.stopped
    assert found.peak == simulate(_model(), found.checkpoint_ops).peak_bytes


def test_a_budget_error_after_a_stopped_search_says_planning_time_may_help():
    model = _model()
    with planning_allowance(1e-9):
        with pytest.raises(BudgetError, match="planning_time"):
            plan_for_budget(model, list(range(len(SIZES))), model.resident_bytes + 1)
    with pytest.raises(BudgetError) as unlimited:
        plan_for_budget(_model(), list(range(len(SIZES))), model.resident_bytes + 1)
    assert "planning_time" not in str(unlimited.value)


def test_the_lowest_peak_search_runs_a_dozen_simulations_on_large_graphs(monkeypatch):
    """On thousands of ops the search behind the "memory" mode scores
    LOWEST_PEAK_EVALUATIONS plans (Chen's greedy plans spread over the
    whole range of thresholds); small graphs keep a longer search."""
    from memsaving.planners import budget as planner

    scored = []
    monkeypatch.setattr(planner, "_search", _counting_search(planner, scored))
    large = chain_model([8, 1, 8, 8] * 500)
    planner.lowest_peak_plan(large, list(range(0, 2000, 3)))
    assert scored == [planner.LOWEST_PEAK_EVALUATIONS]
    scored.clear()
    small = chain_model([8, 1, 8, 8] * 50)
    planner.lowest_peak_plan(small, list(range(0, 200, 3)))
    assert scored[0] > 3 * planner.LOWEST_PEAK_EVALUATIONS


def _counting_search(planner, scored):
    """``planner._search``, recording how many plans each run scored."""
    real = planner._search

    def search(*args, **kwargs):
        found = real(*args, **kwargs)
        scored.append(len(found.evaluated))
        return found

    return search
