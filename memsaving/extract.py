"""Building the neutral :class:`~memsaving.graph.GraphModel` from a TF graph.

This module and :mod:`memsaving.rewrite` are the only ones that read
TensorFlow graphs for planning.  Sizes come from static shapes (an unknown
dimension, usually the batch, is replaced by ``batch_size``); compute costs
are FLOP estimates; what each op's gradient reads comes from a table of the
gradient functions TensorFlow registers, with "all float inputs and outputs"
as the safe default.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Set

import numpy as np
import tensorflow as tf

from memsaving.forward import ForwardGraph, _topological, is_copyable, is_trainable
from memsaving.graph import GraphModel, OpInfo, ProfileSummary, TensorInfo

EXTERNAL_OPS = frozenset({"Placeholder", "Const", "VarHandleOp", "NoOp"})
ALIASING_OPS = frozenset({"ReadVariableOp", "Identity", "Snapshot", "StopGradient", "Reshape",
                          "ExpandDims", "Squeeze"})
"""Ops whose output shares its input's buffer (no new memory)."""

GRAD_READS_OUTPUTS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Exp", "Sqrt", "Rsqrt",
    "Reciprocal", "Softmax",
})
GRAD_READS_INPUTS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D",
    "Conv3D", "DepthwiseConv2dNative", "Mul", "Square", "Sin", "Cos", "Log",
    "Softplus", "Abs", "Pow", "RealDiv", "Div", "LeakyRelu", "SquaredDifference",
    "Maximum", "Minimum", "GatherV2", "ResourceGather",
})
GRAD_READS_NOTHING = frozenset({
    "Add", "AddV2", "Sub", "BiasAdd", "Sum", "Mean", "Reshape", "Identity", "Neg",
    "AddN", "ConcatV2", "Split", "SplitV", "Unpack", "Pack", "Transpose", "ExpandDims",
    "Squeeze", "StopGradient", "Cast", "StridedSlice", "Slice", "Pad", "ReadVariableOp",
    "Snapshot", "Shape",
})
GRAD_READS_CONDITION = frozenset({"SelectV2"})
"""Ops whose gradient routes the incoming gradient by their first input (a
boolean mask) and reads no value (the shapes it asks for are folded to
constants when known).  Not v1 ``Select``: its gradient builds
``zeros_like`` of the selected input, which holds that input."""
FORWARDS_INPUT_OPS = frozenset({
    "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Exp", "Log", "Neg", "Sqrt", "Rsqrt",
    "Square", "Abs", "Sin", "Cos", "Reciprocal", "Softplus", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div",
    "Maximum", "Minimum", "SquaredDifference", "Pow", "BiasAdd", "AddN",
})
"""Elementwise ops whose kernels, and whose gradients' kernels, write into
an input's buffer when nothing else reads it (so ``tanh(matmul(x, w))``
holds one buffer, not two); measured: it brings the predicted peak of a
swapping MLP from 1.00 to 0.75 MiB, the 0.76 MiB the allocator reports."""
MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
CONV_OPS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative"})


def _elements(shape: tf.TensorShape, batch_size: int) -> int:
    if shape.rank is None:
        return batch_size
    n = 1
    for d in shape.as_list():
        n *= batch_size if d is None else d
    return int(n)


def tensor_bytes(t: tf.Tensor, batch_size: int = 1) -> int:
    """Bytes of ``t`` from its static shape (unknown dimensions = ``batch_size``)."""
    if t.dtype in (tf.resource, tf.variant, tf.string):
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


def _grad_reads(op: tf.Operation) -> List[tf.Tensor]:
    if op.type in GRAD_READS_NOTHING:
        return []
    if op.type in GRAD_READS_CONDITION:
        return [op.inputs[0]]
    if op.type in GRAD_READS_OUTPUTS:
        return [t for t in op.outputs if is_trainable(t)]
    if op.type in GRAD_READS_INPUTS:
        return [t for t in op.inputs if is_trainable(t) and t.dtype != tf.resource]
    return [t for t in list(op.inputs) + list(op.outputs) if is_trainable(t) and t.dtype != tf.resource]


PROFILE_MODES = ("off", "cached", "measure")


