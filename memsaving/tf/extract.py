"""Building the neutral :class:`~memsaving.model.graph.GraphModel` from a TF graph.

This module and :mod:`memsaving.tf.rewrite` are the only ones that read
TensorFlow graphs for planning.  Sizes come from static shapes (an unknown
dimension, usually the batch, is replaced by ``batch_size``); compute costs
are FLOP estimates; what each op's gradient reads comes from a table of the
gradient functions TensorFlow registers, with "all float inputs and outputs"
as the safe default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import numpy as np
import tensorflow as tf

from memsaving.tf.forward import ForwardGraph, is_copyable, is_trainable, topological_order
from memsaving.tf.loop_checkpoints import can_checkpoint
from memsaving.model.buffers import Action, memory_replay
from memsaving.model.graph import UPDATE_FACTOR, GraphModel, OpInfo, ProfileSummary, TensorInfo
from memsaving.tf.rows import row_splits, static_shape

EXTERNAL_OPS = frozenset({"Placeholder", "Const", "VarHandleOp", "NoOp"})
ALIASING_OPS = frozenset({"ReadVariableOp", "Identity", "IdentityN", "Snapshot", "StopGradient", "Reshape",
                          "ExpandDims", "Squeeze"})
"""Ops whose output shares its input's buffer (no new memory); IdentityN's
k-th output shares its k-th input's."""

GRAD_READS_OUTPUTS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt",
    "Reciprocal", "Softmax",
})
GRAD_READS_INPUTS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
    "Conv3D", "DepthwiseConv2dNative", "Mul", "Square", "Sin", "Cos", "Log",
    "Softplus", "Abs", "Pow", "RealDiv", "Div", "LeakyRelu", "SquaredDifference",
    "Maximum", "Minimum", "GatherV2", "ResourceGather", "Erf", "Erfc",
})
GRAD_READS_NOTHING = frozenset({
    "Add", "AddV2", "Sub", "BiasAdd", "Sum", "Mean", "Reshape", "Identity", "Neg",
    "AddN", "ConcatV2", "Split", "SplitV", "Unpack", "Pack", "Transpose", "ExpandDims",
    "Squeeze", "StopGradient", "Cast", "StridedSlice", "Slice", "Pad", "ReadVariableOp",
    "Snapshot", "Shape", "IdentityN",
})
GRAD_READS_BY_INPUT = {
    **{op: ((1,), (0,)) for op in (
        "Mul", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
        "Conv2D", "Conv3D", "DepthwiseConv2dNative")},
    "RealDiv": ((1,), (0, 1)),
    "Div": ((1,), (0, 1)),
}
"""Two-operand ops whose gradient with respect to input ``k`` reads only
the inputs at ``GRAD_READS_BY_INPUT[type][k]``
(``d(a*b)/da`` reads ``b``).  The gradient of an input that needs none (a
constant, the data fed in, a ``StopGradient``) is built by tf.gradients but
read by nothing, so the function runtime prunes it, and an operand only it
reads is freed after the forward pass: Gelu's ``0.5 * x`` does not hold
``x``, nor attention's ``scores * scale`` the scores."""
SOFTMAX_CROSS_ENTROPIES = frozenset({"SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"})
"""Ops whose gradient with respect to the logits reads the softmax they
output for it, not the logits (:func:`_grad_reads`)."""
GRAD_READS_CONDITION = frozenset({"SelectV2"})
"""Ops whose gradient routes the incoming gradient by their first input (a
boolean mask) and reads no value (the shapes it asks for are folded to
constants when known).  Not v1 ``Select``: its gradient builds
``zeros_like`` of the selected input, which holds that input."""
FORWARDS_INPUT_OPS = frozenset({
    "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Exp", "Log", "Neg", "Sqrt", "Rsqrt",
    "Square", "Abs", "Sin", "Cos", "Reciprocal", "Softplus", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div",
    "Maximum", "Minimum", "SquaredDifference", "Pow", "BiasAdd", "AddN",
    # the softmax cross-entropies write the softmax they keep for their
    # gradient (their second output) into the logits' buffer when nothing
    # else reads the logits
    "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits",
})
"""Elementwise ops whose kernels, and whose gradients' kernels, write into
an input's buffer when nothing else reads it (so ``tanh(matmul(x, w))``
holds one buffer, not two).  README, "Swapping to host memory", compares
the prediction this gives with the measured peak of a swapping MLP."""
MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
CONV_OPS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative"})


