"""Parameters and optimizer state on the host, on the neutral model (no TensorFlow).

With parameter offloading (:mod:`memsaving.tf.offload` emits it) the
variables and the optimizer's slots live in host memory, so they leave the
device's resident bytes.  Each weight comes to the device twice per step,
as the simulator replays it here:

* a *forward copy*, made ``lb`` actions before its first forward reader
  and alive until its last forward reader;
* *backward copies*, one per group of backward readers within
  ``fuse_levels`` backward levels of the group's first (data gradients of
  products, recomputed forward ops), each made ``lb`` actions before the
  group's first reader and alive until its last;

and each weight gradient goes back to the host (where the optimizer's
update runs) right after the gradient kernel that completes it: the
gradient is on the device from that kernel to the end of its transfer.
Copies are host-to-device transfers and gradients device-to-host ones,
timed on their streams by :func:`memsaving.sim.swap.timed_replay` (a copy
also waits for the compute action before it: its trigger), so the step
time shows when the transfers, not the compute, bound the step.

A weight is a variable handle of the model (an external resource tensor)
read by ``ReadVariableOp`` ops; its value is the read's output (a view of
0 bytes, ``value_bytes`` the variable's) and the views of that output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from memsaving.model.buffers import Action, Key, memory_replay, with_reads
from memsaving.model.graph import GraphModel, gradient_sinks
from memsaving.model.schedule import Unit, backward_units, kept_set
from memsaving.model.swapping import fused_groups
from memsaving.sim.actions import step_actions
from memsaving.sim.swap import CostModel, add_swaps, backward_levels, timed_replay

READ_TYPES = frozenset({"ReadVariableOp"})
"""Ops that read a variable's value onto the device (a copy each, with offloading)."""


@dataclass(frozen=True)
class OffloadPrediction:
    """The device's peak and the step time with parameters offloaded.

    Attributes
    ----------
    peak_bytes
        predicted device peak: what stays resident on the device plus the
        most the step's buffers (activations, gradients, weight copies)
        hold at once under the cost model's timing.
    resident_bytes
        what stays resident on the device (inputs, folded gradient
        constants; the model's resident bytes without the offloaded
        variables and the optimizer state).
    offloaded_bytes
        the offloaded variables' bytes (on the host).
    slot_bytes
        the optimizer state's bytes (on the host).
    step_seconds
        predicted step time (compute and the two transfer streams).
    copied_bytes
        bytes copied to the device per step (every weight copy).
    returned_bytes
        gradient bytes copied back to the host per step.
    ordered_peak_bytes
        the peak when actions run one after another in list order
        (transfers taking no time), for comparison with ``peak_bytes``.
    """

    peak_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    slot_bytes: int
    step_seconds: float
    copied_bytes: int
    returned_bytes: int
    ordered_peak_bytes: int
    labels: List[str] = field(default_factory=list, repr=False)
    timeline: List[int] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class ResidentPrediction:
    """The same step without offloading, for comparison: the device holds
    the variables and the optimizer state for the whole step."""

    peak_bytes: int
    resident_bytes: int
    step_seconds: float


def variable_handles(model: GraphModel) -> List[int]:
    """The model's variables: external tensors read by a variable read
    (:data:`READ_TYPES`), with bytes behind them."""
    found = set()
    for op in model.ops:
        if op.type in READ_TYPES and op.inputs:
            handle = op.inputs[0]
            info = model.tensors[handle]
            if info.producer < 0 and (info.value_bytes or 0) > 0:
                found.add(handle)
    return sorted(found)


def handle_bytes(model: GraphModel, handles: Iterable[int]) -> int:
    """The bytes of the variables behind ``handles``."""
    return sum(model.tensors[h].value_bytes or 0 for h in set(handles))


def device_resident_bytes(model: GraphModel, handles: Iterable[int], slot_bytes: int = 0) -> int:
    """What stays resident on the device when the variables behind
    ``handles`` and ``slot_bytes`` of optimizer state move to the host.

    The model's resident bytes count the variables the step reads and its
    inputs, or what the device's allocator held while planning when that was
    more (then the optimizer state may be in it too: ``slot_bytes`` is taken
    off as well).  Never less than the other inputs and the folded gradient
    constants, which stay."""
    handles = set(handles)
    moved = handle_bytes(model, handles) + slot_bytes
    staying = sum(info.nbytes if info.value_bytes is None else info.value_bytes
                  for t, info in model.tensors.items() if info.producer < 0 and t not in handles)
    return max(model.resident_bytes - moved, staying + model.folded_gradient_bytes)


