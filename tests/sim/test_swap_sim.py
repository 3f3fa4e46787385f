"""Swapping on the neutral model: inserted copies, three-stream timing, peaks."""

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model
from memsaving.model.schedule import backward_units, kept_set
from memsaving.sim.actions import step_actions
from memsaving.model.buffers import memory_replay
from memsaving.sim.simulate import simulate
from memsaving.sim.swap import CostModel, swappable, timed_replay


def _model(n=40):
    return chain_model([1000] * n, [1e9] * n, grad_reads="both")


def _swappable(model, checkpoints):
    kept = kept_set(model, checkpoints)
    actions, _ = step_actions(model, kept, backward_units(model, kept, inplace=True))
    return swappable(model, actions, len(model.ops))


def test_timed_replay_without_swaps_matches_the_order_replay():
    model = _model()
    kept = kept_set(model, [9, 19, 29])
    actions, _ = step_actions(model, kept, backward_units(model, kept))
    seconds, peak, _ = timed_replay(actions, CostModel())
    assert peak == memory_replay(actions, set())[1]
    assert abs(seconds - sum(a.cost for a in actions) / CostModel().flops_per_second) < 1e-12


def test_swap_out_follows_the_producer_and_swap_in_precedes_the_consumer():
    model = _model(12)
    sim = simulate(model, [5], swapped=[6], cost=CostModel(lb=2))
    labels = sim.labels
    out = labels.index("swap-out t6")
    assert labels[out - 1] == "forward op6"
    swap_in = labels.index("swap-in t6")
    first_reader = next(i for i, label in enumerate(labels) if i > swap_in and not label.startswith("swap"))
    assert swap_in > labels.index("seed gradients")
    compute_between = [label for label in labels[swap_in:] if not label.startswith("swap")]
    assert compute_between and first_reader > swap_in


def test_swapping_checkpoints_lowers_the_peak_and_costs_time_only_when_transfers_are_slow():
    model = _model()
    checkpoints = [9, 19, 29]
    alone = simulate(model, checkpoints, cost=CostModel())
    fast = simulate(model, checkpoints, swapped=_swappable(model, checkpoints), cost=CostModel())
    slow = simulate(model, checkpoints, swapped=_swappable(model, checkpoints), cost=CostModel(bandwidth=1e4))
    assert fast.peak_bytes < alone.peak_bytes
    assert fast.step_seconds <= alone.step_seconds * 1.01, "fast transfers hide behind compute"
    assert slow.step_seconds > 10 * alone.step_seconds
    assert fast.swapped_bytes > 0


def test_swap_only_recomputes_nothing_and_beats_plain_memory():
    model = _model()
    everything = list(range(39))
    plain = simulate(model, cost=CostModel())
    swap_only = simulate(model, everything, swapped=_swappable(model, everything), cost=CostModel())
    assert swap_only.recompute_cost == 0
    assert swap_only.peak_bytes < 0.5 * plain.peak_bytes
    assert swap_only.step_seconds <= plain.step_seconds * 1.01


def _skip_model(depth=30):
    """x -> op0 -> chain -> last, where last multiplies by op0's output: op0's
    output is read by the backward of the last op and of op1, far apart."""
    tensors = {0: TensorInfo("x", 100)}
    ops = []
    prev = 0
    for i in range(depth):
        tensors[i + 1] = TensorInfo(f"t{i + 1}", 1000, i)
        ops.append(OpInfo(f"op{i}", "MatMul", (prev,), (i + 1,), grad_reads=(prev,), cost=1e9))
        prev = i + 1
    tensors[depth + 1] = TensorInfo("out", 1000, depth)
    ops.append(OpInfo("last", "Mul", (prev, 1), (depth + 1,), grad_reads=(prev, 1), cost=1e6))
    return GraphModel(ops, tensors, xs=[0], ys=[depth + 1])


def test_far_apart_consumers_get_their_own_swap_in():
    model = _skip_model()
    everything = list(range(len(model.ops) - 1))
    fused = simulate(model, everything, swapped=[1], cost=CostModel(fuse_levels=1000))
    apart = simulate(model, everything, swapped=[1], cost=CostModel(fuse_levels=5))
    assert fused.labels.count("swap-in t1") == 1
    assert apart.labels.count("swap-in t1") == 2
    assert apart.peak_bytes <= fused.peak_bytes
