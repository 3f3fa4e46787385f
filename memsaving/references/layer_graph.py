"""The layer-level graph of a Keras 3 functional model's training step.

:mod:`memsaving.tf.extract` models a traced step op by op (about 1,400 ops for
ResNet50), which is what the rewrite needs.  Exact references such as the
Checkmate MILP (:mod:`memsaving.references.milp`) only scale to a few hundred nodes,
so this module builds the coarser model that papers on rematerialization
use: one op per layer call, read off the Keras graph without tracing.

* Tensor bytes: the static output shape, the batch dimension set to
  ``batch_size``, times the dtype's size.
* Cost: a FLOP estimate per layer type (:func:`layer_flops`).
* ``grad_reads``: what the layer's gradient needs (:func:`layer_grad_reads`):
  convolutions and dense layers read their input (for the kernel gradient)
  and, with a non-linear activation, their output; BatchNormalization reads
  input and output; additions, concatenations, reshapes read nothing.
* Weights: each trainable weight is an ``xs`` tensor (external, producer
  -1) read by its layer; non-trainable weights (BatchNormalization's moving
  statistics) are resident only.
* The loss: a final mean-squared reduction of the model's outputs, so the
  gradients start from a scalar as in a training step.
* ``resident_bytes``: all weights plus the input batch.

Layers fed only by the input (a padding before the first convolution) are
not differentiated (``forward=False``), as ``tf.gradients`` would skip them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, validate_model

CONV_TYPES = frozenset({"Conv1D", "Conv2D", "Conv3D"})
TRANSPOSED_CONV_TYPES = frozenset({"Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"})
DEPTHWISE_TYPES = frozenset({"DepthwiseConv1D", "DepthwiseConv2D"})
SEPARABLE_TYPES = frozenset({"SeparableConv1D", "SeparableConv2D"})
DENSE_TYPES = frozenset({"Dense", "EinsumDense"})
KERNEL_TYPES = CONV_TYPES | TRANSPOSED_CONV_TYPES | DEPTHWISE_TYPES | SEPARABLE_TYPES | DENSE_TYPES
NORM_TYPES = frozenset({"BatchNormalization", "LayerNormalization", "GroupNormalization",
                        "UnitNormalization", "RMSNormalization"})
MAX_POOL_TYPES = frozenset({"MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
                            "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D"})
AVERAGE_POOL_TYPES = frozenset({"AveragePooling1D", "AveragePooling2D", "AveragePooling3D"})
GLOBAL_AVERAGE_TYPES = frozenset({"GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D"})
ELEMENTWISE_SUM_TYPES = frozenset({"Add", "Subtract", "Average"})
ELEMENTWISE_PRODUCT_TYPES = frozenset({"Multiply", "Maximum", "Minimum", "Dot"})
DATA_MOVEMENT_TYPES = frozenset({
    "Concatenate", "Reshape", "Flatten", "Permute", "RepeatVector", "ZeroPadding1D", "ZeroPadding2D",
    "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D", "UpSampling1D", "UpSampling2D",
    "UpSampling3D", "Identity",
})
OUTPUT_READ_ACTIVATION_TYPES = frozenset({"ReLU", "ELU", "Softmax"})
INPUT_READ_ACTIVATION_TYPES = frozenset({"LeakyReLU", "PReLU"})
RANDOM_TYPES = frozenset({"Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                          "GaussianNoise", "GaussianDropout", "AlphaDropout"})
OUTPUT_READ_ACTIVATIONS = frozenset({"relu", "relu6", "elu", "selu", "sigmoid", "tanh", "softmax",
                                     "exponential", "hard_sigmoid"})
"""Activations whose gradient is a function of their output (as TensorFlow
computes ReluGrad, SigmoidGrad, TanhGrad, SoftmaxGrad).  The others (gelu,
swish, softplus, ...) need the pre-activation, which a layer-level graph
does not have: their layer reads its input and output instead."""

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def layer_graph_model(keras_model, batch_size: int, max_layers: Optional[int] = None) -> GraphModel:
    """The layer-level :class:`GraphModel` of ``keras_model``'s training step.

    Parameters
    ----------
    keras_model
        a Keras 3 functional model (keras.applications models
        are).
    batch_size : int
        replaces the unknown batch dimension in sizes and costs.
    max_layers : int, optional
        keep only the first ``max_layers`` layer calls (in
        topological order); the loss then reads every kept tensor a dropped
        layer read, so the prefix is a complete training step of its own.

    Raises
    ------
    ValueError
        the model is not a functional graph of layers.
    """
    calls = _layer_calls(keras_model)
    if max_layers is not None:
        calls = calls[:max_layers]
    builder = _Builder(batch_size)
    for tensor in keras_model.inputs:
        builder.external(tensor)
    for layer, node in calls:
        builder.layer_call(layer, node)
    builder.loss(_loss_inputs(keras_model, calls))
    model = builder.finish()
    validate_model(model)
    return model


def _layer_calls(keras_model) -> List[Tuple[Any, Any]]:
    """``(layer, node)`` of every layer call the outputs depend on, inputs
    first (depth-first post-order from the outputs)."""
    order: List[Tuple[Any, Any]] = []  # Keras layers and nodes
    seen = set()
    stack: List[Tuple[Any, bool]] = [(_node_of(t), False) for t in reversed(keras_model.outputs)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            if not node.is_input:
                order.append((node.operation, node))
            continue
        stack.append((node, True))
        for t in reversed(node.input_tensors):
            parent = _node_of(t)
            if id(parent) not in seen:
                stack.append((parent, False))
    return order


def _node_of(tensor):
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        raise ValueError(f"{tensor!r} is not a symbolic Keras tensor of a functional model")
    return history.operation._inbound_nodes[history.node_index]  # pylint: disable=protected-access


def _loss_inputs(keras_model, calls) -> List[Any]:
    """The model's outputs, or for a prefix every kept tensor that a dropped
    layer call (or the model's output) reads."""
    kept = {id(t) for _, node in calls for t in node.outputs}
    kept |= {id(t) for t in keras_model.inputs}
    if all(id(t) in kept for t in keras_model.outputs) and len(calls) == len(_layer_calls(keras_model)):
        return list(keras_model.outputs)
    kept_nodes = {id(node) for _, node in calls}
    found: Dict[int, Any] = {}  # Keras tensors
    for _, node in _layer_calls(keras_model):
        if id(node) in kept_nodes:
            continue
        for t in node.input_tensors:
            if id(t) in kept and id(t) not in {id(i) for i in keras_model.inputs}:
                found.setdefault(id(t), t)
    for t in keras_model.outputs:
        if id(t) in kept:
            found.setdefault(id(t), t)
    return list(found.values())


def _elements(shape: Sequence[Optional[int]], batch_size: int) -> int:
    return int(np.prod([batch_size if d is None else int(d) for d in shape], dtype=np.int64)) if shape else 1


def _dtype_bytes(dtype) -> int:
    name = str(getattr(dtype, "name", dtype))
    return _DTYPE_BYTES.get(name) or np.dtype(name).itemsize


def _activation_name(layer) -> str:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", "linear") if activation is not None else "linear"


class _Builder:
    """Accumulates tensors and ops while walking the layer calls."""

    def __init__(self, batch_size: int):
        self.batch = batch_size
        self.tensors: Dict[int, TensorInfo] = {}
        self.ids: Dict[int, int] = {}
        self.ops: List[OpInfo] = []
        self.xs: List[int] = []
        self.ys: List[int] = []
        self.resident = 0
        self.weight_ids: Dict[int, int] = {}

    def _new(self, info: TensorInfo) -> int:
        tid = len(self.tensors)
        self.tensors[tid] = info
        return tid

    def nbytes(self, tensor) -> int:
        return _elements(tensor.shape, self.batch) * _dtype_bytes(tensor.dtype)

    def external(self, tensor) -> int:
        """A model input: resident, no gradient."""
        if id(tensor) not in self.ids:
            nbytes = self.nbytes(tensor)
            self.resident += nbytes
            self.ids[id(tensor)] = self._new(TensorInfo(tensor.name, nbytes, -1, trainable=False))
        return self.ids[id(tensor)]

    def weights(self, layer) -> List[int]:
        """Trainable weights become ``xs`` (once per layer, even when the
        layer is called several times); all weights are resident."""
        ids = []
        for w in layer.weights:
            if id(w) not in self.weight_ids:
                nbytes = int(np.prod(w.shape, dtype=np.int64)) * _dtype_bytes(w.dtype)
                self.resident += nbytes
                tid = self._new(TensorInfo(w.path, nbytes, -1, trainable=w.trainable, constant=True))
                self.weight_ids[id(w)] = tid
                if w.trainable:
                    self.xs.append(tid)
            if w.trainable:
                ids.append(self.weight_ids[id(w)])
        return ids

    def layer_call(self, layer, node) -> None:
        index = len(self.ops)
        data = [self.ids[id(t)] if id(t) in self.ids else self.external(t) for t in node.input_tensors]
        weights = self.weights(layer)
        outputs = []
        for t in node.outputs:
            tid = self._new(TensorInfo(t.name, self.nbytes(t), index, trainable=True))
            self.ids[id(t)] = tid
            outputs.append(tid)
        kind = type(layer).__name__
        forward = bool(weights) or any(self._differentiated(t) for t in data)
        calls = len(layer._inbound_nodes)  # pylint: disable=protected-access
        self.ops.append(OpInfo(
            name=layer.name if calls == 1 else f"{layer.name}/{index}",
            type=kind,
            inputs=tuple(data + weights),
            outputs=tuple(outputs),
            forward=forward,
            copyable=kind not in RANDOM_TYPES,
            grad_reads=layer_grad_reads(layer, tuple(data), tuple(outputs)),
            cost=layer_flops(layer, [t.shape for t in node.input_tensors], [t.shape for t in node.outputs],
                             self.batch),
        ))

    def _differentiated(self, tid: int) -> bool:
        producer = self.tensors[tid].producer
        return producer >= 0 and self.ops[producer].forward

    def loss(self, tensors: Iterable[Any]) -> None:
        """A mean of squares over ``tensors``: its gradient reads them."""
        inputs = tuple(self.ids[id(t)] for t in tensors)
        elements = sum(_elements(t.shape, self.batch) for t in tensors)
        index = len(self.ops)
        out = self._new(TensorInfo("loss", 4, index, trainable=True))
        self.ys = [out]
        self.ops.append(OpInfo(
            name="loss", type="MeanSquaredLoss", inputs=inputs, outputs=(out,),
            forward=any(self._differentiated(t) for t in inputs),
            grad_reads=inputs, cost=2.0 * elements,
        ))

    def finish(self) -> GraphModel:
        return GraphModel(self.ops, self.tensors, xs=list(self.xs), ys=list(self.ys),
                          resident_bytes=self.resident)


def layer_grad_reads(layer, inputs: Tuple[int, ...], outputs: Tuple[int, ...]) -> Tuple[int, ...]:
    """The data tensors the layer's gradient reads (weights are resident
    and not listed).

    Kernel layers read their input for the kernel gradient, and their output
    when the fused activation is one whose derivative is computed from the
    output (relu, sigmoid, softmax, ...); other non-linear activations read
    the output as a stand-in for the pre-activation.  Unknown layers read
    everything (safe: the simulator then keeps more, never less).
    """
    kind = type(layer).__name__
    activation = _activation_name(layer)
    if kind in KERNEL_TYPES:
        return inputs + (outputs if activation != "linear" else ())
    if kind in NORM_TYPES or kind in MAX_POOL_TYPES:
        return inputs + outputs
    if kind == "Activation":
        if activation == "linear":
            return ()
        return outputs if activation in OUTPUT_READ_ACTIVATIONS else inputs
    if kind in OUTPUT_READ_ACTIVATION_TYPES or kind in RANDOM_TYPES:
        return outputs  # a dropout's output stands in for its mask
    if kind in INPUT_READ_ACTIVATION_TYPES or kind in ELEMENTWISE_PRODUCT_TYPES:
        return inputs
    if kind in ELEMENTWISE_SUM_TYPES or kind in DATA_MOVEMENT_TYPES or kind in AVERAGE_POOL_TYPES \
            or kind in GLOBAL_AVERAGE_TYPES:
        return ()
    return inputs + outputs


def layer_flops(layer, input_shapes: Sequence[Sequence[Optional[int]]],
                output_shapes: Sequence[Sequence[Optional[int]]], batch_size: int) -> float:
    """A forward FLOP estimate of one layer call.

    Multiply-adds count two: ``2 * outputs * window * in_channels`` for a
    convolution, ``2 * outputs * inputs`` for a dense layer; bias and
    activation one per output; normalization five per element (mean,
    variance, normalize, scale, shift); pooling one per window element;
    data movement (concatenation, padding, reshape, upsampling) one per
    output element, so nothing is free to recompute.
    """
    kind = type(layer).__name__
    out = float(sum(_elements(s, batch_size) for s in output_shapes)) or 1.0
    inp = float(sum(_elements(s, batch_size) for s in input_shapes)) or 1.0
    extra = out * (int(bool(getattr(layer, "use_bias", False))) + int(_activation_name(layer) != "linear"))
    kernel = getattr(layer, "kernel", None) if kind in KERNEL_TYPES else None
    shape = [int(d) for d in kernel.shape] if kernel is not None else []
    if kind in CONV_TYPES and shape:
        return 2.0 * out * math.prod(shape[:-1]) + extra
    if kind in DEPTHWISE_TYPES and shape:
        return 2.0 * out * math.prod(shape[:-2]) + extra
    if kind in TRANSPOSED_CONV_TYPES and shape:
        return 2.0 * inp * math.prod(shape[:-1]) + extra  # kernel: window x out x in
    if kind in SEPARABLE_TYPES:
        depthwise = [int(d) for d in layer.depthwise_kernel.shape]
        pointwise = [int(d) for d in layer.pointwise_kernel.shape]
        return 2.0 * inp * math.prod(depthwise[:-2]) * depthwise[-1] + 2.0 * out * pointwise[-2] + extra
    if kind in DENSE_TYPES and shape:
        return 2.0 * out * math.prod(shape) / shape[-1] + extra
    if kind in NORM_TYPES:
        return 5.0 * out
    if kind in MAX_POOL_TYPES | AVERAGE_POOL_TYPES and hasattr(layer, "pool_size"):
        return out * math.prod(layer.pool_size)
    if kind in GLOBAL_AVERAGE_TYPES or kind.startswith("GlobalMax"):
        return inp
    if kind in ELEMENTWISE_SUM_TYPES | ELEMENTWISE_PRODUCT_TYPES:
        return out * max(1, len(input_shapes) - 1)
    if kind == "Softmax" or (kind == "Activation" and _activation_name(layer) == "softmax"):
        return 5.0 * out
    return out
