"""Which TensorFlow ops can be computed in pieces of rows, and how.

An op is *row-wise* for ``rows`` rows when row ``r`` of each of its outputs
(the first dimensions of the output, whose sizes multiply to ``rows``)
depends only on row ``r`` of some of its inputs (the *row inputs*) and on
its other inputs whole: elementwise ops (with weights or biases
broadcast), products with a weight matrix, softmax and cross-entropy over
the last axis, reductions over the last axes, reshapes that keep the rows
in front, convolutions and pooling over the batch, embedding lookups.
:func:`row_splits` gives, for one op, every such ``(rows, row inputs)``
from its static shapes; :mod:`memsaving.model.splitting` finds regions of
such ops on the neutral model, and :mod:`memsaving.tf.split_rewrite` runs
them in pieces.

In a piece, every row tensor has its rows in one first dimension (the
*piece form*, ``[n] + shape[d:]`` for a tensor whose first ``d``
dimensions hold the rows); :func:`piece_op` makes one op of a piece in
that form, adjusting what refers to dimensions (axes, target shapes).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from memsaving.model.splitting import METADATA_OPS, row_dims

UNARY = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Log", "Log1p", "Expm1", "Neg", "Square", "Sqrt",
    "Rsqrt", "Abs", "Reciprocal", "Softplus", "Softsign", "Erf", "Erfc", "Sin", "Cos", "Floor", "Ceil", "Round",
    "Sign", "Cast", "Identity", "Snapshot", "StopGradient", "LeakyRelu", "IsNan", "LogicalNot", "ZerosLike",
    "OnesLike", "PreventGradient",
})
"""Elementwise ops of one data input (output shaped like it)."""
BROADCASTING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow", "SquaredDifference",
    "FloorDiv", "FloorMod", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "SelectV2", "AddN", "BiasAdd",
})
"""Elementwise ops whose inputs broadcast against each other."""
LAST_AXIS = frozenset({"Softmax", "LogSoftmax"})
"""Ops over the last axis, row by row."""
VIEWS = frozenset({"Reshape", "ExpandDims", "Squeeze"})
"""Ops that only change the shape (emitted as reshapes to the piece's shape)."""
REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin"})
"""Ops reducing over the axes given as their second input."""
BATCH_ONLY = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "AvgPool", "MaxPool3D",
                        "AvgPool3D", "ResizeNearestNeighbor", "ResizeBilinear", "ResizeBicubic"})
"""Ops over whole examples: row-wise along the batch (first) dimension only."""


def static_shape(t: tf.Tensor, batch_size: int) -> Optional[Tuple[int, ...]]:
    """``t``'s shape with unknown dimensions sized ``batch_size`` (None
    for an unknown rank)."""
    if t.shape.rank is None:
        return None
    return tuple(batch_size if d is None else int(d) for d in t.shape.as_list())


def _prefix_products(shape: Sequence[int], limit: int) -> List[int]:
    """The products of the first 1..``limit`` dimensions of ``shape``."""
    found, product = [], 1
    for size in shape[:limit]:
        product *= size
        found.append(product)
    return found


def _constant(t: tf.Tensor, depth: int = 8):
    """``t``'s value when the graph fixes it: what ``tf.get_static_value``
    finds, and small shape arithmetic it does not follow (Keras' upsampling
    packs a reshaped, cast constant into a Tile's multiples)."""
    value = tf.get_static_value(t)
    if value is not None or depth == 0:
        return value
    op = t.op
    if op.type in ("Reshape", "Identity", "Cast", "ExpandDims", "Squeeze", "Snapshot") and op.inputs:
        base = _constant(op.inputs[0], depth - 1)
        if base is None or not t.shape.is_fully_defined():
            return None
        return np.asarray(base).astype(t.dtype.as_numpy_dtype).reshape(t.shape.as_list())
    if op.type == "Pack":
        parts = [_constant(x, depth - 1) for x in op.inputs]
        if any(p is None for p in parts):
            return None
        return np.stack([np.asarray(p) for p in parts], axis=_attr(op, "axis", 0)).astype(t.dtype.as_numpy_dtype)
    return None


def _attr(op: tf.Operation, name: str, default=None):
    try:
        return op.get_attr(name)
    except (ValueError, TypeError):
        return default


