"""The framework-neutral view of a forward graph used by the selectors.

``activation_graph`` turns a :class:`memsaving.forward.ForwardGraph` into a
``networkx.DiGraph`` over op names with the bytes each op produces, so the
selection algorithms never touch TensorFlow.
"""

from __future__ import annotations

import networkx as nx
import tensorflow as tf

from memsaving.forward import ForwardGraph

PARAMETER_READ_OPS = frozenset({"ReadVariableOp"})
"""Ops that only read parameters: their outputs live for the whole step
anyway, so they are not activations and never constrain checkpoint choice."""


def tensor_bytes(tensor: tf.Tensor, unknown_dim: int = 1) -> int:
    """Static size of ``tensor`` in bytes; unknown dimensions count as ``unknown_dim``."""
    shape = tensor.shape
    if shape.rank is None:
        elements = unknown_dim
    else:
        elements = 1
        for dim in shape.as_list():
            elements *= unknown_dim if dim is None else dim
    try:
        itemsize = tensor.dtype.size
    except (TypeError, ValueError):
        itemsize = 8
    return int(elements) * int(itemsize)


def activation_graph(fwd: ForwardGraph, unknown_dim: int = 1):
    """Return ``(graph, order, ops_by_name)`` for the activations of ``fwd``.

    Nodes are op names with a ``"bytes"`` attribute; an edge ``u -> v`` means
    ``v`` reads an output of ``u`` (any dtype: an integer shape tensor read
    far downstream also forces recomputation to reach back).
    """
    graph = nx.DiGraph()
    ops_by_name = {}
    order = []
    for op in fwd.ops:
        if op.type in PARAMETER_READ_OPS:
            continue
        ops_by_name[op.name] = op
        order.append(op.name)
        graph.add_node(op.name, bytes=sum(tensor_bytes(t, unknown_dim) for t in op.outputs))
    for op in fwd.ops:
        if op.name not in ops_by_name:
            continue
        for t in op.inputs:
            if t.op.name in ops_by_name and t.op.name != op.name:
                graph.add_edge(t.op.name, op.name)
    return graph, order, ops_by_name
