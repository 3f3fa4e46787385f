"""Emitting swaps in the TensorFlow graph (after the backward pass is built).

For each swapped forward tensor ``t``: one *swap-out*, a copy on the host
device made right after ``t``'s producer (it only reads ``t``), and one or
more *swap-ins*, copies back onto ``t``'s device that feed the backward ops
that read ``t`` instead of ``t`` itself.  Each swap-in carries a control
dependency on a *trigger*, a backward op that runs a little before the
swap-in's first consumer, so the copy is neither made too early (holding
memory) nor too late (stalling compute).  Two trigger strategies, after
TFLMS:

* ``"direct"``: number the backward ops by topological level (longest path
  from the start of the backward pass) and trigger on an op ``lb`` levels
  before the consumer (searching up to ``ub`` levels back);
* ``"chain"``: walk back from the consumer along the ops it depends on
  (the chain of the chain rule) ``lb`` steps and trigger on that op.

Consumers of one tensor within ``fuse_levels`` levels of each other share
one swap-in (fusing); without fusing every consumer gets its own.

The copies are ``Snapshot`` ops: Grappler's dependency optimizer deletes
``Identity`` pairs, which would undo the swap.  A *backend* makes the copies;
the default places Snapshots on devices, and tests use one that moves the
bytes out of TensorFlow's allocator to measure what swapping saves on a
machine without a GPU.

A swap-in on the default backend is two Snapshots (:func:`gated_copy`): a
*gate* on the host, which carries the trigger, then the copy on the device.
The graph partitioner turns an edge between devices into a send and a
receive, and a receive has no inputs: it runs as soon as its send does.  A
device Snapshot reading the swap-out directly would therefore receive the
tensor right after the swap-out, in the forward pass, whatever its trigger
(the trigger only delays the Snapshot, not the transfer), and the tensor
would be back on the device for the whole backward pass.  Waiting on the
host, before the send, is what delays the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import kernels
from tensorflow.python.util import object_identity

from memsaving.errors import UnsupportedGraphError
from memsaving.tf.extract import is_numeric
from memsaving.tf.measure import default_device
from memsaving.tf.rewrite import is_segment_proxy
from memsaving.model.swapping import (SWAP_FUSE_LEVELS, SWAP_IN_LATEST, SWAP_IN_LEAD, SWAP_OUT_SLACK,
                                     check_copy_timing, fused_groups, swap_out_waiters)


@dataclass(frozen=True)
class SwapOptions:
    """How swaps are emitted (see the module docstring): ``swap_options=`` of
    every entry point (``memsaving.SwapOptions``).

    Parameters
    ----------
    device
        the host device tensors are copied to.
    trigger
        what starts a swap-in: ``"direct"`` (after the op ``lb`` levels
        before its reader) or another trigger of the swap module.
    lb, ub
        how many topological levels before its reader a swap-in may start,
        at least and at most.
    fuse
        readers close together share one copy.
    fuse_levels
        how close (in levels) readers must be to share a copy.
    out_slack
        levels a swap-out may wait after its tensor is made.
    backend
        how copies are made (None: TensorFlow's Snapshot ops).

    Examples
    --------
    >>> SwapOptions(lb=2).device
    '/CPU:0'
    """

    device: str = "/CPU:0"
    trigger: str = "direct"
    lb: int = SWAP_IN_LEAD
    ub: int = SWAP_IN_LATEST
    fuse: bool = True
    fuse_levels: int = SWAP_FUSE_LEVELS
    out_slack: int = SWAP_OUT_SLACK
    backend: Any = None
    """How copies are made (None: TensorFlow's Snapshot ops; tests pass a recording backend)."""

    def __post_init__(self):
        check_copy_timing("swap", self.trigger, self.lb, self.ub)


def gated_copy(value: tf.Tensor, host: str, device: Optional[str], name: str) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(gate, copy)``: a ``Snapshot`` of ``value`` on ``host`` and a
    ``Snapshot`` of the gate on ``device``, named ``{name}_gate`` and
    ``{name}_copy``.

    Control dependencies put on the gate delay the transfer to the device
    (the module docstring says why the copy alone cannot); the caller puts
    them on both ops.  Made outside any control-dependency context."""
    with tf.control_dependencies(None):
        with tf.device(host):
            gate = tf.raw_ops.Snapshot(input=value, name=f"{name}_gate")
        with tf.device(device or None):
            copy = tf.raw_ops.Snapshot(input=gate, name=f"{name}_copy")
    return gate, copy


def snapshot_dtypes(device_type: str) -> FrozenSet[tf.DType]:
    """The dtypes TensorFlow registers a ``Snapshot`` kernel for on
    ``device_type`` (``"CPU"``, ``"GPU"``), read from its kernel registry.

    A Snapshot of any other dtype (a loop's TensorList, of dtype variant)
    builds, but fails when the step runs with "No OpKernel was registered";
    the emitter checks this list instead, when the graph is built.

    Examples
    --------
    >>> tf.float32 in snapshot_dtypes("CPU"), tf.variant in snapshot_dtypes("CPU")
    (True, False)
    """
    found = set()
    for kernel in kernels.get_registered_kernels_for_op("Snapshot").kernel:
        if kernel.device_type.upper() != device_type.upper():
            continue
        for constraint in kernel.constraint:
            if constraint.name == "T":
                found.update(tf.as_dtype(t) for t in constraint.allowed_values.list.type)
    return frozenset(found)


def _device_type(device: Optional[str]) -> str:
    """The type of ``device`` (``"CPU"``, ``"GPU"``); for a device left
    unnamed, the type TensorFlow places ops on by default."""
    named = tf.DeviceSpec.from_string(device or "").device_type
    return (named or tf.DeviceSpec.from_string(default_device()).device_type).upper()


class SnapshotBackend:
    """Copies with ``Snapshot`` ops placed on the host and back on the
    device, each copy back gated on the host (:func:`gated_copy`)."""

    def __init__(self):
        self._dtypes: Dict[str, FrozenSet[tf.DType]] = {}  # snapshot_dtypes by device type, read once

    def cannot_copy(self, tensor: tf.Tensor, host: str) -> Optional[str]:
        """Why ``tensor`` cannot be copied to ``host`` and back (None when
        it can): both copies are Snapshots, which exist for some dtypes only
        (:func:`snapshot_dtypes`)."""
        for device in (host, tensor.op.device):
            kind = _device_type(device)
            if kind not in self._dtypes:
                self._dtypes[kind] = snapshot_dtypes(kind)
            if tensor.dtype.base_dtype not in self._dtypes[kind]:
                return f"TensorFlow has no {kind} kernel of Snapshot, the op that copies it, for {tensor.dtype.name}"
        return None

    def swap_out(self, tensor: tf.Tensor, host: str) -> tf.Tensor:
        with tf.device(host):
            return tf.raw_ops.Snapshot(input=tensor, name="swap_out")

    def swap_in(self, handle: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        return gated_copy(handle, handle.op.device, like.op.device, "swap_in")[1]

    def waiting_ops(self, swap_in: tf.Tensor) -> List[tf.Operation]:
        """The ops a swap-in's trigger and waits go on: its gate and itself."""
        return [swap_in.op.inputs[0].op, swap_in.op]


class HostStoreBackend:
    """A test backend: swap-out moves the bytes into a numpy store (outside
    TensorFlow's allocator) and returns a token; swap-in brings them back.

    On a machine without a GPU the host and the "device" share one
    allocator, so only this makes the saving measurable."""

    def __init__(self):
        self.store: Dict[int, np.ndarray] = {}
        self._next = 0

    def cannot_copy(self, tensor: tf.Tensor, host: str) -> Optional[str]:  # pylint: disable=unused-argument
        """Why ``tensor`` cannot be stored (None when it can): numpy holds
        arrays of numbers only."""
        return None if is_numeric(tensor) else f"the host store holds arrays of numbers, not {tensor.dtype.name}"

    def swap_out(self, tensor: tf.Tensor, host: str) -> tf.Tensor:
        key = self._next
        self._next += 1

        def put(value):
            self.store[key] = value.copy()
            return np.int64(key)

        # stateful=False: a stateful op would be chained to every other one
        # in creation order by tf.function, making cycles with the triggers
        token = tf.numpy_function(put, [tensor], tf.int64, stateful=False, name="swap_out")
        token.set_shape([])
        return token

    def swap_in(self, handle: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        def get(key):
            return self.store[int(key)]

        value = tf.numpy_function(get, [handle], like.dtype, stateful=False, name="swap_in")
        value.set_shape(like.shape)
        return value

    def waiting_ops(self, swap_in: tf.Tensor) -> List[tf.Operation]:
        """The ops a swap-in's trigger and waits go on: itself (no transfer)."""
        return [swap_in.op]


def _levels(backward: Sequence[tf.Operation]) -> Dict[tf.Operation, int]:
    """Topological level of each backward op (creation order is topological)."""
    level: Dict[tf.Operation, int] = {}
    for op in backward:
        preds = [t.op for t in op.inputs] + list(op.control_inputs)
        level[op] = 1 + max((level[p] for p in preds if p in level), default=-1)
    return level


def insert_swaps(
    backward: Sequence[tf.Operation],
    tensors: Sequence[tf.Tensor],
    options: SwapOptions,
    backend=None,
    forward: Sequence[tf.Operation] = (),
) -> List[dict]:
    """Swap ``tensors`` for the ``backward`` ops (all ops created by the
    backward pass, in creation order).  The ``forward`` ops
    ``options.out_slack + 1`` steps downstream of a swapped tensor wait for
    its swap-out, so the device copy is freed during the forward pass.
    Returns, per tensor, its swap-out, swap-ins, triggers and rewired
    consumers (for tests and reports)."""
    backend = backend or SnapshotBackend()
    _refuse_what_cannot_be_copied(backend, tensors, options.device)
    forward_set = set(forward)
    level = _levels(backward)
    by_level: Dict[int, List[tf.Operation]] = {}
    for op in backward:
        by_level.setdefault(level[op], []).append(op)
    position = {op: i for i, op in enumerate(backward)}
    readers = object_identity.ObjectIdentityDictionary()
    for op in backward:
        for t in op.inputs:
            readers.setdefault(t, []).append(op)
    report = []
    for t in tensors:
        consumers = list(dict.fromkeys(readers.get(t, [])))
        if not consumers:
            continue

        def effective(op):
            # a segment's proxy is read by copies that wait on gradients:
            # time the swap-in by them, not by the proxy
            if is_segment_proxy(op):
                later = [level[c] for c in readers.get(op.outputs[0], []) if c in level]
                if later:
                    return min(later)
            return level[op]

        groups = fused_groups(consumers, effective, options.fuse_levels if options.fuse else None)
        swap_out = backend.swap_out(t, options.device)
        for waiter in _forward_waiters(t, options.out_slack, forward_set):
            waiter._add_control_input(swap_out.op)  # pylint: disable=protected-access
        entry = {"tensor": t, "swap_out": swap_out, "swap_ins": [], "triggers": [], "consumers": []}
        for group in groups:
            swap_in = backend.swap_in(swap_out, t)
            first = group[0]
            trigger = _trigger(first, effective(first), options, level, by_level, position)
            if trigger is not None:
                for op in _waiting_ops(backend, swap_in):
                    op._add_control_input(trigger)  # pylint: disable=protected-access
            for op in group:
                for index, value in enumerate(op.inputs):
                    if value is t:
                        op._update_input(index, swap_in)  # pylint: disable=protected-access
            entry["swap_ins"].append(swap_in)
            entry["triggers"].append(trigger)
            entry["consumers"].append(group)
        report.append(entry)
    _wait_for_earlier_swap_ins(report, level, backend)
    return report


def _refuse_what_cannot_be_copied(backend, tensors: Sequence[tf.Tensor], host: str) -> None:
    """Raise, before anything is emitted, when ``backend`` cannot copy one
    of ``tensors`` (its ``cannot_copy``; a backend without one copies
    anything): a graph with such a copy builds, but fails at run time.

    Raises
    ------
    UnsupportedGraphError
        naming the tensor, its dtype and why."""
    check = getattr(backend, "cannot_copy", None)
    if check is None:
        return
    for t in tensors:
        reason = check(t, host)
        if reason is not None:
            raise UnsupportedGraphError(
                f"cannot swap {t.name} (dtype {t.dtype.name}) to {host}: {reason}. Only tensors of numbers can be "
                "swapped (swap=True and swap='auto' pick only those); leave it out of swap=[...]")


def _waiting_ops(backend, swap_in: tf.Tensor) -> List[tf.Operation]:
    """The ops that carry a swap-in's trigger and waits: the backend's
    ``waiting_ops`` when it has one (a backend without it: the swap-in)."""
    waiting = getattr(backend, "waiting_ops", None)
    return waiting(swap_in) if waiting is not None else [swap_in.op]


def _wait_for_earlier_swap_ins(report: List[dict], level: Dict[tf.Operation, int], backend) -> None:
    """Each swap-in also waits for the consumers of the swap-in before it
    (in backward order) that come earlier than its own first consumer.

    Nothing else makes TensorFlow run those consumers promptly: a weight
    gradient that reads a swapped-in activation feeds only the end of the
    step, and the executor may defer it, holding every swapped-in tensor
    until then.  Only ops at lower levels than the swap-in's own consumers
    are waited on, and none that depends on the swap-in (through the
    segments' own waits it could), so no cycle is made."""
    swap_ins = []
    for entry in report:
        for swap_in, group in zip(entry["swap_ins"], entry["consumers"]):
            first = min(level.get(op, 1 << 30) for op in group)
            swap_ins.append((first, swap_in, group))
    swap_ins.sort(key=lambda item: item[0])
    for (_, _, earlier), (first, swap_in, _) in zip(swap_ins, swap_ins[1:]):
        waits = [op for op in earlier if level.get(op, 1 << 30) < first]
        if waits:
            after = _descendants(swap_in.op)
            waits = [op for op in waits if op not in after]  # never a cycle
        if waits:
            for op in _waiting_ops(backend, swap_in):
                op._add_control_inputs(waits)  # pylint: disable=protected-access


def _descendants(op: tf.Operation) -> set:
    """Ops that depend on ``op`` (through data or control edges)."""
    found, stack = set(), [op]
    while stack:
        current = stack.pop()
        for nxt in [c for out in current.outputs for c in out.consumers()] + list(current._control_outputs):  # pylint: disable=protected-access
            if nxt not in found:
                found.add(nxt)
                stack.append(nxt)
    return found


def _forward_waiters(tensor: tf.Tensor, slack: int, forward: set) -> List[tf.Operation]:
    """The forward ops that wait for ``tensor``'s swap-out
    (:func:`memsaving.model.swapping.swap_out_waiters`)."""

    def forward_readers(op: tf.Operation) -> List[tf.Operation]:
        return [c for out in op.outputs for c in out.consumers() if c in forward]

    first = [c for c in tensor.consumers() if c in forward]
    return sorted(swap_out_waiters(first, forward_readers, slack), key=lambda op: op.name)


def _trigger(consumer, consumer_level, options, level, by_level, position) -> Optional[tf.Operation]:
    if options.trigger == "chain":
        op = consumer
        if is_segment_proxy(op):
            # walk from the proxy's first reader instead
            readers = [c for c in op.outputs[0].consumers() if c in level]
            if readers:
                op = min(readers, key=lambda c: level[c])
        for _ in range(options.lb):
            preds = [p for p in [t.op for t in op.inputs] + list(op.control_inputs) if p in level]
            if not preds:
                break
            op = max(preds, key=lambda p: level[p])
        return op if op is not consumer else None
    for distance in range(options.lb, options.ub + 1):
        target = consumer_level - distance
        if target < 0:
            break
        candidates = [op for op in by_level.get(target, ()) if position[op] < position.get(consumer, 1 << 60)]
        if candidates:
            return max(candidates, key=position.get)
    return None