def _elements(shape: tf.TensorShape, batch_size: int) -> int:
    if shape.rank is None:
        return batch_size
    n = 1
    for d in shape.as_list():
        n *= batch_size if d is None else d
    return int(n)


NON_NUMERIC_DTYPES = frozenset({tf.resource, tf.variant, tf.string})
"""Dtypes whose values are not arrays of numbers: a static shape cannot
size them, and no device copy moves them (:attr:`TensorInfo.numeric`)."""


def is_numeric(t: tf.Tensor) -> bool:
    """True when ``t`` holds an array of numbers or bools (not a variant
    TensorList, a resource handle or a string).

    Examples
    --------
    >>> is_numeric(tf.constant([1.0])), is_numeric(tf.constant([True])), is_numeric(tf.constant(["a"]))
    (True, True, False)
    """
    return t.dtype.base_dtype not in NON_NUMERIC_DTYPES


def tensor_bytes(t: tf.Tensor, batch_size: int = 1) -> int:
    """Bytes of ``t`` from its static shape (unknown dimensions = ``batch_size``)."""
    if not is_numeric(t):
        return 0
    return _elements(t.shape, batch_size) * t.dtype.size


def op_flops(op: tf.Operation, batch_size: int = 1) -> float:
    """A FLOP estimate: 2*M*N*K for matmuls, 2*out*window*in_channels for
    convolutions, one per output element otherwise."""
    out = sum(_elements(t.shape, batch_size) for t in op.outputs) or 1
    if op.type in MATMUL_OPS and len(op.inputs) >= 2:
        a = op.inputs[0].shape
        transpose_a = False
        try:
            transpose_a = bool(op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x"))
        except (ValueError, TypeError):
            pass
        if a.rank:
            dims = a.as_list()
            k = dims[-2] if transpose_a else dims[-1]
            return 2.0 * out * (k or batch_size)
    if op.type in CONV_OPS and len(op.inputs) >= 2:
        kernel = op.inputs[1].shape
        if kernel.rank and None not in kernel.as_list():
            dims = kernel.as_list()
            window = int(np.prod(dims[:-2]))
            cin = dims[-2] if op.type != "DepthwiseConv2dNative" else 1
            return 2.0 * out * window * cin
    return float(out)


@dataclass(frozen=True)
class CustomGradient:
    """What the gradient of a ``tf.custom_gradient`` op does, found by tracing it.

    ``tf.custom_gradient`` (``tf.nn.silu``, Keras' swish) wraps its results
    and arguments in an IdentityN whose gradient is a Python closure.  The
    closure reads whatever forward tensors it captured, not the IdentityN's
    inputs or outputs (silu's reads its argument and recomputes the
    sigmoid), and returns None for the results, so the ops that computed
    them are never differentiated.

    Attributes
    ----------
    reads : tuple of tf.Tensor
        the tensors of the op's graph the gradient reads.
    stopped : frozenset of int
        positions of the inputs it returns no gradient for.
    temp_bytes : int
        the traced gradient's intermediates at their peak, beyond
        its results (silu's recomputed sigmoid and products), counted with
        the simulator's rules; IdentityN is not profiled (its gradient
        cannot run apart from the graph it captured).
    """

    reads: Tuple[tf.Tensor, ...]
    stopped: FrozenSet[int]
    temp_bytes: int = 0


def has_custom_gradient(op: tf.Operation) -> bool:
    """An IdentityN made by ``tf.custom_gradient`` (its gradient overridden)."""
    if op.type != "IdentityN" or not op.inputs:
        return False
    try:
        return bool(op.get_attr("_gradient_op_type"))
    except ValueError:
        return False


def custom_gradient(op: tf.Operation, batch_size: int = 1, wanted=lambda t: True) -> Optional[CustomGradient]:
    """Trace the gradient of custom-gradient op ``op`` in a throw-away graph.

    The tensors it captures from ``op``'s graph are what the real gradient
    will read; nothing is added to ``op``'s graph.  None when ``op`` has no
    custom gradient or the gradient cannot be traced alone.
    """
    if not has_custom_gradient(op):
        return None
    from tensorflow.python.framework import func_graph, ops as tf_ops  # pylint: disable=import-outside-toplevel

    grad_fn = tf_ops.get_gradient_function(op)
    if grad_fn is None:
        return None
    probe = func_graph.FuncGraph("memsaving_custom_gradient_probe")
    try:
        with probe.as_default():
            upstream = [tf.compat.v1.placeholder(t.dtype, t.shape) for t in op.outputs]
            results = grad_fn(op, *upstream)
    except Exception:  # pylint: disable=broad-except  # fall back to the default rule
        return None
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    stopped = frozenset(k for k, g in enumerate(results) if g is None and k < len(op.inputs))
    reads = tuple(external for external, _ in probe.captures if isinstance(external, tf.Tensor)
                  and not isinstance(external, tf.__internal__.EagerTensor) and external.graph is op.graph)
    used = [g for k, g in enumerate(results[:len(op.inputs)])
            if isinstance(g, tf.Tensor) and wanted(op.inputs[k])]
    values = {internal.ref(): tf.get_static_value(external) for external, internal in probe.captures
              if isinstance(external, tf.Tensor) and isinstance(internal, tf.Tensor)}
    return CustomGradient(reads, stopped, _traced_temp_bytes(used, batch_size, values))


def _traced_temp_bytes(results: Sequence[tf.Tensor], batch_size: int, values: Optional[dict] = None) -> int:
    """Peak bytes of the intermediates computing ``results`` (a traced
    gradient), beyond the results, by the simulator's rules (a buffer dies
    after its last reader; elementwise kernels write into dying inputs).
    Only the ops the results depend on count: the others are pruned.

    ``values``: the static values of the trace's captured tensors (by
    ``ref()``), so that a product with a constant one is a view of its
    other operand, as Grappler's constant folding makes it: silu's gradient
    computes ``beta * x`` twice with ``beta`` 1, and counting both products
    put its temporary at two activations where the step holds one (the
    recomputed sigmoid and ``1 - sigmoid``; the result is written into one
    of them): a depthwise net's budget plan was predicted at 64.6 MiB and
    measured 60.7."""
    ordered = _ancestors_in_order([g.op for g in results], follow_control=False)
    needed = set(ordered)
    actions = []
    for op in ordered:
        reads = [t.ref() for t in op.inputs if t.op in needed]
        view = op.type in ALIASING_OPS or _times_one(op, values or {})
        writes = [(t.ref(), 0 if view else tensor_bytes(t, batch_size)) for t in op.outputs]
        actions.append(Action(op.name, reads, writes, forwards_buffers=op.type in FORWARDS_INPUT_OPS))
    kept = {g.ref() for g in results}
    _, peak = memory_replay(actions, kept)
    return max(peak - sum(tensor_bytes(g, batch_size) for g in results), 0)


def _times_one(op: tf.Operation, values: dict) -> bool:
    """A ``Mul`` of a tensor by a constant one (scalar or all ones) no larger
    than the product: Grappler's constant folding replaces it by the other
    operand.  ``values``: static values of captured tensors (by ``ref()``)."""
    if op.type != "Mul" or len(op.inputs) != 2:
        return False
    for k, operand in enumerate(op.inputs):
        value = values.get(operand.ref())
        if value is None:
            value = tf.get_static_value(operand)
        other, product = op.inputs[1 - k].shape, op.outputs[0].shape
        same_shape = other.rank is not None and product.rank is not None and other.as_list() == product.as_list()
        if value is not None and same_shape and np.all(np.asarray(value) == 1):
            return True
    return False


def _ancestors_in_order(roots: Sequence[tf.Operation], follow_control: bool) -> List[tf.Operation]:
    """``roots`` and the ops they read, back to :data:`EXTERNAL_OPS` (not
    included), in topological order; through control inputs too when
    ``follow_control``."""
    found: Set[tf.Operation] = set()
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op in found or op.type in EXTERNAL_OPS:
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs)
        if follow_control:
            stack.extend(op.control_inputs)
    return topological_order(sorted(found, key=lambda o: o._id))  # pylint: disable=protected-access