def row_splits(op: tf.Operation, batch_size: int = 1) -> Tuple[Tuple[int, Tuple[int, ...]], ...]:
    """Every ``(rows, row input positions)`` ``op`` can be cut into
    (module docstring); empty when it cannot, or when a shape it needs is
    unknown."""
    shapes = [static_shape(t, batch_size) for t in op.inputs]
    outs = [static_shape(t, batch_size) for t in op.outputs]
    if not outs or any(s is None or not s for s in outs):
        return ()
    out = outs[0]
    rank = len(out)
    kind = op.type
    found: Dict[int, Tuple[int, ...]] = {}

    def offer(rows: int, positions: Sequence[int]) -> None:
        if rows > 1 and positions and rows not in found:
            # every output must hold the rows in its first dimensions
            if all(row_dims(s, rows) is not None for s in outs):
                found[rows] = tuple(positions)

    if kind in UNARY and shapes and shapes[0] == out:
        for rows in _prefix_products(out, rank):
            offer(rows, (0,))
    elif kind in BROADCASTING:
        for d in range(1, rank + 1):
            positions = _broadcast_rows(kind, op, shapes, out, d)
            if positions is not None:
                offer(math.prod(out[:d]), positions)
    elif kind in LAST_AXIS and shapes and shapes[0] == out:
        for rows in _prefix_products(out, rank - 1):
            offer(rows, (0,))
    elif kind == "MatMul" and not _attr(op, "transpose_a", False) and len(shapes) == 2:
        offer(out[0], (0,))
    elif kind in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3") and not _attr(op, "adj_x", False):
        for rows, positions in _batch_matmul_rows(shapes, out):
            offer(rows, positions)
    elif kind == "Einsum":
        for rows, positions in _einsum_rows(op, shapes, out):
            offer(rows, positions)
    elif kind in ("SparseSoftmaxCrossEntropyWithLogits",) and len(shapes) == 2:
        offer(out[0], (0, 1))
    elif kind == "SoftmaxCrossEntropyWithLogits" and len(shapes) == 2 and shapes[0] == shapes[1]:
        offer(out[0], (0, 1))
    elif kind in VIEWS and shapes and shapes[0] is not None:
        for rows in set(_prefix_products(shapes[0], len(shapes[0]))) & set(_prefix_products(out, rank)):
            offer(rows, (0,))
    elif kind == "Transpose":
        perm = _constant(op.inputs[1])
        if perm is not None:
            perm = [int(p) for p in perm]
            for d in range(1, rank + 1):
                if perm[:d] == list(range(d)):
                    offer(math.prod(out[:d]), (0,))
    elif kind in REDUCTIONS and len(shapes) == 2 and shapes[0]:
        axes = _axes(op.inputs[1], len(shapes[0]))
        if axes is not None:
            for d in range(1, min(axes, default=len(shapes[0])) + 1):
                offer(math.prod(shapes[0][:d]), (0,))
    elif kind == "ConcatV2":
        axis = _axes(op.inputs[-1], rank)
        if axis is not None:
            data = list(range(len(op.inputs) - 1))
            for d in range(1, min(axis) + 1):
                if all(shapes[k] is not None and shapes[k][:d] == out[:d] for k in data):
                    offer(math.prod(out[:d]), data)
    elif kind in BATCH_ONLY and _attr(op, "data_format", b"NHWC") in (b"NHWC", b"NDHWC", "NHWC", "NDHWC"):
        offer(out[0], (0,))
    elif kind == "Tile" and len(shapes) == 2:
        multiples = _constant(op.inputs[1])
        if multiples is not None:
            for d in range(1, rank + 1):
                if all(int(m) == 1 for m in multiples[:d]):
                    offer(math.prod(out[:d]), (0,))
    elif kind in ("Pad", "PadV2", "MirrorPad") and len(shapes) >= 2:
        paddings = _constant(op.inputs[1])
        if paddings is not None and not paddings[0].any():
            offer(out[0], (0,))  # no padding along the batch
    elif kind == "Conv2DBackpropInput" and _attr(op, "data_format", b"NHWC") in (b"NHWC", "NHWC"):
        offer(out[0], (2,))
    elif kind in ("GatherV2", "ResourceGather") and len(shapes) >= 2 and shapes[1]:
        axis = _constant(op.inputs[2]) if kind == "GatherV2" and len(op.inputs) > 2 else 0
        if axis is not None and int(axis) == 0 and not _attr(op, "batch_dims", 0):
            for rows in _prefix_products(shapes[1], len(shapes[1])):
                offer(rows, (1,))
    elif kind == "OneHot" and shapes and shapes[0] and _attr(op, "axis", -1) in (-1, len(shapes[0])):
        for rows in _prefix_products(shapes[0], len(shapes[0])):
            offer(rows, (0,))
    return tuple(sorted(found.items()))


