"""The executor model: the order plain tf.gradients runs in with several threads (no TensorFlow)."""

import random

import pytest

from memsaving.sim.executor import dependencies, durations, executor_order, unpinned_orders
from memsaving.model.graph import GraphModel, OpInfo, TensorInfo
from memsaving.model.buffers import Action, memory_replay
from memsaving.sim.simulate import simulate


def _random_actions(rng: random.Random, n: int):
    """A random DAG of actions, each reading some earlier outputs."""
    actions = []
    for i in range(n):
        reads = [("k", j) for j in rng.sample(range(i), min(i, rng.randint(0, 3)))]
        actions.append(Action(f"a{i}", reads, [(("k", i), rng.randint(1, 100))], cost=rng.choice([0, 1, 5, 20])))
    return actions


@pytest.mark.parametrize("seed", range(20))
def test_every_order_is_a_topological_order_of_all_actions(seed):
    rng = random.Random(seed)
    actions = _random_actions(rng, rng.randint(1, 60))
    preds = dependencies(actions)
    for threads in (1, 2, 3):
        order = executor_order(actions, threads, seed)
        assert sorted(order) == list(range(len(actions)))
        position = {i: k for k, i in enumerate(order)}
        assert all(position[p] < position[i] for i, ps in enumerate(preds) for p in ps)


def test_the_same_seed_gives_the_same_order():
    actions = _random_actions(random.Random(7), 40)
    assert executor_order(actions, seed=3) == executor_order(actions, seed=3)
    assert len(unpinned_orders(actions, count=4)) == 4


def _towers(depth: int):
    """Two chains; each link also has a side op reading the link's output and
    the previous one (a weight gradient reads the incoming gradient and the
    activation)."""
    forward = [(("f", tower, k), 10) for tower in "ab" for k in range(depth)]
    actions = [Action("forward", [], forward, cost=1),
               Action("split", [("f", "a", 0)], [(("g", "a", depth), 10), (("g", "b", depth), 10)], cost=1)]
    for k in reversed(range(depth)):
        for tower in "ab":
            incoming = ("g", tower, k + 1)
            actions.append(Action(f"dx {tower}{k}", [incoming], [(("g", tower, k), 10)], cost=1))
            actions.append(Action(f"dW {tower}{k}", [incoming, ("f", tower, k)], [], cost=1))
    return actions


def test_two_busy_threads_leave_side_ops_waiting_and_the_peak_rises():
    actions = _towers(12)
    written = memory_replay(actions, set())[1]
    peaks = [memory_replay([actions[i] for i in order], set())[1] for order in unpinned_orders(actions, 8)]
    one_thread = [memory_replay([actions[i] for i in executor_order(actions, 1, s)], set())[1] for s in range(8)]
    assert max(peaks) > written  # some edge orders run a chain ahead of its side ops
    assert max(one_thread) > written


def test_durations_scale_costs_by_the_measured_rate():
    actions = [Action("a", [], [], cost=10, seconds=0.5), Action("b", [], [], cost=4)]
    assert durations(actions) == [0.5, pytest.approx(0.2)]


def test_only_a_parallel_model_is_reordered():
    tensors = [TensorInfo("x", 4, -1), TensorInfo("y", 4, 0, trainable=True)]
    ops = [OpInfo("op", "Square", [0], [1], cost=1.0)]
    serial = GraphModel(ops, tensors, [0], [1], 0)
    parallel = GraphModel(ops, tensors, [0], [1], 0, ready_gradients_early=True)
    for model in (serial, parallel):
        assert simulate(model, unpinned=True).peak_bytes == simulate(model).peak_bytes


def test_module_examples():
    import doctest

    from memsaving.sim import executor as module
    results = doctest.testmod(module)
    assert results.attempted > 0 and results.failed == 0