def _stopped_tensors(ops: Sequence[tf.Operation], customs: Dict[tf.Operation, CustomGradient]) -> Set[int]:
    """ids of the tensors no gradient reaches: every consumer among ``ops``
    is a custom-gradient op returning None for it (a custom gradient's
    results, which tf.gradients never differentiates)."""
    members = set(ops)
    stopped: Set[int] = set()
    for op, info in customs.items():
        for k in info.stopped:
            t = op.inputs[k]
            uses = [(c, i) for c in t.consumers() if c in members for i, s in enumerate(c.inputs) if s is t]
            if all(c in customs and i in customs[c].stopped for c, i in uses):
                stopped.add(id(t))
    return stopped


def _differentiated(ops: Sequence[tf.Operation], ys: Sequence[tf.Tensor], flows) -> Set[tf.Operation]:
    """The ops whose gradient runs: an output receives a gradient from ``ys``
    (``flows(t)``: gradients flow through tensor ``t``)."""
    receiving = {id(y) for y in ys if flows(y)}
    found = set()
    for op in reversed(ops):
        if any(id(t) in receiving for t in op.outputs):
            found.add(op)
            receiving.update(id(t) for t in op.inputs if flows(t))
    return found


def _grad_reads(op: tf.Operation, needed: Sequence[bool]) -> List[tf.Tensor]:
    """The tensors ``op``'s gradient function reads when the gradients of the
    inputs flagged in ``needed`` are used (the others are pruned)."""
    by_input = _operand_rule(op)
    if by_input is not None:
        positions = sorted({p for k, used in enumerate(needed) if used for p in by_input[k]})
        read = [op.inputs[p] for p in positions]
        return [t for t in read if is_trainable(t) and t.dtype != tf.resource]
    if op.type in SOFTMAX_CROSS_ENTROPIES:
        # the softmax kept for the gradient (second output); the logits only
        # for the labels' gradient (log-softmax), which sparse labels lack
        labels_gradient = op.type == "SoftmaxCrossEntropyWithLogits" and len(needed) > 1 and needed[1]
        read = [op.outputs[1]] + ([op.inputs[0]] if labels_gradient else [])
        return [t for t in read if is_trainable(t)]
    if op.type in GRAD_READS_NOTHING or _constant_power(op):
        return []  # a constant power's gradient reads a factor made in advance: _precomputed_factor
    if op.type in GRAD_READS_CONDITION:
        return [op.inputs[0]]
    if op.type in GRAD_READS_OUTPUTS:
        return [t for t in op.outputs if is_trainable(t)]
    if op.type in GRAD_READS_INPUTS:
        return [t for t in op.inputs if is_trainable(t) and t.dtype != tf.resource]
    return [t for t in list(op.inputs) + list(op.outputs) if is_trainable(t) and t.dtype != tf.resource]


