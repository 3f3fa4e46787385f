"""The hybrid keep / swap / recompute planner."""

import pytest
import tensorflow as tf

import memsaving
from helpers import assert_close
from memsaving.candidates import cuts as candidates
from memsaving.errors import BudgetError
from memsaving.model.graph import chain_model
from memsaving.planners.hybrid import plan_hybrid
from memsaving.sim.simulate import simulate
from memsaving.sim.swap import CostModel


def _model():
    return chain_model([4000] * 30, [2e9] * 30, grad_reads="both")


@pytest.mark.parametrize("cost", [CostModel(), CostModel(flops_per_second=1e11), CostModel(bandwidth=1e12)],
                         ids=["gpu-pcie", "slow-compute", "fast-link"])
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
def test_hybrid_never_slower_than_the_better_pure_plan(cost, fraction):
    model = _model()
    plain = simulate(model, cost=cost)
    budget = int(fraction * plain.peak_bytes)
    result = plan_hybrid(model, list(range(29)), budget, cost=cost)
    assert result.best.peak <= budget
    pure = [p.seconds for p in (result.recompute_only, result.swap_only) if p is not None]
    assert pure and result.best.seconds <= min(pure) + 1e-12
    sim = simulate(model, result.best.checkpoint_ops, swapped=result.best.swapped, cost=cost)
    assert sim.peak_bytes == result.best.peak and sim.step_seconds == result.best.seconds


def test_hybrid_infeasible_budget():
    with pytest.raises(BudgetError, match="smallest feasible budget"):
        plan_hybrid(_model(), list(range(29)), 10)


def test_swap_auto_in_tensorflow():
    ws = [tf.Variable(tf.random.normal([64, 64], stddev=0.125, seed=i)) for i in range(16)]
    captured = {}

    def loss(x):
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        return tf.reduce_mean(h * h)

    @tf.function
    def step(x):
        plain = memsaving.plan(loss(x), ws, checkpoints=[])
        budget = plain.resident_bytes + int(0.4 * (plain.plain_peak - plain.resident_bytes))
        kwargs = dict(checkpoints="memory", budget=budget, swap="auto", flops_per_second=1e10,
                      swap_device="/CPU:1")
        captured["plan"] = memsaving.plan(loss(x), ws, **kwargs)
        return tf.gradients(loss(x), ws), memsaving.gradients(loss(x), ws, **kwargs)

    plain, ours = step(tf.random.normal([256, 64], seed=1))
    assert_close([g.numpy() for g in plain], [g.numpy() for g in ours])
    plan = captured["plan"]
    assert plan.mode == "hybrid" and plan.predicted_peak <= plan.budget
    assert plan.predicted_seconds is not None
    if plan.swapped:
        assert "swapped to host" in plan.table()

    @tf.function
    def no_budget(x):
        return memsaving.gradients(loss(x), ws, checkpoints="memory", swap="auto")

    with pytest.raises(ValueError, match="needs|budget="):
        no_budget(tf.ones([4, 64]))


def test_candidates_module_is_used_for_hybrid_pools():
    assert candidates.memory_candidates(_model())
