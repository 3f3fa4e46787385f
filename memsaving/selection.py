"""Choosing checkpoints on a plain directed acyclic graph (no TensorFlow).

The graph is a ``networkx.DiGraph`` whose nodes are ops of the forward pass
and whose edges are the tensors between them; each node may carry a
``"bytes"`` attribute, the size of the activations it produces.  The functions
here only look at that structure, so they are tested on hand-made graphs.
"""

from __future__ import annotations

import math
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

    Args:
      graph: a DAG.
      order: all nodes of ``graph`` in a topological order.

    Returns:
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


def select_sqrtn(
    graph: nx.DiGraph,
    order: Sequence[Hashable],
    candidates: Sequence[Hashable],
    count: int | None = None,
) -> list:
    """Pick about sqrt(n) of ``candidates``, evenly spaced by memory.

    With ``k`` checkpoints splitting the activations into ``k + 1`` segments
    of equal bytes, the backward pass holds the ``k`` checkpoints plus one
    recomputed segment: ``O(k + n/k)`` memory, smallest at ``k = sqrt(n)``.
    Spacing by bytes instead of by count keeps segments balanced when layers
    differ in size (wide early convolutions, narrow late ones).

    Args:
      graph: a DAG whose nodes may have a ``"bytes"`` attribute (default 1).
      order: the nodes in topological order.
      candidates: the nodes allowed as checkpoints, in ``order``.
      count: how many to pick; default ``round(sqrt(len(candidates)))``.

    Returns:
      The chosen candidates in topological order (no duplicates).
    """
    if not candidates:
        return []
    if count is None:
        count = max(1, int(round(math.sqrt(len(candidates)))))
    count = min(count, len(candidates))
    cumulative = {}
    total = 0
    for node in order:
        total += graph.nodes[node].get("bytes", 1)
        cumulative[node] = total
    chosen = []
    start = 0
    for j in range(1, count + 1):
        target = total * j / (count + 1)
        best = None
        for idx in range(start, len(candidates)):
            cand = candidates[idx]
            if best is None or abs(cumulative[cand] - target) < abs(cumulative[candidates[best]] - target):
                best = idx
            if cumulative[cand] > target:
                break
        chosen.append(candidates[best])
        start = best + 1
        if start >= len(candidates):
            break
    return chosen