def _profiled_reads(op: tf.Operation, positions: Tuple[Tuple[int, ...], Tuple[int, ...]]) -> List[tf.Tensor]:
    """The inputs and outputs of ``op`` its profiled gradient read
    (:attr:`memsaving.tf.profile_cache.OpProfile.grad_reads`): for an op
    that building its gradient gave extra outputs, what the gradient needs
    beyond them (its ``saved_bytes``).  Before, a grouped convolution
    Keras compiles with XLA was taken to read its input and output too,
    which the step had freed: a budget plan predicted 36.6 MiB, measured 29.6."""
    inputs, outputs = positions
    read = [op.inputs[k] for k in inputs if k < len(op.inputs)] + \
        [op.outputs[k] for k in outputs if k < len(op.outputs)]
    return [t for t in read if is_trainable(t) and t.dtype != tf.resource]


def _operand_rule(op: tf.Operation) -> Optional[Tuple[Tuple[int, ...], ...]]:
    """``op``'s entry of :data:`GRAD_READS_BY_INPUT` when it applies (the
    op has that many inputs), else None."""
    rule = GRAD_READS_BY_INPUT.get(op.type)
    return rule if rule is not None and len(rule) == len(op.inputs) else None


def _reads_by_input(op: tf.Operation, needed: Sequence[bool], ids: Dict[int, int]) -> Tuple[Tuple[int, ...], ...]:
    """Per input of ``op``, the tensor ids its own gradient kernel reads
    (empty for an input whose gradient is not needed)."""
    by_input = []
    for k, used in enumerate(needed):
        only_k = [j == k for j in range(len(needed))]
        read = _grad_reads(op, only_k) if used else []
        by_input.append(tuple(dict.fromkeys(ids[id(t)] for t in read if id(t) in ids)))
    return tuple(by_input)


