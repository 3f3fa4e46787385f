"""Parameter offloading on the neutral model: copies and their lifetimes,
gradients going back, resident bytes, and the step time on three streams."""

import pytest

from chains import dense_chain
from memsaving.model.schedule import backward_units, kept_set
from memsaving.sim.actions import step_actions
from memsaving.sim.offload import (add_offload, device_resident_bytes, simulate_offload, simulate_resident,
                                   variable_handles, weight_values)
from memsaving.sim.simulate import simulate
from memsaving.sim.swap import CostModel

WEIGHT = 4096
ACTIVATION = 64


def _dense_chain(layers=8, weight=WEIGHT, activation=ACTIVATION, flops=1e6):
    return dense_chain(layers, weight, activation, flops)


def _plain_actions(model, checkpoints=()):
    kept = kept_set(model, checkpoints)
    return step_actions(model, kept, backward_units(model, kept))[0]


def test_variables_are_the_handles_read_and_leave_the_resident_bytes():
    model = _dense_chain(layers=3)
    assert variable_handles(model) == [1, 11, 21]
    assert weight_values(model, 11) == {12}
    assert device_resident_bytes(model, [1, 11, 21]) == ACTIVATION
    assert device_resident_bytes(model, [1]) == ACTIVATION + 2 * WEIGHT
    # optimizer state counted in the resident bytes (an allocator that held it) goes too, never the input
    assert device_resident_bytes(model, [1, 11, 21], slot_bytes=10 ** 6) == ACTIVATION


def test_each_weight_gets_a_forward_copy_before_its_reader_and_backward_copies_after_the_seed():
    model = _dense_chain(layers=6)
    lead = 2
    actions = add_offload(_plain_actions(model), model, variable_handles(model), len(model.ops), CostModel(lb=lead))
    labels = [a.label for a in actions]
    compute = [i for i, a in enumerate(actions) if a.stream == "compute"]
    seed = labels.index("seed gradients")
    for k in range(6):
        copy = labels.index(f"offload-in forward w{k}")
        reader = labels.index(f"forward matmul{k}")
        assert actions[reader].reads.count(("o", 10 * k + 1, "forward")) == 1
        between = [i for i in compute if copy < i < reader]
        assert len(between) == min(lead, len([i for i in compute if i < reader])), "lb compute actions ahead"
        backward = labels.index(f"offload-in backward 0 w{k}")
        gradient = labels.index(f"backward matmul{k}")
        assert seed < backward < gradient
        assert ("o", 10 * k + 1, "backward 0") in actions[gradient].reads
        assert ("f", 10 * k + 2) not in actions[gradient].reads, "no reader keeps the host value"
        returned = labels.index(f"offload-out gradient w{k}")
        assert returned == gradient + 1 or labels[gradient + 1].startswith("offload-in"), \
            "the gradient goes back right after the kernel that makes it"
        assert actions[returned].stream == "d2h" and actions[returned].reads == [("g", 10 * k + 2)]


def test_copies_live_from_their_transfer_to_their_last_reader():
    """In list order (transfers taking no time), the forward copy of a
    weight adds its bytes at the copy and drops them after the matmul."""
    model = _dense_chain(layers=4)
    sim = simulate_offload(model, cost=CostModel(lb=1))
    timeline, labels = sim.timeline, sim.labels
    copy = labels.index("offload-in forward w2")
    reader = labels.index("forward matmul2")
    assert timeline[copy] - timeline[copy - 1] == WEIGHT
    assert timeline[reader] - timeline[reader - 1] == ACTIVATION - WEIGHT, "the copy dies with its reader"
    returned = labels.index("offload-out gradient w2")
    assert timeline[returned] - timeline[returned - 1] == -WEIGHT, "the gradient is freed once sent back"


def test_a_recomputed_segment_reads_its_weights_twice_and_far_readers_get_copies_of_their_own():
    model = _dense_chain(layers=8)
    kept = kept_set(model, [model.op_index()["tanh3"]])
    units = backward_units(model, kept)
    actions, _ = step_actions(model, kept, units)
    fused = add_offload(actions, model, variable_handles(model), len(model.ops), CostModel(fuse_levels=1))
    labels = [a.label for a in fused]
    # the segment before tanh3 recomputes matmul0..matmul2 and differentiates them later
    assert any(label.startswith("recompute matmul0") for label in labels)
    assert sum(label.startswith("offload-in backward") and label.endswith(" w0") for label in labels) == 2
    together = add_offload(actions, model, variable_handles(model), len(model.ops), CostModel(fuse_levels=100))
    assert sum(a.label.startswith("offload-in backward") and a.label.endswith(" w0") for a in together) == 1


def test_offloading_lowers_the_peak_of_a_parameter_heavy_step():
    model = _dense_chain(layers=8)
    slots = 2 * 8 * WEIGHT
    resident = simulate_resident(model, slot_bytes=slots)
    offloaded = simulate_offload(model, slot_bytes=slots, cost=CostModel(lb=1))
    assert resident.peak_bytes >= model.resident_bytes + slots
    assert offloaded.resident_bytes == ACTIVATION and offloaded.offloaded_bytes == 8 * WEIGHT
    assert offloaded.peak_bytes < 0.5 * resident.peak_bytes
    assert offloaded.copied_bytes == 2 * 8 * WEIGHT and offloaded.returned_bytes == 8 * WEIGHT
    # without offloading, the same replay as the simulator's
    assert resident.peak_bytes == simulate(model, cost=CostModel()).peak_bytes + slots


def test_step_time_is_bound_by_transfers_when_they_are_slow():
    model = _dense_chain(layers=8, flops=1e9)
    fast = simulate_offload(model, cost=CostModel(bandwidth=1e15))
    slow = simulate_offload(model, cost=CostModel(bandwidth=1e6))
    plain = simulate_resident(model, cost=CostModel())
    assert fast.step_seconds == pytest.approx(plain.step_seconds, rel=0.01)
    # copies in run one after another on the host-to-device stream
    assert slow.step_seconds >= slow.copied_bytes / 1e6
    assert slow.step_seconds > 10 * plain.step_seconds


def test_offloading_and_swapping_together():
    model = _dense_chain(layers=6)
    everything = [i for i, op in enumerate(model.ops) if op.type == "Tanh"]
    swapped = [model.ops[i].outputs[0] for i in everything[:-1]]
    both = simulate_offload(model, everything, swapped=swapped, cost=CostModel(lb=1))
    labels = both.labels
    assert any(label.startswith("swap-out") for label in labels)
    assert sum(label.startswith("offload-in forward") for label in labels) == 6
    alone = simulate_offload(model, everything, cost=CostModel(lb=1))
    assert both.peak_bytes <= alone.peak_bytes