def graph_model(fwd: ForwardGraph, batch_size: int = 1, resident_bytes: Optional[int] = None,
                profile: str = "off") -> GraphModel:
    """The neutral model of the step that computes ``fwd.ys``.

    Args:
      fwd: the forward graph (defines which ops are differentiated).
      batch_size: replaces unknown dimensions in sizes and costs.
      resident_bytes: memory in use before the step; default: the bytes of the
        variables and inputs the step reads.
      profile: kernel temporaries and run times (:mod:`memsaving.profiles`):
        ``"measure"`` measures the op signatures the cache lacks,
        ``"cached"`` uses only cached profiles, ``"off"`` none.
    """
    if profile not in PROFILE_MODES:
        raise ValueError(f"profile={profile!r}: use one of {PROFILE_MODES}")
    ancestors = set()
    stack = [y.op for y in fwd.ys]
    while stack:
        op = stack.pop()
        if op in ancestors or op.type in EXTERNAL_OPS:
            continue
        ancestors.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    ops = _topological(sorted(ancestors, key=lambda o: o._id))  # pylint: disable=protected-access

    ids: Dict[int, int] = {}
    tensors: Dict[int, TensorInfo] = {}
    variants: Set[int] = set()
    resident = 0

    def tensor_id(t: tf.Tensor, producer: int) -> int:
        nonlocal resident
        key = id(t)
        if key not in ids:
            ids[key] = len(ids)
            nbytes = tensor_bytes(t, batch_size)
            value_bytes = None
            if producer >= 0 and ops[producer].type in ALIASING_OPS:
                nbytes, value_bytes = 0, nbytes
            if producer < 0:
                resident += _external_bytes(t, batch_size)
                if t.dtype == tf.resource:
                    value_bytes = _external_bytes(t, batch_size)
            constant = producer < 0 and (t.op.type in ("Const", "VarHandleOp") or t.dtype == tf.resource)
            tensors[ids[key]] = TensorInfo(t.name, nbytes, producer, is_trainable(t), constant, value_bytes)
            if t.dtype == tf.variant:
                variants.add(ids[key])
        return ids[key]

    position = {op: i for i, op in enumerate(ops)}
    run = None
    if profile != "off":
        from memsaving.profiles import profile_ops  # pylint: disable=import-outside-toplevel

        run = profile_ops(ops, batch_size, measure=profile == "measure")
    measured = run.profiles if run is not None else {}
    infos = []
    for i, op in enumerate(ops):
        inputs = tuple(tensor_id(t, position.get(t.op, -1)) for t in op.inputs)
        outputs = tuple(tensor_id(t, i) for t in op.outputs)
        forward = fwd.contains_op(op)
        # only the forward ops are differentiated: the others' gradients never run
        reads = tuple(ids[id(t)] for t in _grad_reads(op)) if forward else ()
        info = OpInfo(
            name=op.name, type=op.type, inputs=inputs, outputs=outputs,
            forward=forward, copyable=is_copyable(op),
            grad_reads=reads, cost=op_flops(op, batch_size),
            forwards_input=op.type in FORWARDS_INPUT_OPS or op.type in ALIASING_OPS,
        )
        if op.name in measured:
            info = _with_profile(info, measured[op.name], tensors, variants)
        infos.append(info)
    xs = [tensor_id(x, position.get(x.op, -1)) for x in fwd.xs]
    ys = [tensor_id(y, position.get(y.op, -1)) for y in fwd.ys]
    summary = None
    if run is not None:
        summary = ProfileSummary(profile, run.measured, run.cached, run.missing, run.seconds, len(measured))
    return GraphModel(infos, tensors, xs, ys, resident if resident_bytes is None else resident_bytes,
                      separate_result_kernels=True, profile=summary)


def _with_profile(info: OpInfo, profile, tensors: Dict[int, TensorInfo], variants: Set[int]) -> OpInfo:
    """``info`` with its measured temporaries and times; variant outputs
    (TensorLists), which static shapes cannot size, get the bytes they held
    when measured."""
    for t, held in zip(info.outputs, profile.output_bytes):
        if t in variants and held > 0 and tensors[t].nbytes == 0:
            tensors[t] = replace(tensors[t], nbytes=held)
    return replace(info, temp_bytes=profile.temp_bytes, grad_temp_bytes=profile.grad_temp_bytes,
                   saved_bytes=profile.saved_bytes, seconds=profile.seconds, grad_seconds=profile.grad_seconds)


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