def _constant_power(op: tf.Operation) -> bool:
    """A ``Pow`` whose exponent is a constant (tanh-approximated Gelu's ``x ** 3``)."""
    return op.type == "Pow" and len(op.inputs) == 2 and tf.get_static_value(op.inputs[1]) is not None


def _cube(op: tf.Operation) -> bool:
    """``x ** 3``, which Grappler's arithmetic optimizer computes as
    ``x * square(x)``: the square is a buffer of ``x``'s size held while
    the product runs (its forward temporary)."""
    return _constant_power(op) and bool(np.all(tf.get_static_value(op.inputs[1]) == 3))


def _scaled_softmax(op: tf.Operation) -> bool:
    """A Softmax of ``scores * c`` (``c`` a constant: attention's scaling)
    whose product nothing else reads."""
    if op.type != "Softmax" or len(op.inputs) != 1:
        return False
    product = op.inputs[0].op
    if product.type != "Mul" or len(product.inputs) != 2 or len(op.inputs[0].consumers()) != 1:
        return False
    return any(tf.get_static_value(t) is not None for t in product.inputs)


def _precomputed_factor(op: tf.Operation, batch_size: int) -> int:
    """Bytes of a factor of ``op``'s gradient made from forward tensors
    alone, which the executor computes as soon as they exist, in the forward
    pass or the recomputation, and holds until the gradient reaches the op.

    A constant power's gradient is ``g * (c * x ** (c - 1))``; a scaled
    softmax's gradient into the scores is ``((g - sum(g * s)) * s) * c``,
    which Grappler's constant push-down rewrites to ``(g - sum(g * s)) *
    (s * c)``.  Each holds one buffer of the op's size."""
    if _constant_power(op):
        return tensor_bytes(op.inputs[0], batch_size)
    if _scaled_softmax(op):
        return tensor_bytes(op.outputs[0], batch_size)
    return 0


PROFILE_MODES = ("off", "cached", "measure")