def _axes(t: tf.Tensor, rank: int) -> Optional[List[int]]:
    """The axes a constant axis input names, made non-negative."""
    value = _constant(t)
    if value is None:
        return None
    values = [int(v) for v in (value.ravel() if hasattr(value, "ravel") else [value])]
    return [v + rank if v < 0 else v for v in values]


def _broadcast_rows(kind: str, op: tf.Operation, shapes, out, d: int) -> Optional[Tuple[int, ...]]:
    """Row inputs of a broadcasting op whose first ``d`` output dimensions
    are rows: inputs shaped like the output in those dimensions; every
    other input must be 1 (or absent) there."""
    if kind == "BiasAdd" and _attr(op, "data_format", b"NHWC") not in (b"NHWC", "NHWC") and d > 1:
        return None
    positions = []
    rank = len(out)
    for k in range(len(shapes)):
        s = shapes[k]
        if s is None:
            return None
        if kind == "BiasAdd" and k == 1:
            if d >= rank:
                return None
            continue  # the bias, broadcast along the last axis
        if len(s) == rank and s[:d] == out[:d]:
            positions.append(k)
        elif len(s) <= rank - d or all(size == 1 for size in s[:len(s) - (rank - d)]):
            continue  # broadcast over the rows
        else:
            return None
    return tuple(positions) if positions else None


def _batch_matmul_rows(shapes, out) -> List[Tuple[int, Tuple[int, ...]]]:
    """Row splits of a batched product ``x @ y``: over every dimension of
    ``x`` but its last when ``y`` is one matrix; over the batch dimensions
    they share otherwise."""
    if len(shapes) != 2 or shapes[0] is None or shapes[1] is None:
        return []
    x, y = shapes
    found = []
    if len(y) == 2:
        for d in range(1, len(out)):
            found.append((math.prod(out[:d]), (0,)))
        return found
    batch = len(out) - 2
    if len(x) != len(out) or len(y) != len(out):
        return []
    for d in range(1, batch + 1):
        if x[:d] == y[:d] == out[:d]:
            found.append((math.prod(out[:d]), (0, 1)))
        elif all(size == 1 for size in y[:d]) and x[:d] == out[:d]:
            found.append((math.prod(out[:d]), (0,)))
    return found


def _einsum_parts(op: tf.Operation) -> Optional[Tuple[List[str], str]]:
    equation = _attr(op, "equation")
    if isinstance(equation, bytes):
        equation = equation.decode()
    if not equation or "." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    return inputs.split(","), output


def _einsum_rows(op: tf.Operation, shapes, out) -> List[Tuple[int, Tuple[int, ...]]]:
    """Row splits of an Einsum: leading output labels that lead every input
    having them and appear in no other input."""
    parts = _einsum_parts(op)
    if parts is None:
        return []
    inputs, output = parts
    found = []
    for d in range(1, len(output) + 1):
        labels = output[:d]
        positions = []
        for k, subscripts in enumerate(inputs):
            if subscripts[:d] == labels:
                positions.append(k)
            elif any(c in subscripts for c in labels):
                positions = None
                break
        if positions:
            found.append((math.prod(out[:d]), tuple(positions)))
    return found


def piece_shape(shape: Sequence[int], rows: int, n: int) -> List[int]:
    """The piece form of a tensor of ``shape`` holding ``rows`` rows, for a
    piece of ``n`` rows."""
    d = row_dims(shape, rows)
    return [n] + list(shape[d:])


def piece_op(op: tf.Operation, inputs: List[tf.Tensor], rows: int, n: int, batch_size: int, name: str,
             cut: Sequence[int], control: Sequence[tf.Operation] = ()) -> List[tf.Tensor]:
    """The outputs of ``op`` run on one piece of ``n`` rows: ``inputs`` are
    its inputs, in ``op``'s order, those at positions ``cut`` (its row
    inputs) in piece form and the others whole.  Ops whose attributes or constant inputs refer to
    dimensions get them adjusted to the piece form; the others are copied
    as they are.  The op made waits on ``control``; the constants it reads
    do not (Grappler's constant folding moves the waits of constants onto
    their readers, and with its arithmetic optimizer that closed cycles)."""
    out_shapes = [static_shape(t, batch_size) for t in op.outputs]
    piece_shapes = [piece_shape(s, rows, n) for s in out_shapes]
    d_out = row_dims(out_shapes[0], rows)
    kind = op.type
    if kind in VIEWS:
        outputs = [tf.reshape(inputs[0], piece_shapes[0], name=name)]
    elif kind == "Transpose":
        perm = [int(p) for p in _constant(op.inputs[1])]
        outputs = [tf.transpose(inputs[0], [0] + [p - d_out + 1 for p in perm[d_out:]], name=name)]
    else:
        outputs = _copied(op, _piece_inputs(op, inputs, rows, batch_size, out_shapes, piece_shapes, d_out, cut),
                          name, piece_shapes, d_out)
    made = outputs[0].op
    if control:
        made._add_control_inputs([c for c in control if c is not made])  # pylint: disable=protected-access
    return outputs


