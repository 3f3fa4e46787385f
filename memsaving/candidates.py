"""Checkpoint candidates on the neutral graph model (no TensorFlow).

``articulation`` finds the single ops every input-to-output path crosses;
``speed`` the expensive ops; :func:`sqrtn` picks about sqrt(n) of a candidate
list.  All return op indices of the :class:`~memsaving.graph.GraphModel`.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import networkx as nx

from memsaving.graph import GraphModel
from memsaving.selection import bottlenecks, select_sqrtn

PARAMETER_READ_TYPES = frozenset({"ReadVariableOp"})
"""Ops that only read parameters: their outputs live for the whole step
anyway, so they are not activations and never constrain checkpoint choice."""

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


def _has_trainable_output(model: GraphModel, i: int) -> bool:
    return any(model.tensors[t].trainable for t in model.ops[i].outputs)


def activation_digraph(model: GraphModel) -> Tuple[nx.DiGraph, List[int]]:
    """The forward ops as a DAG over op indices, without parameter reads.

    Each node has a ``"bytes"`` attribute (the bytes its outputs occupy).
    Edges follow every data input (an integer shape tensor read far
    downstream also forces recomputation to reach back).
    """
    graph = nx.DiGraph()
    order = [i for i, op in enumerate(model.ops) if op.forward and op.type not in PARAMETER_READ_TYPES]
    members = set(order)
    for i in order:
        graph.add_node(i, bytes=sum(model.tensors[t].nbytes for t in model.ops[i].outputs))
    for i in order:
        for t in model.ops[i].inputs:
            producer = model.tensors[t].producer
            if producer in members and producer != i:
                graph.add_edge(producer, i)
    return graph, order


def articulation(model: GraphModel) -> List[int]:
    """Copyable forward ops that every input-to-output path crosses, in order."""
    graph, order = activation_digraph(model)
    return [i for i in bottlenecks(graph, order) if model.ops[i].copyable and _has_trainable_output(model, i)]


def speed(model: GraphModel) -> List[int]:
    """Copyable MatMul/Conv/Einsum forward ops, in order."""
    return [
        i for i, op in enumerate(model.ops)
        if op.forward and op.type in SPEED_OP_TYPES and op.copyable and _has_trainable_output(model, i)
    ]


def sqrtn(model: GraphModel, candidates: Sequence[int], count: Optional[int] = None) -> List[int]:
    """About sqrt(len(candidates)) candidates, spaced evenly by activation bytes."""
    graph, order = activation_digraph(model)
    return select_sqrtn(graph, order, [c for c in candidates if c in graph], count)
