"""Loops checkpointed inside, on the graph model (no TensorFlow).

A loop's gradient as TensorFlow builds it makes the forward loop save every
iteration's intermediates (the op's ``saved_bytes``).  Checkpointed inside
(:mod:`memsaving.tf.loop_checkpoints`), the forward loop saves nothing and
its gradient holds one stored state every k iterations and one chunk of k
iterations run again: memory the gradient allocates while it runs, its
``checkpointed_grad_temp_bytes``, measured by the profiler.  Plans of the
modes that checkpoint loops (:func:`memsaving.planners.modes.checkpoints_loops`)
are scored on the model :func:`with_loops_checkpointed` gives.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List

from memsaving.model.graph import GraphModel


def checkpointable_loops(model: GraphModel) -> List[int]:
    """Indices of the loops in ``model`` worth checkpointing inside: their
    gradient can be, and the profiler measured it holding less than what
    TensorFlow's forward loop saves for it (and its gradient holds).

    A loop whose iterations save little (a ``tf.scan`` of a small tanh
    cell) gains nothing: its checkpointed gradient's stored states and the
    gradients of its sequences outweigh what it saves, so it keeps
    TensorFlow's gradient.  Unprofiled loops (nothing measured either way)
    keep it too.

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> checkpointable_loops(chain_model([1024] * 4))
    []
    """
    return [i for i, op in enumerate(model.ops) if op.checkpointed_grad_temp_bytes is not None
            and op.checkpointed_grad_temp_bytes < op.saved_bytes + op.grad_temp_bytes]


def with_loops_checkpointed(model: GraphModel) -> GraphModel:
    """``model`` with its loops' gradients checkpointed inside: they save
    nothing in the forward pass, and their gradients hold what the profiler
    measured of the checkpointed gradient (and take its time, when
    measured).  Plain ``tf.gradients`` keeps TensorFlow's loop gradient: the
    new model's ``unfolded`` is the model plain figures are simulated on.

    Returns ``model`` itself when it has no such loop.

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> model = chain_model([1024] * 4)
    >>> with_loops_checkpointed(model) is model
    True
    """
    loops = checkpointable_loops(model)
    if not loops:
        return model
    ops = list(model.ops)
    for i in loops:
        op = ops[i]
        ops[i] = replace(op, saved_bytes=0, grad_temp_bytes=op.checkpointed_grad_temp_bytes or 0,
                         grad_seconds=op.checkpointed_grad_seconds if op.checkpointed_grad_seconds is not None
                         else op.grad_seconds)
    return replace(model, ops=ops, unfolded=model.unfolded or model)