def weight_values(model: GraphModel, handle: int) -> Set[int]:
    """The tensors standing for ``handle``'s value on the device: outputs
    of its reads and the views of those (0-byte outputs of ops reading
    them alone)."""
    values: Set[int] = set()
    for i in model.consumers(handle):
        op = model.ops[i]
        if op.type in READ_TYPES:
            values.update(op.outputs)
    changed = True
    while changed:
        changed = False
        for t in list(values):
            for i in model.consumers(t):
                op = model.ops[i]
                for out in op.outputs:
                    info = model.tensors[out]
                    if out not in values and info.nbytes == 0 and info.value_bytes is not None and all(
                            s in values for s in op.inputs):
                        values.add(out)
                        changed = True
    return values


def add_offload(actions: Sequence[Action], model: GraphModel, handles: Iterable[int], forward_end: int,
                cost: CostModel) -> List[Action]:
    """``actions`` with the weight copies and gradient transfers of
    offloading ``handles`` (see the module docstring).  ``forward_end``:
    the number of forward compute actions at the start of ``actions`` (the
    model's ops; the seed of the gradients follows them); swap actions
    (:func:`memsaving.sim.swap.add_swaps`) may be among them."""
    compute = [i for i, a in enumerate(actions) if a.stream == "compute"]
    forward_compute = set(compute[:forward_end])
    seed = compute[forward_end]  # the seed of the gradients: the backward pass starts after it
    level = backward_levels(actions, seed)
    before: Dict[int, List[Action]] = {}
    after: Dict[int, List[Action]] = {}
    renamed: Dict[Tuple[int, Key], Key] = {}
    sinks = gradient_sinks(model)
    for h in sorted(set(handles)):
        info = model.tensors[h]
        nbytes = info.value_bytes or 0
        values = weight_values(model, h)
        keys = {("f", t) for t in values}
        readers = [i for i, a in enumerate(actions) if a.stream == "compute" and not keys.isdisjoint(a.reads)]
        early = [i for i in readers if i in forward_compute]
        late = [i for i in readers if i not in forward_compute]
        groups = ([("forward", early)] if early else []) + [
            (f"backward {k}", group) for k, group in enumerate(
                fused_groups(late, level.__getitem__, cost.fuse_levels))]
        for tag, group in groups:
            copy = ("o", h, tag)
            first = min(group)
            floor = 0 if tag == "forward" else seed + 1
            at = _actions_before(compute, first, cost.lb, floor)
            before.setdefault(at, []).append(
                Action(f"offload-in {tag} {info.name}", [], [(copy, nbytes)], float(nbytes), stream="h2d"))
            for i in group:
                for key in actions[i].reads:
                    if key in keys:
                        renamed[i, key] = copy
        for t in values | {h}:
            if t not in sinks:
                continue
            writers = [i for i, a in enumerate(actions) if any(key == ("g", t) for key, _ in a.writes)]
            if writers:
                gradient = model.tensors[t].gradient_bytes or nbytes
                after.setdefault(writers[-1], []).append(
                    Action(f"offload-out gradient {info.name}", [("g", t)], [], float(gradient), stream="d2h"))
    result: List[Action] = []
    for i, action in enumerate(actions):
        result.extend(before.get(i, ()))
        if any((i, key) in renamed for key in action.reads):
            reads = list(dict.fromkeys(renamed.get((i, key), key) for key in action.reads))
            action = with_reads(action, reads)
        result.append(action)
        result.extend(after.get(i, ()))
    return result


def _actions_before(compute: List[int], first: int, lead: int, floor: int) -> int:
    """The index of the compute action ``lead`` compute actions before
    action ``first``, not before ``floor`` (a copy is inserted there, so it
    waits for the compute action before it: its trigger)."""
    k = compute.index(first) if first in compute else len(compute)
    return max(compute[max(k - lead, 0)], floor)