def _piece_inputs(op: tf.Operation, inputs: List[tf.Tensor], rows: int, batch_size: int, out_shapes,
                  piece_shapes, d_out: int, cut: Sequence[int]) -> List[tf.Tensor]:
    """``op``'s inputs for a piece, with what names dimensions adjusted."""
    kind = op.type
    if kind in REDUCTIONS:
        d_in = row_dims(static_shape(op.inputs[0], batch_size), rows)
        axes = [a - d_in + 1 for a in _axes(op.inputs[1], len(static_shape(op.inputs[0], batch_size)))]
        scalar = getattr(_constant(op.inputs[1]), "ndim", 0) == 0
        return [inputs[0], tf.constant(axes[0] if scalar else axes, dtype=op.inputs[1].dtype)]
    if kind == "ConcatV2":
        axis = _axes(op.inputs[-1], len(out_shapes[0]))[0] - d_out + 1
        return inputs[:-1] + [tf.constant(axis, dtype=op.inputs[-1].dtype)]
    if kind == "Conv2DBackpropInput":
        return [tf.constant(piece_shapes[0], dtype=op.inputs[0].dtype)] + inputs[1:]
    if kind == "Tile":
        multiples = [int(m) for m in _constant(op.inputs[1])]
        return [inputs[0], tf.constant([1] + multiples[d_out:], dtype=op.inputs[1].dtype)]
    if kind in BROADCASTING:
        return [t if k in cut else _broadcastable(t, original, out_shapes[0], d_out, batch_size)
                for k, (t, original) in enumerate(zip(inputs, op.inputs))]
    return inputs


def _copied(op: tf.Operation, inputs: List[tf.Tensor], name: str, piece_shapes, d_out: int) -> List[tf.Tensor]:
    """A copy of ``op`` on ``inputs`` (its attributes, an einsum's rows merged
    into one label), its outputs shaped ``piece_shapes``."""
    attrs = {key: value for key, value in op.node_def.attr.items()}
    if op.type == "Einsum" and d_out > 1:
        inputs_eq, output_eq = _einsum_parts(op)
        attrs["equation"].s = _merged_labels(inputs_eq, output_eq, d_out).encode()
    made = op.graph._create_op_internal(  # pylint: disable=protected-access
        op.type, inputs, dtypes=[t.dtype for t in op.outputs], name=name, attrs=attrs, op_def=op.op_def,
        compute_device=False)
    made._set_device(op.device)  # pylint: disable=protected-access
    for t, shape in zip(made.outputs, piece_shapes):
        t.set_shape(shape)
    return list(made.outputs)


def _broadcastable(t: tf.Tensor, original: tf.Tensor, out_shape, d: int, batch_size: int) -> tf.Tensor:
    """A whole input of a broadcasting op (``t``, or the tensor read instead
    of it) made to broadcast against the piece form: the dimensions it has
    over the rows (all 1) dropped."""
    shape = static_shape(original, batch_size)
    over_rows = len(shape) - (len(out_shape) - d)
    if over_rows <= 0:
        return t
    return tf.reshape(t, shape[over_rows:])


def _merged_labels(inputs: List[str], output: str, d: int) -> str:
    """An einsum equation with the first ``d`` output labels (the rows)
    merged into one label."""
    labels = output[:d]
    unused = next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBAzyxwvutsrqponmlkjihgfedcba"
                  if c not in "".join(inputs) + output)
    merge = lambda s: unused + s[d:] if s[:d] == labels else s  # noqa: E731
    return ",".join(merge(s) for s in inputs) + "->" + merge(output)


def metadata_value(op: tf.Operation, batch_size: int) -> Optional[tf.Tensor]:
    """The constant a shape reader (:data:`memsaving.model.splitting.METADATA_OPS`) computes, from its input's static shape."""
    shape = static_shape(op.inputs[0], batch_size)
    if shape is None:
        return None
    dtype = op.outputs[0].dtype
    if op.type == "Shape":
        return tf.constant(shape, dtype=dtype)
    if op.type == "Size":
        return tf.constant(math.prod(shape), dtype=dtype)
    return tf.constant(len(shape), dtype=dtype)

