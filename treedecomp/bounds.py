"""Lower bounds on treewidth.

A lower bound tells when a heuristic decomposition is already optimal (the
improvement loop and the exact solver stop there) and lets the exact solver
skip hopeless widths.
"""

from __future__ import annotations

import heapq

import networkx as nx

from ._elimination import index_graph

__all__ = ["minor_min_width"]


def min_width_of_adjacency(adj: list[set[int]], stop=None) -> int:
    """:func:`minor_min_width` on integer adjacency sets, as the exact solver
    and the improvement loop hold graphs (``adj`` is not modified).

    ``stop``, a callable checked every 64 contractions, ends the computation
    early when it returns true; the bound found so far is returned, which is
    still a lower bound (each recorded degree is the minimum degree of a
    minor), only possibly a weaker one.  Callers with a time limit use it.
    """
    n = len(adj)
    if n == 0:
        return -1
    adj = [set(a) for a in adj]
    heap = [(len(adj[v]), v) for v in range(n)]
    heapq.heapify(heap)
    alive = [True] * n
    lb = 0
    remaining = n
    steps = 0
    while heap:
        if lb >= remaining - 1:
            break  # no minor of what is left has minimum degree above lb
        d, v = heapq.heappop(heap)
        if not alive[v] or d != len(adj[v]):
            continue
        steps += 1
        if stop is not None and steps % 64 == 0 and stop():
            break
        if d > lb:
            lb = d
        alive[v] = False
        remaining -= 1
        Nv = adj[v]
        if d == 0:
            continue
        # Contract v into the neighbour sharing the fewest neighbours with it
        # ("least-c"), which keeps degrees in the minor high.  For large
        # degrees, counting common neighbours costs d set intersections per
        # step; the neighbour of least degree is a cheap stand-in there.
        if d <= 64:
            u = min(Nv, key=lambda w: (len(adj[w] & Nv), len(adj[w])))
        else:
            u = min(Nv, key=lambda w: len(adj[w]))
        au = adj[u]
        au.discard(v)
        for w in Nv:
            if w != u:
                aw = adj[w]
                aw.discard(v)
                aw.add(u)
                au.add(w)
        adj[v] = set()
        heapq.heappush(heap, (len(au), u))
        for w in Nv:
            if w != u:
                heapq.heappush(heap, (len(adj[w]), w))
    return lb


def minor_min_width(G: nx.Graph) -> int:
    """Minor-min-width lower bound on the treewidth of ``G``.

    Treewidth never increases under taking minors, and a graph of minimum
    degree ``d`` has treewidth at least ``d``.  So repeatedly take a vertex
    of minimum degree, record its degree, and contract it into a neighbour;
    the largest degree recorded is a lower bound (Gogate and Dechter, 2004).
    Returns -1 for the empty graph.
    """
    _, adj = index_graph(G)
    return min_width_of_adjacency(adj)