FOLDED_GRADIENT_OPS = frozenset({
    "Mean", "Sum", "Reshape", "Identity", "Snapshot", "ExpandDims", "Squeeze", "AddV2", "Add", "Sub", "Neg",
    "Cast", "AddN",
})
"""Ops whose gradient is a fixed linear map of the incoming gradient, read
from no tensor of the step (shapes aside): a constant incoming gradient
gives constant input gradients, which Grappler's constant folding computes
once."""
MAX_FOLDED_BYTES = 10 * 2 ** 20
"""Grappler's constant folding makes no constant larger than 10 MiB."""


def _folded_gradients(ops: Sequence[tf.Operation], differentiated: Set[tf.Operation], ys: Sequence[tf.Tensor],
                      needs_gradient) -> Set[int]:
    """ids of the tensors whose gradient Grappler folds into a constant.

    ``tf.gradients`` seeds each of ``ys`` with ones; through ops of
    :data:`FOLDED_GRADIENT_OPS` (and products with a constant) the gradient
    stays a function of that seed and of static shapes alone, so constant
    folding replaces it with a Const node whose tensor the function keeps
    for its lifetime: a mean-squared loss's gradient with respect to the
    squares is a constant of their size.  Only fully defined shapes of at
    most :data:`MAX_FOLDED_BYTES` are folded."""
    seeded = {id(y) for y in ys}
    contributed: Set[int] = set()  # tensors some differentiated consumer gives a gradient
    varying: Set[int] = set()  # ... of which at least one is not a folded constant

    def constant(t: tf.Tensor) -> bool:
        return (id(t) in seeded or id(t) in contributed) and id(t) not in varying

    def foldable(t: tf.Tensor) -> bool:
        return t.shape.is_fully_defined() and t.shape.num_elements() * t.dtype.size <= MAX_FOLDED_BYTES

    for op in reversed(ops):
        if op not in differentiated:
            continue
        outputs = [t for t in op.outputs if id(t) in seeded or id(t) in contributed]
        passes = op.type in FOLDED_GRADIENT_OPS or (
            op.type in ("Mul", "RealDiv") and len(op.inputs) == 2
            and any(tf.get_static_value(t) is not None for t in op.inputs))
        folded = passes and bool(outputs) and all(constant(t) for t in outputs)
        for t in op.inputs:
            if needs_gradient(t) and tf.get_static_value(t) is None:
                contributed.add(id(t))
                if not (folded and foldable(t)):  # an unfolded gradient feeds no folding further back
                    varying.add(id(t))
    return contributed - varying


