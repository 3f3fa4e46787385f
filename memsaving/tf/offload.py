"""Emitting parameter offloading in the TensorFlow graph (after the backward pass is built).

With the variables on a *host* device (:mod:`memsaving.tf.placement`), each
``ReadVariableOp`` runs on the host and its value would reach the
accelerator once, through one transfer that the graph partitioner shares
between every accelerator op reading it: the weight would sit on the
accelerator from the first forward use to the last backward use.  This
rewrite gives each phase its own copy instead, so a weight is on the
accelerator only around its uses:

* a *forward copy*, read by every forward op on the accelerator that read
  the variable's value;
* *backward copies*, read by the backward ops that read it (data gradients
  of products, recomputed forward ops); readers within ``fuse_levels``
  topological levels of the first of their group share one copy
  (:func:`memsaving.model.swapping.fused_groups`, as swap-ins are fused).

Each copy waits for a *trigger*, an op of its phase a few topological
levels before the copy's first reader, chosen by the rule swap-ins use
(:mod:`memsaving.tf.swap_rewrite`): ``"direct"``, the op ``lb``..``ub``
levels back; ``"chain"``, the op ``lb`` steps back along the reader's
inputs.  A copy's device buffer is freed by TensorFlow when its last reader
is done.

A copy is two ``Snapshot`` ops, as a swap-in is
(:func:`memsaving.tf.swap_rewrite.gated_copy`): a *gate* on the host, which
reads the variable's value and carries the control dependency on the
trigger, and the *copy* on the accelerator, which reads the gate and feeds
the readers.  The gate is what makes the transfer wait; a copy on the
accelerator alone, reading the host value, would also share one receive
with every other copy of the same value, made at the start of the step.
The gate copies the weight in host memory (it shares the variable's
buffer, so it cannot forward it).

Triggers are chosen among the ops that run (ancestors of ``roots``: the
results and the loss), that read something other than a variable (a
source or a variable read runs at the start of the step, too early to time
anything), and whose output more than one op reads (an op read by one op
alone may be the inside of a kernel Grappler fuses, a product before its
bias and activation, and a control edge out of it stops the fusion: fused
and unfused kernels round differently).  Levels count data and control
edges over the whole graph, so a trigger is always at a lower level than
the copy's readers and no cycle is made.

A recomputed segment reads a weight through its *proxy* (an ``Identity``
the rewrite puts at the segment's inputs, read by the recomputed ops and
their gradients): the proxy's readers are taken as the weight's readers,
each group reading its copy directly, so the recomputation and the
gradient, far apart in a long segment, need not share one copy (the
simulator counts them as readers of the weight too).  Gradients of weights
are left to TensorFlow: an update op on the host reads the gradient made
on the accelerator, which the partitioner sends back.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import tensorflow as tf

from memsaving.model.swapping import SWAP_FUSE_LEVELS, SWAP_IN_LATEST, SWAP_IN_LEAD, check_copy_timing, fused_groups
from memsaving.tf.forward import topological_order
from memsaving.tf.measure import default_device
from memsaving.tf.order import must_run
from memsaving.tf.placement import same_device
from memsaving.tf.rewrite import is_segment_proxy
from memsaving.tf.swap_rewrite import gated_copy


@dataclass(frozen=True)
class OffloadOptions:
    """How offloaded parameters are copied (see the module docstring):
    ``offload_options=`` of every entry point (``memsaving.OffloadOptions``).

    Parameters
    ----------
    device
        the host device the variables live on.
    accelerator
        where copies are made for readers with no device of their own
        (None: the first GPU, else the CPU).
    trigger, lb, ub, fuse, fuse_levels
        as for swap-ins (:class:`memsaving.tf.swap_rewrite.SwapOptions`).

    Examples
    --------
    >>> OffloadOptions(device="/CPU:0").trigger
    'direct'
    """

    device: str = "/CPU:0"
    accelerator: Optional[str] = None
    trigger: str = "direct"
    lb: int = SWAP_IN_LEAD
    ub: int = SWAP_IN_LATEST
    fuse: bool = True
    fuse_levels: int = SWAP_FUSE_LEVELS

    def __post_init__(self):
        check_copy_timing("offload", self.trigger, self.lb, self.ub)


@dataclass
class Copy:
    """One copy of a weight on the accelerator: the host gate, the copy
    its readers read, the trigger both wait for, and the readers."""

    gate: tf.Tensor
    value: tf.Tensor
    trigger: Optional[tf.Operation]
    readers: List[tf.Operation]


@dataclass
class OffloadedRead:
    """What the rewrite did for one ``ReadVariableOp`` on the host."""

    read: tf.Operation
    forward: List[Copy] = field(default_factory=list)
    backward: List[Copy] = field(default_factory=list)
    host_readers: List[tf.Operation] = field(default_factory=list)
    """Readers on the host itself, left reading the value directly."""


def handle_device(handle: tf.Tensor) -> str:
    """The device of the variable behind the resource tensor ``handle``:
    a ``VarHandleOp``'s device in a v1 graph; in a ``tf.function``, the
    device of the variable it captures (through enclosing functions)."""
    seen = 0
    while seen < 100:
        seen += 1
        if handle.op.type == "VarHandleOp" or handle.op.device:
            return handle.op.device
        outer = _captured_from(handle)
        if outer is None:
            return ""
        if isinstance(outer, tf.__internal__.EagerTensor):
            return outer.device
        handle = outer
    return ""


def _captured_from(tensor: tf.Tensor):
    """The tensor (eager, or of an enclosing graph) that ``tensor`` captures, None when it captures none."""
    for external, internal in getattr(tensor.graph, "captures", ()):
        if internal is tensor:
            return external
    return None


def host_reads(ops: Iterable[tf.Operation], device: str) -> List[tf.Operation]:
    """The ``ReadVariableOp`` ops among ``ops`` whose variable lives on ``device``."""
    found = []
    devices: Dict[int, str] = {}
    for op in ops:
        if op.type != "ReadVariableOp":
            continue
        handle = op.inputs[0]
        if id(handle) not in devices:
            devices[id(handle)] = handle_device(handle)
        if same_device(devices[id(handle)], device):
            found.append(op)
    return found


def insert_offload(reads: Sequence[tf.Operation], backward: Iterable[tf.Operation],
                   roots: Sequence, options: OffloadOptions) -> List[OffloadedRead]:
    """Give every accelerator reader of ``reads`` (variable reads on the
    host, :func:`host_reads`) a copy of its phase, as the module docstring
    says.  ``backward``: the ops the backward pass made (their reads are the
    backward phase's, every other reader's the forward phase's); ``roots``:
    tensors or ops the step runs (results, loss), whose ancestors may
    trigger copies.  Returns what was done per read, for tests and reports."""
    if not reads:
        return []
    graph = reads[0].graph
    backward = set(backward)
    schedule = _Schedule(graph, roots, backward)
    report = []
    for read in reads:
        entry = OffloadedRead(read)
        forward: Dict[str, List[_Use]] = collections.defaultdict(list)
        late: Dict[str, List[_Use]] = collections.defaultdict(list)
        for use in _uses(read.outputs[0], backward):
            device = use.op.device or options.accelerator or "/" + default_device()
            if same_device(device, options.device):
                entry.host_readers.append(use.op)
            else:
                (late if use.op in backward else forward)[device].append(use)
        for device, uses in forward.items():
            entry.forward.append(_copy(read.outputs[0], uses, device, "forward", schedule, options, in_backward=False))
        for device, uses in late.items():
            live = [u for u in uses if u.op in schedule.live]
            dead = [u for u in uses if u.op not in schedule.live]
            fuse = options.fuse_levels if options.fuse else None
            groups = fused_groups(live, lambda use: schedule.level[use.op], fuse)
            for k, group in enumerate(groups):
                entry.backward.append(_copy(read.outputs[0], group, device, f"backward_{k}", schedule, options,
                                            in_backward=True))
            if dead:  # readers whose results nothing uses: pruned with their copy
                entry.backward.append(_copy(read.outputs[0], dead, device, "unused", schedule, options,
                                            in_backward=True, triggered=False))
        report.append(entry)
    return report


@dataclass(frozen=True, eq=False)
class _Use:
    """An op reading a variable's value: the op, and the tensor it reads
    that holds the value (the read's output, or a segment proxy's)."""

    op: tf.Operation
    tensor: tf.Tensor


def _uses(value: tf.Tensor, backward: set) -> List[_Use]:
    """The readers of ``value``, a segment's proxy standing for its readers
    (see the module docstring)."""
    found = []
    for reader in dict.fromkeys(value.consumers()):
        if reader in backward and is_segment_proxy(reader):
            proxied = reader.outputs[0]
            found.extend(_Use(op, proxied) for op in dict.fromkeys(proxied.consumers()))
        else:
            found.append(_Use(reader, value))
    return found


_EARLY_TYPES = frozenset({"ReadVariableOp", "VarHandleOp", "Placeholder", "Const"})
"""Ops that run at the start of the step whatever their inputs: no trigger."""


class _Schedule:
    """Topological levels of every op of ``graph`` (data and control edges),
    creation positions, the ops that run (ancestors of ``roots``), and the
    trigger candidates of each phase by level."""

    def __init__(self, graph: tf.Graph, roots: Sequence, backward: set):
        ops = graph.get_operations()
        self.backward = backward
        self.position = {op: i for i, op in enumerate(ops)}
        self.level: Dict[tf.Operation, int] = {}
        for op in topological_order(ops):
            preds = [t.op for t in op.inputs] + list(op.control_inputs)
            self.level[op] = 1 + max((self.level[p] for p in preds if p in self.level), default=-1)
        self.live = must_run([r if isinstance(r, tf.Operation) else r.op for r in roots if r is not None])
        self.by_level: Dict[bool, Dict[int, List[tf.Operation]]] = {False: {}, True: {}}
        for op in ops:
            if self.may_trigger(op):
                self.by_level[op in backward].setdefault(self.level[op], []).append(op)

    def may_trigger(self, op: tf.Operation) -> bool:
        """Whether ``op`` runs, at a time its inputs decide (not a source or
        a variable read), and can carry a control edge out without changing
        what Grappler fuses: an op whose output only one op reads may be the
        inside of a fused kernel (a product, or its bias, before an
        activation), which Grappler's remapper does not fuse once it has a
        control edge; fused and unfused kernels round differently (oneDNN's
        tanh is not Eigen's), and gradients would no longer equal
        ``tf.gradients``' to the bit."""
        if op not in self.live or op.type in _EARLY_TYPES:
            return False
        if not (op.control_inputs or any(t.dtype != tf.resource for t in op.inputs)):
            return False
        return len({c for t in op.outputs for c in t.consumers()}) != 1

    def trigger(self, first: tf.Operation, in_backward: bool, options: OffloadOptions) -> Optional[tf.Operation]:
        """The op a copy read first by ``first`` waits for (the swap-in rule, among the phase's ops)."""
        if options.trigger == "chain":
            op = first
            for _ in range(options.lb):
                preds = [p for p in [t.op for t in op.inputs] + list(op.control_inputs)
                         if (p in self.backward) == in_backward and self.may_trigger(p)]
                if not preds:
                    break
                op = max(preds, key=lambda p: (self.level[p], self.position[p]))
            return op if op is not first else None
        candidates_by_level = self.by_level[in_backward]
        for distance in range(options.lb, options.ub + 1):
            target = self.level[first] - distance
            if target < 0:
                break
            candidates = [op for op in candidates_by_level.get(target, ()) if self.position[op] < self.position[first]]
            if candidates:
                return max(candidates, key=self.position.get)
        return None


def _copy(value: tf.Tensor, uses: List[_Use], device: str, tag: str, schedule: _Schedule,
          options: OffloadOptions, in_backward: bool, triggered: bool = True) -> Copy:
    """A gate on the host and a copy on ``device`` for ``uses``, waiting
    for the trigger of the first of them; the readers are rewired to the copy."""
    first = min((use.op for use in uses), key=lambda op: (schedule.level[op], schedule.position[op]))
    trigger = schedule.trigger(first, in_backward, options) if triggered else None
    with value.graph.name_scope(f"{value.op.name}/offload/"):
        gate, copy = gated_copy(value, options.device, device, tag)
    if trigger is not None:
        gate.op._add_control_input(trigger)  # pylint: disable=protected-access
        copy.op._add_control_input(trigger)  # pylint: disable=protected-access
    for use in uses:
        for index, tensor in enumerate(use.op.inputs):
            if tensor is use.tensor:
                use.op._update_input(index, copy)  # pylint: disable=protected-access
    return Copy(gate, copy, trigger, list(dict.fromkeys(use.op for use in uses)))
