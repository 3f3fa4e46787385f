"""Plans remembered per graph model and arguments (memsaving.planners.cache):
equal models share a key, any difference the planner reads gives another, a
remembered plan comes back as a marked copy, a remembered BudgetError is
raised again, and the oldest plans are forgotten first."""

import gc
import weakref
from dataclasses import replace

import pytest

from memsaving.errors import BudgetError
from memsaving.model.graph import ProfileSummary, chain_model
from memsaving.planners import cache
from memsaving.planners.modes import memory_proposal
from memsaving.planners.planning import make_plan

SIZES = [8, 1, 8, 8, 1, 8, 8, 1, 8]


@pytest.fixture(autouse=True)
def empty_cache():
    cache.clear_plan_cache()
    yield
    cache.clear_plan_cache()


def _plan(model):
    return make_plan(model, memory_proposal(model).checkpoint_ops, "memory")


def test_the_key_follows_everything_the_planner_reads():
    model = chain_model(SIZES)
    assert cache.model_key(model) == cache.model_key(chain_model(SIZES))
    bigger_op = replace(model.ops[3], temp_bytes=64)
    changed = [
        chain_model(SIZES[:-1] + [9]),  # a tensor's size
        replace(model, ops=model.ops[:3] + [bigger_op] + model.ops[4:]),  # a kernel's work buffer
        replace(model, ready_gradients_early=True),  # the executor's threads
    ]
    for other in changed:
        assert cache.model_key(other) != cache.model_key(model)
    # how the profiles were obtained is not part of it (a retrace reads them from the
    # cache), nor is the memory in use before the step (see the next tests)
    assert cache.model_key(replace(model, profile=ProfileSummary(mode="cached", cached=3))) == cache.model_key(model)
    assert cache.model_key(replace(model, resident_bytes=100)) == cache.model_key(model)


def test_a_remembered_plan_comes_back_as_a_marked_copy_with_the_new_profiling():
    model = chain_model(SIZES)
    plan = _plan(model)
    key = (cache.model_key(model), "memory")
    assert cache.remembered(key, model) is None
    cache.remember(key, model, plan)
    retraced = replace(chain_model(SIZES), profile=ProfileSummary(mode="cached", cached=5, seconds=0.25))
    again = cache.remembered((cache.model_key(retraced), "memory"), retraced)
    assert again is not plan and again.reused and not plan.reused
    assert (again.kept_ops, again.steps, again.predicted_peak) == (plan.kept_ops, plan.steps, plan.predicted_peak)
    assert (again.profile_mode, again.cached_signatures, again.profile_seconds) == ("cached", 5, 0.25)
    assert "reused: planned earlier" in again.table() and "reused" not in plan.table()
    assert cache.remembered((cache.model_key(model), "speed"), model) is None  # other arguments


def test_a_remembered_budget_error_is_raised_again():
    model = chain_model(SIZES)
    key = (cache.model_key(model), "memory", 10)
    cache.remember(key, model, BudgetError.carrying("no checkpoint plan fits", 1024))
    with pytest.raises(BudgetError, match="no checkpoint plan fits") as raised:
        cache.remembered(key, model)
    assert raised.value.smallest_budget == 1024
    # with other memory in use before the step, a plan may fit: plan again
    assert cache.remembered(key, replace(model, resident_bytes=model.resident_bytes - 8)) is None


def test_a_remembered_budget_error_holds_none_of_the_frames_it_was_raised_through():
    """A raised error's traceback holds the frames it passed through, and
    through them their callers' (a traced step, and once it ran, its
    results): kept with the error, they stayed in use."""
    model = chain_model(SIZES)
    key = (cache.model_key(model), "memory", 10)

    class HeldByTheCaller:
        pass

    def fails():
        raise BudgetError.carrying("no checkpoint plan fits", 1024)

    def remember_the_failure():
        held = HeldByTheCaller()
        try:
            fails()
        except BudgetError as error:
            cache.remember(key, model, error)
        return weakref.ref(held)

    held = remember_the_failure()
    gc.collect()
    assert held() is None
    with pytest.raises(BudgetError) as raised:
        cache.remembered(key, model)
    assert raised.value.smallest_budget == 1024


def test_the_oldest_plan_is_forgotten_first():
    model = chain_model(SIZES)
    plan = _plan(model)
    for k in range(cache.REMEMBERED_PLANS + 1):
        cache.remember(("key", k), model, plan)
    assert cache.remembered(("key", 0), model) is None
    assert cache.remembered(("key", 1), model) is not None
    cache.clear_plan_cache()
    assert cache.remembered(("key", 1), model) is None


def test_more_memory_in_use_moves_the_figures_and_a_budget_plan_must_still_fit():
    model = chain_model(SIZES)
    lowest = memory_proposal(model)
    plain = make_plan(model, [], "list").plain_peak
    budget = lowest.peak + (plain - lowest.peak) // 2
    plan = make_plan(model, lowest.checkpoint_ops, "budget", budget=budget)
    cache.remember("key", model, plan)
    room = budget - plan.predicted_peak
    moved = cache.remembered("key", replace(model, resident_bytes=model.resident_bytes + room))
    assert moved.predicted_peak == budget and moved.plain_peak == plan.plain_peak + room
    assert moved.resident_bytes == plan.resident_bytes + room
    assert moved.simulation.peak_bytes == plan.simulation.peak_bytes + room
    assert moved.steps == plan.steps
    assert cache.remembered("key", replace(model, resident_bytes=model.resident_bytes + room + 1)) is None