def graph_model(fwd: ForwardGraph, batch_size: int = 1, resident_bytes: Optional[int] = None,
                profile: str = "off", seeded_with_ones: bool = True, in_use_bytes: int = 0,
                rows: bool = False, update_factor: float = UPDATE_FACTOR) -> GraphModel:
    """The neutral model of the step that computes ``fwd.ys``.

    Parameters
    ----------
    fwd : ForwardGraph
        the forward graph (defines which ops are differentiated).
    batch_size : int
        replaces unknown dimensions in sizes and costs.
    resident_bytes : int, optional
        memory in use before the step; default: the bytes of the
        variables and inputs the step reads and of its folded gradient
        constants, or, when larger, ``in_use_bytes`` plus those constants.
    in_use_bytes : int
        what the device's allocator holds while planning
        (:func:`memsaving.tf.measure.bytes_in_use`): the step's variables and
        inputs as the allocator places them (rounded, fragmented) and
        whatever else is held, all of which the measured peak includes.
    profile : str
        kernel temporaries and run times (:mod:`memsaving.tf.profiles`):
        ``"measure"`` measures the op signatures the cache lacks,
        ``"cached"`` uses only cached profiles, ``"off"`` none.
    seeded_with_ones : bool
        the gradient starts from ``tf.gradients``' default
        seed (no ``grad_ys``), so gradients of it that read no data are
        constants (:func:`_folded_gradients`).
    rows : bool
        also record each tensor's static shape and the rows each op
        can be cut into (:func:`memsaving.tf.rows.row_splits`), which
        splitting needs (left out otherwise: it costs time on every trace).
    update_factor : float
        the optimizer update's temporaries per byte of a weight gradient
        (:attr:`memsaving.model.graph.GraphModel.update_factor`).
    """
    if profile not in PROFILE_MODES:
        raise ValueError(f"profile={profile!r}: use one of {PROFILE_MODES}")
    ops = _ancestors_in_order([y.op for y in fwd.ys], follow_control=True)
    customs = {op: info for op in ops if fwd.contains_op(op)
               for info in [custom_gradient(op, batch_size, fwd.contains_tensor)] if info is not None}
    stopped = _stopped_tensors(ops, customs)

    def flows(t: tf.Tensor) -> bool:
        return is_trainable(t) and id(t) not in stopped

    differentiated = _differentiated([op for op in ops if fwd.contains_op(op)], fwd.ys, flows)
    x_ids = {id(x) for x in fwd.xs}

    def needs_gradient(t: tf.Tensor) -> bool:
        """tf.gradients uses the gradient of ``t``: it is one of ``xs`` or
        made by a differentiated op (the others' gradients are pruned)."""
        return flows(t) and (id(t) in x_ids or t.op in differentiated)

    # an x's gradient is a result the simulator already counts
    folded = _folded_gradients(ops, differentiated, fwd.ys, needs_gradient) - x_ids if seeded_with_ones else set()
    ids: Dict[int, int] = {}
    tensors: Dict[int, TensorInfo] = {}
    variants: Set[int] = set()
    resident = folded_bytes = 0  # variables and inputs; gradient constants the first run keeps

    def tensor_id(t: tf.Tensor, producer: int) -> int:
        nonlocal resident, folded_bytes
        key = id(t)
        if key not in ids:
            ids[key] = len(ids)
            nbytes = tensor_bytes(t, batch_size)
            value_bytes = None
            if producer >= 0 and ops[producer].type in ALIASING_OPS:
                nbytes, value_bytes = 0, nbytes
            if producer < 0:
                external = _external_bytes(t, batch_size)
                resident += external
                if t.dtype == tf.resource:
                    value_bytes = external
            constant = producer < 0 and (t.op.type in ("Const", "VarHandleOp") or t.dtype == tf.resource)
            folds = key in folded
            if folds:
                folded_bytes += tensor_bytes(t, batch_size)
            shape = static_shape(t, batch_size) if rows else None
            tensors[ids[key]] = TensorInfo(t.name, nbytes, producer, flows(t), constant, value_bytes, folds, shape,
                                           numeric=is_numeric(t))
            if t.dtype == tf.variant:
                variants.add(ids[key])
        return ids[key]

    position = {op: i for i, op in enumerate(ops)}
    run = None
    if profile != "off":
        from memsaving.tf.profiles import profile_ops  # pylint: disable=import-outside-toplevel

        run = profile_ops(ops, batch_size, measure=profile == "measure")
    measured = run.profiles if run is not None else {}
    infos = []
    for i, op in enumerate(ops):
        inputs = tuple(tensor_id(t, position.get(t.op, -1)) for t in op.inputs)
        outputs = tuple(tensor_id(t, i) for t in op.outputs)
        forward = fwd.contains_op(op)
        # only ops a gradient reaches are differentiated: the others' gradients never run
        reads, by_input = (), ()
        if op in differentiated:
            needed = [needs_gradient(t) for t in op.inputs]
            profiled = measured.get(op.name)
            if op in customs:
                read = list(customs[op].reads)
            elif profiled is not None and profiled.grad_reads is not None:
                read = _profiled_reads(op, profiled.grad_reads)
            else:
                read = _grad_reads(op, needed)
            reads = tuple(dict.fromkeys(ids[id(t)] for t in read if id(t) in ids))
            if op not in customs and _operand_rule(op) is not None:
                by_input = _reads_by_input(op, needed, ids)
        info = OpInfo(
            name=op.name, type=op.type, inputs=inputs, outputs=outputs,
            forward=forward, copyable=is_copyable(op),
            grad_reads=reads, input_grad_reads=by_input, cost=op_flops(op, batch_size),
            forwards_input=op.type in FORWARDS_INPUT_OPS or op.type in ALIASING_OPS,
            grad_temp_bytes=customs[op].temp_bytes if op in customs else 0,
            checkpointed_grad_temp_bytes=0 if op in differentiated and can_checkpoint(op) else None,
        )
        if op.name in measured:
            info = _with_profile(info, measured[op.name], tensors, variants)
        factor = _precomputed_factor(op, batch_size) if op in differentiated and op not in customs else 0
        if factor:
            info = replace(info, saved_bytes=info.saved_bytes + factor)
        if rows:
            info = replace(info, row_splits=row_splits(op, batch_size))
        if _cube(op):
            square = tensor_bytes(op.inputs[0], batch_size)
            info = replace(info, temp_bytes=max(info.temp_bytes, square))
        infos.append(info)
    xs = [tensor_id(x, position.get(x.op, -1)) for x in fwd.xs]
    ys = [tensor_id(y, position.get(y.op, -1)) for y in fwd.ys]
    summary = None
    if run is not None:
        summary = ProfileSummary(profile, run.measured, run.cached, run.missing, run.seconds, len(measured))
    if resident_bytes is None:
        resident_bytes = max(resident, in_use_bytes) + folded_bytes
    return GraphModel(infos, tensors, xs, ys, resident_bytes,
                      separate_result_kernels=True, profile=summary,
                      ready_gradients_early=_parallel_executor(), update_factor=update_factor)


