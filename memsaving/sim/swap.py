"""Swapping tensors to host memory, on the neutral model (no TensorFlow).

A swapped tensor is copied to the host right after its producer runs
(*swap-out*), so its device buffer dies as soon as the forward pass is done
with it, and copied back (*swap-in*) a little before the backward op that
reads it.  Here the simulator's action list gets those copies inserted, and a
timed replay puts every action on one of three streams (compute, device to
host, host to device) to predict the step time and the peak memory when
transfers overlap computation.

Swap-ins are started by a *trigger*: the compute action ``lb`` actions
before the first consumer (TFLMS's lower bound on the distance; this is the
"direct order" strategy on the simulator's order).  Consumers of one tensor
within ``fuse_levels`` topological levels of the backward pass share one
swap-in, by the rule the emitter follows
(:func:`memsaving.model.swapping.fused_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AbstractSet, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from memsaving.sim.actions import step_actions
from memsaving.model.buffers import Action, consumed_at_once, donations
from memsaving.model.graph import GraphModel
from memsaving.model.parameters import parameter_ops
from memsaving.model.schedule import backward_units
from memsaving.model.swapping import SWAP_FUSE_LEVELS, SWAP_IN_LEAD, SWAP_OUT_SLACK, fused_groups, swap_out_waiters


@dataclass(frozen=True)
class CostModel:
    """Speeds used to time a plan.

    Attributes
    ----------
    flops_per_second
        sustained compute rate of the device (default
        10 TFLOP/s, a mid-range GPU).
    bandwidth
        bytes per second each way between device and host (default
        16 GB/s, PCIe 3 x16).
    lb
        a swap-in starts after the compute action ``lb`` actions before its
        first consumer.
    fuse_levels
        consumers of a swapped tensor within this many topological levels
        of their group's first one share one swap-in (None: each its own,
        as ``swap_fuse=False`` emits them).
    out_slack
        the forward ops this many steps after a swapped tensor's
        consumers wait for its swap-out (1: the consumers' consumers), so
        the device copy is freed early in the forward pass and not after it.
    """

    flops_per_second: float = 10e12
    bandwidth: float = 16e9
    lb: int = SWAP_IN_LEAD
    fuse_levels: Optional[int] = SWAP_FUSE_LEVELS
    out_slack: int = SWAP_OUT_SLACK


def swappable(model: GraphModel, actions: Sequence, forward_end: int) -> List[int]:
    """Forward tensors the backward part reads straight from the forward pass
    (kept tensors: checkpoints, inputs of ops never recomputed): the ones a
    swap can take off the device between the two passes.

    Outputs of parameter ops (:func:`memsaving.model.parameters.parameter_ops`)
    stay resident anyway; outputs of ops that are not forward (an input
    scaled or filled inside the step) are not offered: the emitter copies
    forward tensors only.  Nor are tensors that are not arrays of numbers
    (:attr:`~memsaving.model.graph.TensorInfo.numeric`: a loop's
    TensorLists, which a loop's gradient reads once ``tf.gradients`` has
    built it): no copy kernel takes them.  This is the one rule every swap
    plan (``swap=True``, ``"auto"``, a list) draws its tensors from."""
    parameters = parameter_ops(model)  # weights and their reshapes stay resident anyway
    found: Set[int] = set()
    for action in actions[forward_end + 1:]:
        for key in action.reads:
            if key[0] != "f":
                continue
            info = model.tensors[key[1]]
            if info.producer < 0 or info.producer in parameters or not model.ops[info.producer].forward:
                continue
            if info.trainable and info.numeric and info.nbytes > 0:
                found.add(key[1])
    return sorted(found)


def swap_candidates(model: GraphModel, kept: Set[int], inner=None) -> List[int]:
    """The tensors a plan keeping ``kept`` could swap: those its backward
    part reads from the forward pass (units differentiated in place)."""
    actions, _ = step_actions(model, kept, backward_units(model, kept, inner, inplace=True))
    return swappable(model, actions, len(model.ops))


def add_swaps(actions: Sequence, model: GraphModel, swapped: Iterable[int], forward_end: int,
              cost: CostModel) -> list:
    """The action list with a swap-out after each swapped tensor's producer
    and swap-ins before its backward consumers (see the module docstring)."""
    swapped = set(swapped)
    after: Dict[int, list] = {}
    before: Dict[int, list] = {}
    renamed: Dict[Tuple[int, int], Tuple] = {}  # (action index, tensor) -> key it reads instead
    waits: Dict[int, list] = {}  # forward action index -> swap-outs it waits for
    planned = []  # (first reader, tensor, group index, group)
    level = backward_levels(actions, forward_end)
    for t in sorted(swapped):
        info = model.tensors[t]
        readers = [i for i in range(forward_end + 1, len(actions)) if ("f", t) in actions[i].reads]
        if not readers:
            continue
        after.setdefault(info.producer, []).append(
            Action(f"swap-out {info.name}", [("f", t)], [(("h", t), 0)], float(info.nbytes), stream="d2h"))
        for waiter in _forward_waiters(model, t, cost.out_slack):
            waits.setdefault(waiter, []).append(("h", t))
        groups = sorted(sorted(group) for group in fused_groups(readers, level.__getitem__, cost.fuse_levels))
        for k, group in enumerate(groups):
            planned.append((group[0], t, k, group))
            for i in group:
                renamed[i, t] = ("s", t, k)
    # a swap-in starts lb actions before its first reader, and not before
    # the readers of the swap-in before it that come earlier (the emitter
    # makes it wait for them: memsaving.tf.swap_rewrite)
    planned.sort(key=lambda item: item[0])
    previous: List[int] = []
    for first, t, k, group in planned:
        info = model.tensors[t]
        at = max(first - cost.lb, forward_end + 1)
        earlier = [i for i in previous if i < first]
        if earlier:
            at = max(at, max(earlier) + 1)
        before.setdefault(at, []).append(
            Action(f"swap-in {info.name}", [("h", t)], [(("s", t, k), info.nbytes)], float(info.nbytes),
                   stream="h2d"))
        previous = group
    result: List[Action] = []
    for i, action in enumerate(actions):
        result.extend(before.get(i, ()))
        if i in waits or any((i, key[1]) in renamed for key in action.reads if key[0] == "f"):
            reads = [renamed.get((i, key[1]), key) if key[0] == "f" else key for key in action.reads]
            action = replace(action, reads=reads + waits.get(i, []))
        result.append(action)
        result.extend(after.get(i, ()))
    return result


def backward_levels(actions: Sequence[Action], forward_end: int) -> Dict[int, int]:
    """Topological level of each backward action (after ``forward_end``):
    0 for those reading nothing another backward action writes, else one
    more than the highest such writer, as the emitter numbers backward ops."""
    writer: Dict = {}
    level: Dict[int, int] = {}
    for i in range(forward_end + 1, len(actions)):
        level[i] = 1 + max((level[writer[key]] for key in actions[i].reads if key in writer), default=-1)
        for key, _ in actions[i].writes:
            writer[key] = i
    return level


def _forward_waiters(model: GraphModel, tensor: int, slack: int) -> List[int]:
    """Forward ops ``slack`` forward steps downstream of ``tensor``'s forward
    readers (op indices; :func:`memsaving.model.swapping.swap_out_waiters`)."""

    def forward_readers(i: int) -> List[int]:
        return [c for t in model.ops[i].outputs for c in model.consumers(t) if model.ops[c].forward]

    first = [c for c in model.consumers(tensor) if model.ops[c].forward]
    return sorted(swap_out_waiters(first, forward_readers, slack))


def timed_replay(actions: Sequence, cost: CostModel,
                 pinned: AbstractSet = frozenset()) -> Tuple[float, int, List[float]]:
    """``(step seconds, peak bytes, end time of each action)`` with three streams.

    Compute actions run one after the other in list order (cost in FLOPs);
    transfers run on their own stream in list order (cost in bytes), each
    once its inputs exist; a swap-in also waits for the compute action
    before it in the list (its trigger).  A compute action with measured
    ``seconds`` takes that long instead.  A buffer is allocated when its
    writer starts and freed when its last reader ends (or handed to an
    in-place write: :func:`memsaving.model.buffers.donations`); an action's
    ``temp`` is in use from its start to its end.
    """
    ready: Dict = {}
    free_at = {"compute": 0.0, "d2h": 0.0, "h2d": 0.0}
    last_compute_end = 0.0
    starts, ends = [], []
    for action in actions:
        after = max((ready.get(key, 0.0) for key in action.reads), default=0.0)
        stream = action.stream
        if stream == "compute":
            # measured seconds when the op was profiled, else from the FLOP estimate
            duration = action.seconds if action.seconds is not None else action.cost / cost.flops_per_second
        else:
            duration = action.cost / cost.bandwidth
            if stream == "h2d":
                after = max(after, last_compute_end)
        start = max(free_at[stream], after)
        end = start + duration
        free_at[stream] = end
        if stream == "compute":
            last_compute_end = end
        for key, _ in action.writes:
            ready[key] = end
        starts.append(start)
        ends.append(end)
    last_read_end: Dict = {}
    for action, end in zip(actions, ends):
        for key in action.reads:
            last_read_end[key] = max(last_read_end.get(key, 0.0), end)
    last_reader: Dict = {}
    for i, action in enumerate(actions):
        for key in action.reads:
            last_reader[key] = i
    # a write that takes over a dying input's buffer allocates nothing, and
    # that buffer is freed with the write's instead
    given = donations(actions, last_reader, pinned, last_read_end, ends)
    donors = set(given.values())
    # at equal times, an action's allocations come after the frees of the
    # actions before it and before its own frees, as in the order replay
    events = []
    for i, (action, start, end) in enumerate(zip(actions, starts, ends)):
        if action.temp > 0:  # work buffers: after the action's allocations, freed before its reads are
            events += [(start, i + 0.1, action.temp), (end, i + 0.4, -action.temp)]
        for key, nbytes in action.writes:
            if nbytes <= 0:
                continue
            if consumed_at_once(key, action, i, last_reader, pinned):
                # after the frees before the action, before its own allocations
                events += [(start, i - 0.4, nbytes), (start, i - 0.3, -nbytes)]
                continue
            if (i, key) not in given:
                events.append((start, i, nbytes))
            if key not in pinned and key not in donors:
                reader = max(last_reader.get(key, i), i)
                events.append((max(last_read_end.get(key, end), end), reader + 0.5, -nbytes))
    events.sort()
    peak = in_use = 0
    for _, _, delta in events:
        in_use += delta
        peak = max(peak, in_use)
    return max(ends, default=0.0), peak, ends