def simulate_offload(
    model: GraphModel,
    checkpoint_ops: Iterable[int] = (),
    *,
    kept: Optional[Set[int]] = None,
    units: Optional[List[Unit]] = None,
    inner=None,
    swapped: Iterable[int] = (),
    handles: Optional[Iterable[int]] = None,
    slot_bytes: int = 0,
    cost: Optional[CostModel] = None,
    keep_x_gradients: bool = False,
) -> OffloadPrediction:
    """Replay the plan that keeps ``checkpoint_ops`` (or ``kept``, run as
    ``units`` when given: a plan's own units) with the variables behind
    ``handles`` (default: every variable the step reads,
    :func:`variable_handles`) and ``slot_bytes`` of optimizer state on the
    host.  ``swapped`` tensors are swapped as :func:`memsaving.sim.simulate.simulate`
    swaps them.

    Examples
    --------
    A chain of six products whose weights (4 KiB each) dwarf its
    activations (64 bytes): offloaded, the device holds a few weight
    copies at a time instead of every weight.

    >>> from memsaving.model.graph import GraphModel, OpInfo, TensorInfo
    >>> tensors, ops, h = {0: TensorInfo("x", 64, trainable=False)}, [], 0
    >>> for k in range(6):
    ...     handle, weight, out = 10 * k + 1, 10 * k + 2, 10 * k + 3
    ...     tensors[handle] = TensorInfo(f"w{k}", 0, constant=True, value_bytes=4096)
    ...     tensors[weight] = TensorInfo(f"read{k}", 0, len(ops), value_bytes=4096)
    ...     ops.append(OpInfo(f"read{k}", "ReadVariableOp", (handle,), (weight,), copyable=False))
    ...     tensors[out] = TensorInfo(f"h{k}", 64, len(ops))
    ...     ops.append(OpInfo(f"matmul{k}", "MatMul", (h, weight), (out,), grad_reads=(h, weight)))
    ...     h = out
    >>> model = GraphModel(ops, tensors, xs=[10 * k + 1 for k in range(6)], ys=[h], resident_bytes=64 + 6 * 4096)
    >>> offloaded = simulate_offload(model, cost=CostModel(lb=1))
    >>> offloaded.resident_bytes, offloaded.offloaded_bytes, offloaded.copied_bytes
    (64, 24576, 49152)
    >>> offloaded.peak_bytes < simulate_resident(model).peak_bytes
    True
    """
    cost = cost or CostModel()
    handles = variable_handles(model) if handles is None else sorted(set(handles))
    actions, pinned = _plan_actions(model, checkpoint_ops, kept, units, inner, swapped, cost, keep_x_gradients)
    actions = add_offload(actions, model, handles, len(model.ops), cost)
    seconds, timed_peak, _ = timed_replay(actions, cost, pinned)
    timeline, ordered_peak = memory_replay(actions, pinned)
    resident = device_resident_bytes(model, handles, slot_bytes)
    copied = int(sum(a.cost for a in actions if a.stream == "h2d" and a.label.startswith("offload-in")))
    returned = int(sum(a.cost for a in actions if a.stream == "d2h" and a.label.startswith("offload-out")))
    return OffloadPrediction(
        peak_bytes=resident + timed_peak, resident_bytes=resident, offloaded_bytes=handle_bytes(model, handles),
        slot_bytes=slot_bytes, step_seconds=seconds, copied_bytes=copied, returned_bytes=returned,
        ordered_peak_bytes=resident + ordered_peak, labels=[a.label for a in actions], timeline=timeline)


def simulate_resident(
    model: GraphModel,
    checkpoint_ops: Iterable[int] = (),
    *,
    kept: Optional[Set[int]] = None,
    units: Optional[List[Unit]] = None,
    inner=None,
    swapped: Iterable[int] = (),
    slot_bytes: int = 0,
    cost: Optional[CostModel] = None,
    keep_x_gradients: bool = False,
) -> ResidentPrediction:
    """The same plan as :func:`simulate_offload` with everything on the
    device: the model's resident bytes (its variables among them) plus
    ``slot_bytes`` of optimizer state, timed under the same cost model
    (each weight gradient consumed on the device by the update)."""
    cost = cost or CostModel()
    actions, pinned = _plan_actions(model, checkpoint_ops, kept, units, inner, swapped, cost, keep_x_gradients)
    seconds, peak, _ = timed_replay(actions, cost, pinned)
    resident = model.resident_bytes + slot_bytes
    return ResidentPrediction(peak_bytes=resident + peak, resident_bytes=resident, step_seconds=seconds)


def _plan_actions(model: GraphModel, checkpoint_ops: Iterable[int], kept: Optional[Set[int]],
                  units: Optional[List[Unit]], inner, swapped: Iterable[int], cost: CostModel,
                  keep_x_gradients: bool) -> Tuple[list, Set]:
    """The actions of the plan :func:`simulate_offload` and
    :func:`simulate_resident` replay (its swaps added), and the buffers
    the replay never frees (the results, when they are kept)."""
    if kept is None:
        kept = kept_set(model, checkpoint_ops)
    swapped = sorted(set(swapped))
    if units is None:
        units = backward_units(model, kept, inner, inplace=bool(swapped))
    pinned = {("g", x) for x in gradient_sinks(model)} if keep_x_gradients else set()
    actions, _ = step_actions(model, kept, units)
    if swapped:
        actions = add_swaps(actions, model, swapped, len(model.ops), cost)
    return actions, pinned
