"""Turning the ``checkpoints`` argument into a list of forward tensors."""

from __future__ import annotations

from typing import Sequence, Union

import tensorflow as tf

from memsaving.errors import CheckpointError
from memsaving.forward import ForwardGraph, is_copyable, is_trainable
from memsaving.graph_model import activation_graph
from memsaving.marking import CHECKPOINTS_COLLECTION
from memsaving.selection import bottlenecks, select_sqrtn

SPEED_OP_TYPES = frozenset(
    {
        "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
        "Conv", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
        "Conv2DBackpropInput", "Conv2DBackpropInputV2", "Conv3DBackpropInputV2",
    }
)
"""Op types whose outputs ``"speed"`` keeps: the expensive ones, so that the
backward pass only recomputes cheap elementwise work.  Matched by op type,
never by name (Keras and tf.function rename freely)."""

MODES = ("collection", "speed", "memory")

Checkpoints = Union[str, Sequence[tf.Tensor]]


def resolve_checkpoints(checkpoints: Checkpoints, fwd: ForwardGraph) -> list:
    """Return the checkpoint tensors for ``checkpoints`` on ``fwd``.

    Raises:
      CheckpointError: unknown mode, a given tensor that is not between xs
        and ys, or no checkpoint found.
    """
    if isinstance(checkpoints, str):
        if checkpoints == "collection":
            return _from_collection(fwd)
        if checkpoints == "speed":
            return _speed(fwd)
        if checkpoints == "memory":
            return _memory(fwd)
        raise CheckpointError(
            f"unknown checkpoints mode {checkpoints!r}: pass a list of tensors or one of {MODES}"
        )
    if isinstance(checkpoints, (tf.Tensor, tf.Variable)):
        checkpoints = [checkpoints]
    tensors = list(checkpoints)
    outside = [t for t in tensors if not isinstance(t, tf.Tensor) or not fwd.contains_tensor(t)]
    if outside:
        names = ", ".join(getattr(t, "name", repr(t)) for t in outside[:5])
        raise CheckpointError(
            f"checkpoint tensor(s) not in the forward graph between xs and ys: {names}. "
            "A checkpoint must depend on xs (along float tensors) and ys must depend on it; "
            "pass tensors computed inside the same tf.function between xs and ys."
        )
    return tensors


def _from_collection(fwd: ForwardGraph) -> list:
    graph = fwd.ys[0].graph
    marked = [t for t in graph.get_collection(CHECKPOINTS_COLLECTION) if isinstance(t, tf.Tensor)]
    inside = [t for t in marked if fwd.contains_tensor(t)]
    if not inside:
        detail = (
            f"{len(marked)} tensor(s) are marked, but none lies between xs and ys"
            if marked else "no tensor is marked"
        )
        raise CheckpointError(
            f"checkpoints='collection' found no checkpoint: {detail}. Mark tensors with "
            "memsaving.checkpoint(t) (or tf.compat.v1.add_to_collection('checkpoints', t)) "
            "inside the function that computes ys, pass checkpoints=[tensors], or use "
            "checkpoints='memory' or 'speed'."
        )
    return inside


def _speed(fwd: ForwardGraph) -> list:
    found = [
        op.outputs[0]
        for op in fwd.ops
        if op.type in SPEED_OP_TYPES and is_copyable(op) and is_trainable(op.outputs[0])
    ]
    if not found:
        raise CheckpointError(
            "checkpoints='speed' found no MatMul/Conv/Einsum op between xs and ys; "
            "use checkpoints='memory' or pass a list of tensors."
        )
    return found


def _memory(fwd: ForwardGraph) -> list:
    graph, order, ops_by_name = activation_graph(fwd)
    candidates = [
        name for name in bottlenecks(graph, order)
        if is_copyable(ops_by_name[name]) and any(is_trainable(t) for t in ops_by_name[name].outputs)
    ]
    if not candidates:
        raise CheckpointError(
            "checkpoints='memory' found no single tensor that separates the graph between "
            "xs and ys (multi-branch graphs such as towers or U-Nets have none). Pass "
            "checkpoints=[tensors] or mark them with memsaving.checkpoint, or use 'speed'."
        )
    chosen = select_sqrtn(graph, order, candidates)
    return [t for name in chosen for t in ops_by_name[name].outputs if is_trainable(t)]
