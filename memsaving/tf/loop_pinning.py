"""Run the gradient's loops one iteration at a time, so that their memory is
the same in every run.

A loop's gradient (``tf.while_loop``, Keras RNN layers) may run up to
``parallel_iterations`` iterations at once.  How many the executor actually
starts depends on the running times it has measured so far, so the memory a
loop's gradient holds changes from run to run and from process to process:
a plan can neither predict it nor keep a budget under it.  Each iteration of
a recurrent gradient waits for the previous one anyway, so running them one
at a time costs little time and makes the peak repeatable.

The rule is applied by both ends that must agree on it: the emitter pins the
loops it builds (:func:`memsaving.gradients`), and the profiler pins the loop
gradients it measures (:mod:`memsaving.tf.profiles`), so that the profile
describes what runs.
"""

from __future__ import annotations

from typing import Iterable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

LOOP_TYPES = frozenset({"While", "StatelessWhile"})

GRADIENT_LOOP_ITERATIONS = 1
"""How many iterations of a loop built for the gradient may run at once."""


def pin_loop_iterations(ops: Iterable[tf.Operation], iterations: int = GRADIENT_LOOP_ITERATIONS) -> int:
    """Limit every loop among ``ops`` to ``iterations`` iterations in flight.

    Only the ops given are changed (the caller passes the ops it created, so
    the user's forward loops keep their setting).  Loops already limited to
    fewer iterations are left alone.

    Parameters
    ----------
    ops : iterable of tf.Operation
        Ops of a graph being built; they must not have run yet.
    iterations : int
        The new ``parallel_iterations`` of each loop, at least 1.

    Returns
    -------
    int
        How many loops were changed.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from memsaving.tf.forward import ops_made_in
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, [])
    ...     y = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * x), [0, x])[1]
    ...     with ops_made_in(g) as made:
    ...         dx = tf.gradients(y, x)
    >>> pin_loop_iterations(made)
    1
    """
    if iterations < 1:
        raise ValueError(f"pin_loop_iterations: iterations must be at least 1, got {iterations}")
    changed = 0
    for op in ops:
        if op.type not in LOOP_TYPES:
            continue
        if op.get_attr("parallel_iterations") <= iterations:
            continue
        op._set_attr("parallel_iterations", attr_value_pb2.AttrValue(i=iterations))  # pylint: disable=protected-access
        changed += 1
    return changed
