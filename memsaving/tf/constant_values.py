"""Which tensors of a graph hold values computed from constants alone.

TensorFlow folds such a value into a constant of the function (its
constant folding runs when a function is instantiated, and again in
Grappler) and holds that constant for the function's life.  A split region
that copies an op computing one (the all-true fill and the band of a causal
mask) for every piece and every copy of the region (forward, recomputed,
backward) would have each copy folded into a constant of its own; the
emitter makes such pieces once instead (:mod:`memsaving.tf.split_rewrite`).
"""

from __future__ import annotations

from typing import Dict

import tensorflow as tf

SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
"""Ops whose value is their input's shape: a constant when it is known."""

MAX_OPS = 256
"""The most ops :func:`from_constants` looks at for one tensor; a value
behind more is taken as not constant (it is then copied per piece, as any
other: correct, only not shared)."""


def from_constants(t: tf.Tensor, known: Dict[tf.Operation, bool]) -> bool:
    """True when ``t``'s value is computed from constants alone (``Const``
    ops, and shapes known when tracing), by ops that are neither stateful
    nor random.  ``known`` caches the answer per op across calls.

    Examples
    --------
    >>> graph = tf.Graph()
    >>> with graph.as_default():
    ...     mask = tf.linalg.band_part(tf.ones([4, 4], tf.bool), -1, 0)
    ...     x = tf.compat.v1.placeholder(tf.float32, [4, 4])
    ...     masked = tf.where(mask, x, 0.0)
    >>> known = {}
    >>> from_constants(mask, known), from_constants(masked, known)
    (True, False)
    """
    stack = [t.op]
    seen = 0
    while stack:
        op = stack[-1]
        if op in known:
            stack.pop()
            continue
        seen += 1
        if seen > MAX_OPS:
            return False
        verdict = _by_itself(op)
        if verdict is not None:
            known[op] = verdict
            stack.pop()
            continue
        pending = [i.op for i in op.inputs if i.op not in known]
        if pending:
            stack.extend(pending)
            continue
        known[op] = all(known[i.op] for i in op.inputs)
        stack.pop()
    return known[t.op]


def _by_itself(op: tf.Operation):
    """True or False when ``op`` decides it without its inputs, else None."""
    if op.type == "Const":
        return True
    if op.type in SHAPE_OPS:
        return all(i.shape.is_fully_defined() for i in op.inputs)
    if not op.inputs or op.op_def.is_stateful:
        return False  # a placeholder, a variable's handle, a random op
    return None