def _parallel_executor() -> bool:
    """Whether TensorFlow may run several kernels at once (0: its default
    pool, one thread per core; the tests pin it to 1)."""
    return tf.config.threading.get_inter_op_parallelism_threads() != 1


def _with_profile(info: OpInfo, profile, tensors: Dict[int, TensorInfo], variants: Set[int]) -> OpInfo:
    """``info`` with its measured temporaries and times; variant outputs
    (TensorLists), which static shapes cannot size, get the bytes they held
    when measured."""
    for t, held in zip(info.outputs, profile.output_bytes):
        if t in variants and held > 0 and tensors[t].nbytes == 0:
            tensors[t] = replace(tensors[t], nbytes=held)
    checkpointed = info.checkpointed_grad_temp_bytes
    if checkpointed is not None and profile.checkpointed_grad_temp_bytes is not None:
        checkpointed = profile.checkpointed_grad_temp_bytes
    return replace(info, temp_bytes=profile.temp_bytes, grad_temp_bytes=profile.grad_temp_bytes,
                   saved_bytes=profile.saved_bytes, seconds=profile.seconds, grad_seconds=profile.grad_seconds,
                   checkpointed_grad_temp_bytes=checkpointed, checkpointed_grad_seconds=profile.checkpointed_grad_seconds)


def _external_bytes(t: tf.Tensor, batch_size: int) -> int:
    """Bytes behind an input of the step: a variable's value for a handle."""
    if t.dtype == tf.resource:
        from tensorflow.python.ops import handle_data_util  # pylint: disable=import-outside-toplevel

        data = handle_data_util.get_resource_handle_data(t)
        if data is not None and data.is_set and data.shape_and_type:
            st = data.shape_and_type[0]
            shape = tf.TensorShape(st.shape)
            return _elements(shape, batch_size) * tf.as_dtype(st.dtype).size
        return 0
    return tensor_bytes(t, batch_size)


def op_indices(model: GraphModel, tensors: Sequence[tf.Tensor]) -> List[int]:
    """Indices in ``model`` of the ops producing ``tensors``."""
    index = model.op_index()
    return sorted({index[t.op.name] for t in tensors if t.op.name in index})
