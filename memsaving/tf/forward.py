"""The forward subgraph between ``xs`` and ``ys`` of a TensorFlow graph.

This is one of the two modules that read TensorFlow graphs (the other is the
rewrite that emits ops). It finds the ops the backward pass differentiates
through, in the same way ``tf.gradients`` does: an op is *forward* when it is
reachable from ``xs`` along trainable (floating, complex, resource, variant)
tensors and ``ys`` depend on it.  Knowing exactly this set lets the rewrite
copy only ops whose values matter for the gradients.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence

import tensorflow as tf
from tensorflow.python.eager import backprop_util
from tensorflow.python.ops import resource_variable_ops

from memsaving.errors import UnsupportedGraphError

@contextlib.contextmanager
def ops_made_in(graph: tf.Graph) -> Iterator[List[tf.Operation]]:
    """The ops added to ``graph`` inside the ``with`` block, in creation order.

    The list is filled when the block ends.  A graph only grows and lists
    its ops in the order they were made, so the new ops are the tail of
    ``graph.get_operations()``.
    """
    made: List[tf.Operation] = []
    before = len(graph.get_operations())
    yield made
    made.extend(graph.get_operations()[before:])


CONTROL_FLOW_V2_OPS = frozenset(
    {"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"}
)
"""Functional control flow. Kept whole (never copied): their gradient code
keeps Python-side state on the op (cached body graphs, accumulators)."""

CONTROL_FLOW_V1_OPS = frozenset(
    {
        "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter",
        "Exit", "RefExit", "NextIteration", "RefNextIteration", "LoopCond",
    }
)
"""TF1 dataflow control flow: its gradient needs the whole loop context, which
a segment-by-segment rewrite cannot give, so graphs with it are refused."""


_TRAINABLE = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128, tf.resource})


def is_tensor_like(value) -> bool:
    """True for what memsaving takes where it takes tensors (``ys``, ``xs``,
    a list of checkpoints or of tensors to swap): a ``tf.Tensor`` or a
    variable.

    Examples
    --------
    >>> is_tensor_like(tf.constant(1.0)), is_tensor_like(tf.Variable(1.0)), is_tensor_like(1.0)
    (True, True, False)
    """
    return isinstance(value, (tf.Tensor, tf.Variable)) or resource_variable_ops.is_resource_variable(value)


def is_trainable(tensor: tf.Tensor) -> bool:
    """True when gradients flow through ``tensor`` (same rule as tf.gradients)."""
    dtype = tensor.dtype.base_dtype
    if dtype in _TRAINABLE:
        return True
    if dtype == tf.variant:
        return bool(backprop_util.IsTrainable(tensor))
    return False


def is_copyable(op: tf.Operation) -> bool:
    """True when recomputing ``op`` yields exactly the original values.

    Stateful ops (variable reads, random numbers, assignments, calls of
    functions with side effects) are never recomputed: a copy could read a
    variable after an update or draw new random numbers, and gradients would
    no longer equal those of the original graph.  Their outputs are kept from
    the forward pass instead.
    """
    if op.type in CONTROL_FLOW_V2_OPS:
        return False
    try:
        if op._is_stateful:  # pylint: disable=protected-access
            return False
    except (AttributeError, ValueError):
        return False
    return not any(t.dtype._is_ref_dtype for t in op.inputs)  # pylint: disable=protected-access


def _consumers(tensor: tf.Tensor) -> list:
    return tensor.consumers()


@dataclass
class ForwardGraph:
    """Ops between ``xs`` and ``ys`` in topological (creation) order.

    Attributes
    ----------
    xs : list
        the tensors gradients are taken with respect to (variables already
        replaced by their handles, as tf.gradients does).
    ys : list
        the tensors being differentiated.
    ops : list
        the forward ops, sorted so every op comes after its inputs.
    position : dict
        op -> index in ``ops``.
    """

    xs: list
    ys: list
    ops: list
    position: dict = field(repr=False)
    _xs_ids: set = field(repr=False, default_factory=set)

    def contains_op(self, op: tf.Operation) -> bool:
        return op in self.position

    def is_x(self, tensor: tf.Tensor) -> bool:
        return id(tensor) in self._xs_ids

    def contains_tensor(self, tensor: tf.Tensor) -> bool:
        """True when ``tensor`` is one of ``xs`` or an output of a forward op."""
        return self.is_x(tensor) or tensor.op in self.position


def forward_graph(
    xs: Sequence[tf.Tensor],
    ys: Sequence[tf.Tensor],
    stop_gradients: Sequence[tf.Tensor] = (),
) -> ForwardGraph:
    """Find the forward ops between ``xs`` and ``ys``.

    Parameters
    ----------
    xs
        graph tensors (variable handles for variables).
    ys
        graph tensors.
    stop_gradients
        tensors whose ops are treated as constants (as the
        argument of the same name of tf.gradients).

    Raises
    ------
    UnsupportedGraphError
        the subgraph contains TF1-style control flow.
    """
    stop_ops = {t.op for t in stop_gradients}
    reached = set()
    queue = collections.deque()
    for x in xs:
        if is_trainable(x):
            queue.extend(_consumers(x))
    while queue:
        op = queue.popleft()
        if op in reached or op in stop_ops:
            continue
        reached.add(op)
        for out in op.outputs:
            if is_trainable(out):
                queue.extend(_consumers(out))

    between = set()
    queue.extend(y.op for y in ys)
    while queue:
        op = queue.popleft()
        if op in between or op not in reached:
            continue
        between.add(op)
        queue.extend(t.op for t in op.inputs)

    v1_flow = sorted(op.name for op in between if op.type in CONTROL_FLOW_V1_OPS)
    if v1_flow:
        raise UnsupportedGraphError(
            "memsaving cannot rewrite TF1-style control flow (Switch/Merge/Enter "
            f"ops such as {v1_flow[:3]}). Build the model with control flow v2 "
            "(the TF2 default; do not call tf.compat.v1.disable_control_flow_v2), "
            "or use tf.gradients for this graph."
        )
    ops = sorted(between, key=lambda op: op._id)  # pylint: disable=protected-access
    ops = topological_order(ops)
    return ForwardGraph(
        xs=list(xs),
        ys=list(ys),
        ops=ops,
        position={op: i for i, op in enumerate(ops)},
        _xs_ids={id(x) for x in xs},
    )


def topological_order(ops: list) -> list:
    """Order ``ops`` so each comes after its data and control inputs.

    Creation order almost always is such an order; control inputs added after
    creation can break it, so a stable Kahn pass repairs those cases.
    """
    members = set(ops)
    rank = {op: i for i, op in enumerate(ops)}
    in_degree = {op: 0 for op in ops}
    users = collections.defaultdict(list)
    for op in ops:
        preds = {t.op for t in op.inputs} | set(op.control_inputs)
        for pred in preds:
            if pred in members and pred is not op:
                in_degree[op] += 1
                users[pred].append(op)
    heap = [(rank[op], op._id, op) for op in ops if in_degree[op] == 0]  # pylint: disable=protected-access
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, op = heapq.heappop(heap)
        order.append(op)
        for user in users[op]:
            in_degree[user] -= 1
            if in_degree[user] == 0:
                heapq.heappush(heap, (rank[user], user._id, user))  # pylint: disable=protected-access
    if len(order) != len(ops):
        raise UnsupportedGraphError("the forward graph between xs and ys has a cycle")
    return order
