"""A loop's gradient that keeps every k-th iteration's state, not every one.

TensorFlow differentiates a ``While`` loop (``tf.while_loop``, ``tf.scan``,
Keras' LSTM, GRU and SimpleRNN layers) by rewriting the forward loop so that
it also pushes every iteration's intermediates onto lists, which the
backward loop pops: T iterations hold T iterations' values, whatever a plan
does around the loop.

:func:`checkpointed_loop_gradient` is a gradient function for such a loop
that runs the forward loop unchanged (nothing is pushed) and, in the
backward pass:

1. runs the loop body again from the loop's inputs, in chunks of k
   iterations, storing only the state at the start of each chunk (T/k
   states);
2. walks the chunks last first: it runs the k iterations of one chunk again
   from its stored state, under ``tf.gradients``, and hands the gradient of
   the chunk's starting state to the chunk before.

The memory held is T/k stored states plus one chunk's intermediates, least
at k = sqrt(T) (:func:`chunk_length`); the cost is two more runs of the
forward loop.  The loop's body and condition are called as they are (their
function definitions), so the gradients are TensorFlow's own for the same
ops, in the same order.

A loop whose body draws random numbers, or changes state, cannot be run
again to the same values: :func:`can_checkpoint` says no, and such loops keep
TensorFlow's gradient.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.core.framework import function_pb2
from tensorflow.python.framework import function_def_to_graph, op_def_registry
from tensorflow.python.ops import default_gradient, gen_resource_variable_ops, handle_data_util

from memsaving.tf.loop_pinning import LOOP_TYPES

_DIFFERENTIABLE = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128,
                             tf.variant})
"""Loop variables whose gradient is carried back through the chunks (variants
are TensorLists: a Keras RNN's input and output sequences)."""

_STATE_READERS = frozenset({"ReadVariableOp", "While", "StatelessWhile", "If", "StatelessIf",
                            "PartitionedCall", "StatefulPartitionedCall"})
"""Stateful op types a body may hold and still be run again to the same
values: variable reads, and control flow or calls whose own bodies are
checked in turn."""


def chunk_length(iterations: tf.Tensor) -> tf.Tensor:
    """The k of a loop of ``iterations`` iterations in memory mode: ceil(sqrt(T)), at least 1.

    Parameters
    ----------
    iterations : tf.Tensor
        The loop's iteration count (int32; known only when the loop has run).

    Returns
    -------
    tf.Tensor
        int32 scalar.

    Examples
    --------
    >>> int(chunk_length(tf.constant(512)))
    23
    """
    root = tf.math.ceil(tf.sqrt(tf.cast(iterations, tf.float32)))
    return tf.maximum(tf.cast(root, tf.int32), 1)


def can_checkpoint(op: tf.Operation) -> bool:
    """True when ``op`` is a loop whose body and condition may be run again
    to the same values (no random draws, no writes), so that its gradient
    may recompute iterations.

    Examples
    --------
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, [])
    ...     y = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * x), [0, x])[1]
    >>> [can_checkpoint(op) for op in g.get_operations() if op.type in ("While", "StatelessWhile")]
    [True]
    """
    if op.type not in LOOP_TYPES or not _counts_its_iterations(op):
        return False
    graph = op.graph
    return all(_replayable(graph, op.get_attr(name).name, set()) for name in ("body", "cond"))


def _counts_its_iterations(op: tf.Operation) -> bool:
    """Whether ``op`` is a loop as ``tf.while_loop`` builds it: its first
    loop variable counts the iterations run (the chunks are counted from
    it), its second is the iteration limit."""
    function = op.graph._get_function(op.get_attr("body").name)  # pylint: disable=protected-access
    if function is None or len(op.inputs) < 2 or any(t.dtype != tf.int32 for t in op.inputs[:2]):
        return False
    return function.definition.signature.input_arg[0].name.endswith("loop_counter")


def _replayable(graph: tf.Graph, function_name: str, seen: set) -> bool:
    if function_name in seen:
        return True
    seen.add(function_name)
    function = graph._get_function(function_name)  # pylint: disable=protected-access
    if function is None:
        return False
    for node in function.definition.node_def:
        op_def = op_def_registry.get(node.op)
        if op_def is None:  # a call of a library function by its name
            if not _replayable(graph, node.op, seen):
                return False
            continue
        if op_def.is_stateful and node.op not in _STATE_READERS:
            return False
        for value in node.attr.values():
            if value.HasField("func") and not _replayable(graph, value.func.name, seen):
                return False
    return True


def _replay_function(op: tf.Operation, attribute: str):
    """A callable copy of loop ``op``'s body or condition (``attribute``)
    that ``tf.gradients`` can differentiate.

    A copy, built from the function's definition under a name of its own:
    differentiating a call adds the intermediates its gradient needs to the
    called graph's outputs, and done on the loop's own body graph that would
    break TensorFlow's gradient of the same loop (the user's ``tf.gradients``
    of it, later in the same step).  From the definition, so that loops
    imported from a GraphDef (a SavedModel's, the profiler's) are copied as
    traced ones are."""
    definition = function_pb2.FunctionDef()
    definition.CopyFrom(op.graph._get_function(op.get_attr(attribute).name).definition)  # pylint: disable=protected-access
    definition.signature.name = f"{definition.signature.name}_replay_{next(_COPIES)}"
    graph = function_def_to_graph.function_def_to_graph(definition)
    # what the definition does not carry: the variables' and lists' handle data, which their gradients
    # read; the body and the condition take the loop's inputs, in order
    for outer, inner in zip(op.inputs, graph.inputs):
        if outer.dtype in (tf.resource, tf.variant):
            handle_data_util.copy_handle_data(outer, inner)
    return concrete_function.ConcreteFunction.from_func_graph(graph, None, {})


_COPIES = itertools.count()


def _call(function, args: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """Call a :func:`_replay_function` on ``args``."""
    outputs = function._call_flat(list(args), [])  # pylint: disable=protected-access
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


class _Loop:
    """One ``While`` op: its body and condition, and which of its inputs are
    carried (all but variable handles, which a new loop captures: a loop's
    gradient reaches a variable only through a capture)."""

    def __init__(self, op: tf.Operation):
        self.op = op
        self.body = _replay_function(op, "body")
        self.cond = _replay_function(op, "cond")
        self.inputs = list(op.inputs)
        self.carried = [i for i, t in enumerate(self.inputs) if t.dtype != tf.resource]
        self.variables = [i for i, t in enumerate(self.inputs) if t.dtype == tf.resource]
        self.shapes = [op.outputs[i].shape for i in self.carried]

    def full(self, fixed: Sequence[tf.Tensor], carried: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        args = list(fixed)
        for i, value in zip(self.carried, carried):
            args[i] = value
        return args

    def run(self, fixed: Sequence[tf.Tensor], carried: Sequence[tf.Tensor], steps: tf.Tensor) -> List[tf.Tensor]:
        """The carried values after ``steps`` iterations from ``carried``
        (fewer where the loop's own condition ends it); ``fixed``: every
        input, the variable handles among them."""
        def condition(i, *values):
            return tf.logical_and(i < steps, _call(self.cond, self.full(fixed, values))[0])

        def body(i, *values):
            outputs = _call(self.body, self.full(fixed, values))
            return [i + 1] + [outputs[k] for k in self.carried]

        shapes = [tf.TensorShape([])] + self.shapes
        results = tf.while_loop(condition, body, [tf.constant(0)] + list(carried), shape_invariants=shapes,
                                parallel_iterations=1)
        return list(results[1:])


def checkpointed_loop_gradient(op: tf.Operation, *grads, every: Optional[int] = None) -> list:
    """The gradient of loop ``op``'s inputs, keeping one state every ``every`` iterations.

    A gradient function (``op._gradient_function``), as ``tf.gradients``
    calls it.  ``every``: the chunk length k; None for ceil(sqrt(T)) of the
    iterations the loop ran (:func:`chunk_length`).

    Parameters
    ----------
    op : tf.Operation
        A ``While`` or ``StatelessWhile`` op (:func:`can_checkpoint`).
    *grads : tf.Tensor or None
        The gradients of its outputs.
    every : int, optional
        Iterations per chunk.

    Returns
    -------
    list
        One gradient (or None) per input of ``op``.

    Examples
    --------
    >>> w = tf.Variable(0.5)
    >>> def loop(x):
    ...     return tf.while_loop(lambda i, v: i < 10, lambda i, v: (i + 1, tf.tanh(v * w)), [0, x])[1]
    >>> @tf.function(autograph=False)
    ... def both(x):
    ...     y = loop(x)
    ...     with checkpointing_loops(y.graph.get_operations(), every=3) as switched:
    ...         assert switched == 1  # the loop's gradient function is this one
    ...         ours = tf.gradients(y, [x, w])
    ...     return ours, tf.gradients(loop(x), [x, w])
    >>> ours, tensorflows = both(tf.constant(1.0))
    >>> all(abs(float(a) - float(b)) < 1e-6 for a, b in zip(ours, tensorflows))
    True
    """
    loop = _Loop(op)
    iterations = op.outputs[0]  # while_v2's first loop variable counts the iterations run
    k = chunk_length(iterations) if every is None else tf.constant(max(int(every), 1))
    chunks = (iterations + k - 1) // k
    with tf.name_scope("loop_checkpoints"):
        starts = _chunk_starts(loop, k, chunks)
        return _backward(loop, grads, k, chunks, starts)


def _chunk_starts(loop: _Loop, k: tf.Tensor, chunks: tf.Tensor) -> List[tf.TensorArray]:
    """Run the loop again from its inputs, keeping the carried values at the start of every chunk."""
    arrays = [tf.TensorArray(loop.inputs[i].dtype, size=chunks, infer_shape=False) for i in loop.carried]

    def keep(j, values, arrays):
        arrays = [a.write(j, v) for a, v in zip(arrays, values)]
        return j + 1, loop.run(loop.inputs, values, k), arrays

    carried = [loop.inputs[i] for i in loop.carried]
    _, _, arrays = tf.while_loop(lambda j, values, arrays: j < chunks, keep, [tf.constant(0), carried, arrays],
                                 shape_invariants=[tf.TensorShape([]), loop.shapes, [None] * len(arrays)],
                                 parallel_iterations=1)
    return arrays


def _backward(loop: _Loop, grads: Sequence, k: tf.Tensor, chunks: tf.Tensor, starts: List[tf.TensorArray]) -> list:
    """Walk the chunks last first, each run again under ``tf.gradients``."""
    op = loop.op
    flowing = [m for m, i in enumerate(loop.carried) if loop.inputs[i].dtype in _DIFFERENTIABLE]
    upstream = [_initial_gradient(grads[loop.carried[m]], op.outputs[loop.carried[m]]) for m in flowing]
    variables = [_variable_zeros(loop.inputs[i]) for i in loop.variables]

    def chunk(j, upstream, variable_grads):
        graph = tf.compat.v1.get_default_graph()
        fixed = [graph.capture(t) if t.dtype == tf.resource else t for t in loop.inputs]
        start = [a.read(j) for a in starts]
        for value, shape in zip(start, loop.shapes):
            value.set_shape(shape)
        end = loop.run(fixed, start, k)
        xs = [start[m] for m in flowing] + [fixed[i] for i in loop.variables]
        results = tf.gradients([end[m] for m in flowing], xs, grad_ys=list(upstream), unconnected_gradients="zero")
        before = results[:len(flowing)]
        totals = [total + tf.convert_to_tensor(g) for total, g in zip(variable_grads, results[len(flowing):])]
        return j - 1, before, totals

    shapes = [tf.TensorShape([]), [loop.shapes[m] for m in flowing], [v.shape for v in variables]]
    _, upstream, variables = tf.while_loop(lambda j, u, v: j >= 0, chunk, [chunks - 1, upstream, variables],
                                           shape_invariants=shapes, parallel_iterations=1)
    results: list = [None] * len(loop.inputs)
    for m, g in zip(flowing, upstream):
        results[loop.carried[m]] = g
    for i, g in zip(loop.variables, variables):
        results[i] = g
    return results


def _initial_gradient(grad, output: tf.Tensor) -> tf.Tensor:
    """The gradient arriving at a loop output, dense, zeros where none arrives (as TensorFlow's
    loop gradient does)."""
    if grad is None:
        return tf.zeros_like(output)
    return tf.convert_to_tensor(grad)


def _variable_zeros(handle: tf.Tensor) -> tf.Tensor:
    return tf.zeros(gen_resource_variable_ops.variable_shape(handle), dtype=default_gradient.get_zeros_dtype(handle))


@contextlib.contextmanager
def checkpointing_loops(ops: Sequence[tf.Operation], every: Optional[int] = None) -> Iterator[int]:
    """Within the block, ``tf.gradients`` differentiates the loops among
    ``ops`` that :func:`can_checkpoint` by :func:`checkpointed_loop_gradient`.

    The loops' own gradient functions are put back on exit, so a later
    ``tf.gradients`` of the same loops (the user's) is TensorFlow's.

    Yields
    ------
    int
        How many loops were switched.

    Examples
    --------
    >>> with checkpointing_loops([]) as switched:
    ...     switched
    0
    """
    switched = [op for op in ops if can_checkpoint(op)]
    before = [op._gradient_function for op in switched]  # pylint: disable=protected-access

    def gradient(op, *grads):
        return checkpointed_loop_gradient(op, *grads, every=every)

    for op in switched:
        op._gradient_function = gradient  # pylint: disable=protected-access
    try:
        yield len(switched)
    finally:
        for op, old in zip(switched, before):
            op._gradient_function = old  # pylint: disable=protected-access
