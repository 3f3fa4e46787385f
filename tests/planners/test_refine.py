"""Per-op keep/recompute refinement of plans (memsaving.planners.refine), without TensorFlow."""

import random
from dataclasses import replace

from memsaving.planners.budget import plan_for_budget, select_for_budget
from memsaving.errors import BudgetError
from memsaving.model.graph import GraphModel, chain_model
from memsaving.planners.refine import STEEPEST_MAX_CANDIDATES, drop_from_keep_all, keep_more, recomputed_ops, refined_plans
from memsaving.sim.simulate import simulate


def _chains(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(6, 14)
        sizes = [rng.choice([100, 200, 400, 800]) for _ in range(n)]
        costs = [rng.choice([1, 2, 10, 40]) for _ in range(n)]
        yield chain_model(sizes, costs, grad_reads=rng.choice(["input", "output", "both"]))


def test_keep_more_fits_and_never_recomputes_more():
    for model in _chains(8, seed=1):
        plain = simulate(model).peak_bytes
        budget = int(0.75 * plain)
        try:
            start = select_for_budget(model, list(range(len(model.ops) - 1)), budget).checkpoint_ops
        except BudgetError:
            continue
        before = simulate(model, start)
        ops, sim = keep_more(model, start, budget)
        assert set(start) <= set(ops)
        assert sim.peak_bytes <= budget
        assert sim.recompute_cost <= before.recompute_cost
        assert sim.peak_bytes == simulate(model, ops).peak_bytes


def _with_views(model, views):
    """``model`` with the outputs of ``views`` made views (no bytes of their own)."""
    tensors = dict(model.tensors)
    ops = list(model.ops)
    for i in views:
        t = ops[i].outputs[0]
        tensors[t] = replace(tensors[t], nbytes=0, value_bytes=tensors[t].nbytes)
        ops[i] = replace(ops[i], type="Reshape", grad_reads=())
    return GraphModel(ops, tensors, xs=model.xs, ys=model.ys)


def test_keep_more_spends_no_simulation_on_views():
    # the views cost more per byte than anything (a cost over zero bytes):
    # tried first, they would use up the one simulation allowed
    model = _with_views(chain_model([400] * 10, [1, 1, 50, 1, 1, 50, 1, 5, 1, 1]), views=(2, 5))
    start = [9]
    before = simulate(model, start)
    ops, sim = keep_more(model, start, simulate(model).peak_bytes, max_evaluations=1)
    added = set(ops) - set(start)
    assert added and not added & {2, 5}
    assert sim.recompute_cost < before.recompute_cost


def test_keep_more_keeps_long_runs_in_few_simulations():
    # every op fits: runs of 1, 2, 4, 8 ops keep all 14 recomputed ones in 4 simulations
    model = chain_model([100] * 16, [float(16 - i) for i in range(16)])
    start = [15]
    assert len(recomputed_ops(model, start)) >= 14
    ops, sim = keep_more(model, start, simulate(model).peak_bytes, max_evaluations=4)
    assert sim.recompute_cost == 0
    assert recomputed_ops(model, ops) == set()


def test_keeping_every_op_recomputes_nothing():
    model = chain_model([300, 200, 500, 100, 400], [5, 1, 5, 1, 5], grad_reads="input")
    everything = list(range(len(model.ops)))
    assert recomputed_ops(model, everything) == set()
    sim = simulate(model, everything)
    assert sim.recompute_cost == 0
    assert sim.peak_bytes == simulate(model).peak_bytes


def test_drop_from_keep_all_recomputes_cheap_ops_first():
    # big cheap tensors (elementwise-like) between small expensive ones
    # (matmul-like): fitting the budget should recompute the cheap ones only
    sizes = [100, 800, 100, 800, 100, 800, 100]
    costs = [50, 1, 50, 1, 50, 1, 50]
    model = chain_model(sizes, costs, grad_reads="input")
    plain = simulate(model).peak_bytes
    found = drop_from_keep_all(model, int(0.8 * plain))
    assert found is not None
    ops, sim = found
    assert sim.peak_bytes <= 0.8 * plain
    dropped = set(range(len(model.ops))) - set(ops)
    assert dropped and all(costs[i] == 1 for i in dropped)


def test_a_plan_that_stops_keeping_ops_lowers_the_peak_by_their_bytes_at_most():
    # what drop_from_keep_all's early refusal relies on
    # (outputs and memory saved for the gradient, as a loop's intermediates)
    rng = random.Random(3)
    for model in _chains(12, seed=3):
        ops = [replace(op, saved_bytes=rng.choice([0, 0, 300])) for op in model.ops]
        model = GraphModel(ops, dict(model.tensors), xs=model.xs, ys=model.ys)
        everything = list(range(len(model.ops)))
        peak = simulate(model, everything).peak_bytes
        for _ in range(6):
            dropped = set(rng.sample(everything, rng.randint(1, len(everything))))
            freed = sum(model.tensors[t].nbytes for i in dropped for t in model.ops[i].outputs)
            freed += sum(model.ops[i].saved_bytes for i in dropped)
            assert simulate(model, sorted(set(everything) - dropped)).peak_bytes >= peak - freed


def test_drop_from_keep_all_refuses_a_budget_out_of_its_reach_without_trying():
    model = chain_model([100] * (STEEPEST_MAX_CANDIDATES + 30), grad_reads="input")
    keep_all = simulate(model, list(range(len(model.ops)))).peak_bytes
    # five trials can stop keeping 500 bytes at most
    assert drop_from_keep_all(model, keep_all - 501, max_evaluations=5) is None
    assert len(model.derived("simulations", dict)) == 1  # keeping everything, nothing else
    assert drop_from_keep_all(model, keep_all - 200, max_evaluations=5) is not None


def test_refined_plans_skip_the_one_pass_descent_only_when_told():
    # over STEEPEST_MAX_CANDIDATES ops the descent is one pass in a fixed order:
    # descend=False (no plan of cuts fits) leaves it out, with no simulation
    large = chain_model([100] * (STEEPEST_MAX_CANDIDATES + 30), grad_reads="input")
    budget = int(0.97 * simulate(large).peak_bytes)
    assert refined_plans(large, [], budget)
    large = chain_model([100] * (STEEPEST_MAX_CANDIDATES + 30), grad_reads="input")
    assert refined_plans(large, [], budget, descend=False) == []
    assert len(large.derived("simulations", dict)) == 0
    # the steepest descent of small graphs runs either way
    small = chain_model([100] * 10, grad_reads="input")
    assert refined_plans(small, [], int(0.9 * simulate(small).peak_bytes), descend=False)


def test_per_op_refinement_never_makes_budget_plans_worse():
    for model in _chains(10, seed=2):
        plain = simulate(model).peak_bytes
        candidates = list(range(len(model.ops) - 1))
        for fraction in (0.5, 0.7, 0.9):
            budget = int(fraction * plain)
            try:
                coarse = plan_for_budget(model, candidates, budget, per_op=False)
            except BudgetError:
                coarse = None
            try:
                fine = plan_for_budget(model, candidates, budget)
            except BudgetError:
                assert coarse is None, "refinement lost a feasible plan"
                continue
            assert fine.peak <= budget
            if coarse is not None:
                assert fine.recompute_cost <= coarse.recompute_cost + 1e-9
