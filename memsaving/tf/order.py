"""Run a unit's gradient ops in the order the simulator scored.

The simulator differentiates a unit's forward ops one at a time, last first,
and each op's gradient makes all of its input gradients (data and weight) in
one action.  TensorFlow's executor is free to do otherwise, and does: it runs
ready ops newest first, so it follows the chain of data gradients down the
unit and leaves the weight gradients (and, while they wait, the activations
and incoming gradients they read) for the end of the unit; on parallel
branches it holds every branch's weight gradients at once.  The measured peak
then depends on thread timing and runs above the prediction.

:func:`chain_gradient_groups` takes the ops one ``tf.gradients`` call made,
groups them by the forward op whose gradient function made them (the
``<op name>_grad`` name scope), and makes the first ops of each group wait
for the last ops of the group before, in the simulator's order.  Only control
edges are added: values, and so gradients, are unchanged.

Two kinds of op are left out of the edges.  Bias gradients
(``BiasAddGrad``), and the ops that reshape them on their way to the bias
(Keras reshapes and squeezes it), are never waited on: oneDNN's graph pass
fuses a bias gradient into the filter gradient of the convolution before it,
which is in a later group, and an edge from the bias gradient to that group
would then be an edge from the fused op to itself (a cycle).  And some ops
never wait (:data:`NEVER_WAITS`): edges on them would change which kernels
and rewrites TensorFlow picks, and so the rounding.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set

import tensorflow as tf

from memsaving.tf.aggregation import producing_ops

NOT_WAITED_ON = frozenset({"BiasAddGrad"})
"""Op types whose completion no later group waits for (see the module docstring)."""

METADATA = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank"})
"""Op types that make constants or read only shapes: not work to order."""

NEVER_WAITS = METADATA | {"BiasAddGrad", "Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                          "DepthwiseConv2dNativeBackpropFilter"}
"""Op types given no control input.  Constants and shapes allocate nothing
worth ordering, and Grappler folds or rewrites the ops they feed only while
they carry no control edge; the bias-gradient fusion partners are fused by
oneDNN's graph pass only without control edges.  Either change would make the
gradient round differently from ``tf.gradients`` in half precision."""


def gradient_groups(made: Sequence[tf.Operation], forward_ops: Sequence[tf.Operation]) -> List[List[tf.Operation]]:
    """The ops in ``made`` grouped by the op of ``forward_ops`` they differentiate.

    Groups come in the order of ``forward_ops``; ops of ``made`` outside
    every group (sums of gradient contributions, zeros for unconnected
    inputs) are left out.  An op belongs to forward op ``F`` when its name
    contains the scope ``F.name + "_grad/"`` that ``tf.gradients`` opens
    around ``F``'s gradient function.
    """
    index: Dict[str, int] = {op.name: n for n, op in enumerate(forward_ops)}
    groups: List[List[tf.Operation]] = [[] for _ in forward_ops]
    for op in made:
        owner = _owner(op.name, index)
        if owner is not None:
            groups[owner].append(op)
    return [group for group in groups if group]


def _owner(name: str, index: Dict[str, int]):
    """Index of the forward op whose ``_grad`` scope ``name`` lies in, or None."""
    end = name.find("_grad/")
    while end >= 0:
        start = name.find("/")
        while 0 <= start < end:
            owner = index.get(name[start + 1:end])
            if owner is not None:
                return owner
            start = name.find("/", start + 1)
        end = name.find("_grad/", end + 1)
    return None


def chain_gradient_groups(groups: Sequence[Sequence[tf.Operation]],
                          first_wait_for: Sequence[tf.Operation] = (),
                          useful: Optional[Set[tf.Operation]] = None) -> int:
    """Make each group's first ops wait for the previous group's last ops.

    A group's *first* ops read nothing made inside the group (constants and
    shapes aside); its *last* ops feed nothing inside it.  The first group's
    first ops wait for ``first_wait_for``.  When a group has no last op that
    can be waited on (only bias gradients), the next group waits for what
    this one waited for.  With ``useful`` (:func:`feeding_results`), ops
    outside it are never waited on.  Returns the number of control edges
    added.
    """
    added = 0
    waited: List[tf.Operation] = list(first_wait_for)
    unwaitable = _after_unwaitable([op for group in groups for op in group])
    for group in groups:
        members = set(group)
        if waited:
            for op in group:
                if op.type not in NEVER_WAITS and not any(t.op in members and t.op.type not in METADATA
                                                          for t in op.inputs):
                    missing = [w for w in waited if w not in op.control_inputs and w is not op]
                    if missing:
                        op._add_control_inputs(missing)  # pylint: disable=protected-access
                        added += len(missing)
        last = [op for op in group if op not in unwaitable and (useful is None or op in useful)
                and not any(c in members for t in op.outputs for c in t.consumers())]
        if last:
            waited = last
    return added


def feeding_results(made: Sequence[tf.Operation], results: Sequence) -> Set[tf.Operation]:
    """The ops of ``made`` that the gradients ``results`` are computed from.

    A gradient function makes the gradients of all its op's inputs, also of
    those no gradient is asked for (``x * 0.5``'s gradient with respect to
    the constant).  Nothing reads them, so the function runtime prunes them
    and the activation only they read is freed after the forward pass.  A
    control edge from such an op to the next group would keep it, and the
    activation it reads, alive."""
    members = set(made)
    stack = [op for g in results for op in producing_ops(g) if op in members]
    found: Set[tf.Operation] = set()
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs if t.op in members)
        stack.extend(c for c in op.control_inputs if c in members)
    return found


def _after_unwaitable(ops: Sequence[tf.Operation]) -> set:
    """The ops of ``ops`` of a type in :data:`NOT_WAITED_ON`, and those
    among ``ops`` that read them, directly or through each other."""
    members = set(ops)
    found = set()
    stack = [op for op in ops if op.type in NOT_WAITED_ON]
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers() if c in members)
    return found
