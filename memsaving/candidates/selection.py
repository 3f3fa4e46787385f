"""Choosing checkpoints on a plain directed acyclic graph (no TensorFlow).

The graph is a ``networkx.DiGraph`` whose nodes are ops of the forward pass
and whose edges are the tensors between them; each node may carry a
``"bytes"`` attribute, the size of the activations it produces.  The functions
here only look at that structure, so they are tested on hand-made graphs.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import networkx as nx


def bottlenecks(graph: nx.DiGraph, order: Sequence[Hashable]) -> list:
    """Nodes whose removal cuts the graph into a before and an after part.

    A node ``v`` is a bottleneck when no edge jumps over it in the topological
    ``order`` and no source (node without predecessors) comes after it: then
    every path from an input to an output passes through ``v``, so keeping
    ``v``'s outputs is enough to recompute everything after it.  (Sources are
    treated as fed by one virtual input node placed before everything.)  This is the single-tensor separator of the TF1
    package's ``"memory"`` mode, found here in one linear sweep.

    Parameters
    ----------
    graph : nx.DiGraph
        a DAG.
    order
        all nodes of ``graph`` in a topological order.

    Returns
    -------
    list
        The bottleneck nodes in ``order``, excluding nodes without successors
        (keeping an output saves nothing) and nodes without predecessors (they
        are computed from kept inputs in one step, so keeping them saves no
        recomputation and would cut nothing).
    """
    position = {node: i for i, node in enumerate(order)}
    if len(position) != graph.number_of_nodes():
        raise ValueError("order must list every node of the graph exactly once")
    found = []
    # furthest position reached by an edge from an earlier node, the virtual
    # input node reaching every source
    furthest = max((position[n] for n in order if graph.in_degree(n) == 0), default=-1)
    for i, node in enumerate(order):
        if furthest <= i and graph.out_degree(node) > 0 and graph.in_degree(node) > 0:
            found.append(node)
        for succ in graph.successors(node):
            if position[succ] <= i:
                raise ValueError(f"order is not topological: {node!r} -> {succ!r}")
            furthest = max(furthest, position[succ])
    return found
