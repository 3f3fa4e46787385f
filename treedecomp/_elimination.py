"""Integer-indexed elimination machinery shared by the heuristics and the exact solver.

Everything here works on ``adj``: a list of Python sets of ints, where
``adj[v]`` holds the neighbours of vertex ``v``.  Python's set operations run
in C, so expressing each elimination step as a few set operations over small
neighbourhoods is what makes the heuristics fast.

An *elimination* of a graph is recorded as ``(order, higher, tail)``:

* ``order`` -- the vertices eliminated one at a time;
* ``higher[v]`` -- for each ``v`` in ``order``, its neighbours at the moment
  it was eliminated (its "higher" neighbours in the filled graph);
* ``tail`` -- the vertices left when the elimination stopped early because
  they were few enough to go into a single bag without raising the width.

From such a record :func:`build_decomposition` makes a tree decomposition in
linear time.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Hashable
from contextlib import contextmanager

import networkx as nx
import numpy as np

from .decomposition import TreeDecomposition


@contextmanager
def gc_paused():
    """Suspend Python's cyclic garbage collector for the duration.

    The elimination allocates many small sets, lists and tuples, none in
    reference cycles.  In a process that already holds millions of objects
    (TensorFlow imported, say), each allocation-triggered full collection
    walks all of them; measured on a 20,000-vertex graph this doubled the
    run time.  Reference counting still frees everything as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def index_graph(G: nx.Graph) -> tuple[list[Hashable], list[set[int]]]:
    """Return ``(nodes, adj)``: the vertices in ``G``'s order and integer adjacency sets.

    Self-loops are dropped (they never matter for treewidth), parallel edges
    of multigraphs collapse, and a directed graph is read as undirected:
    an arc in either direction becomes one undirected edge.
    """
    nodes = list(G)
    index = {v: i for i, v in enumerate(nodes)}
    adj: list[set[int]] = [set() for _ in nodes]
    for u, v in G.edges():
        if u != v:
            iu = index[u]
            iv = index[v]
            adj[iu].add(iv)
            adj[iv].add(iu)
    return nodes, adj


def triangle_counts(adj: list[set[int]]) -> list[int]:
    """``t[v]`` = number of edges among the neighbours of ``v``.

    The fill-in of ``v`` is then ``deg(v) * (deg(v) - 1) / 2 - t[v]``.
    Sparse graphs use one set intersection per edge; dense, moderately
    sized graphs use a matrix product, which is much faster there.
    """
    n = len(adj)
    m2 = sum(len(a) for a in adj)
    if n and 2000 <= m2 // 2 and m2 / n >= 48 and n <= 4000:
        A = np.zeros((n, n), dtype=np.float32)
        rows = np.fromiter((u for u in range(n) for _ in adj[u]), dtype=np.int64, count=m2)
        cols = np.fromiter((w for u in range(n) for w in adj[u]), dtype=np.int64, count=m2)
        A[rows, cols] = 1.0
        t = ((A @ A) * A).sum(axis=1) / 2.0  # exact: integers below 2**24
        return [int(round(x)) for x in t.tolist()]
    t = [0] * n
    for u in range(n):
        au = adj[u]
        for w in au:
            if w > u:
                c = len(au & adj[w])
                if c:
                    t[u] += c
                    t[w] += c
    return [x // 2 for x in t]


def eliminate_min_fill(adj: list[set[int]], rank: list[int] | None = None, abort_at: int | None = None):
    """Greedy min-fill elimination; returns ``(order, higher, tail, width)``.

    The vertex eliminated next is one of least fill-in (the number of edges
    its elimination would add), ties broken by smaller current degree and
    then by ``rank`` (default: vertex index).  ``adj`` is not modified.

    Fill-in counts are maintained incrementally through per-vertex triangle
    counts ``t[v]`` (edges among ``v``'s neighbours): eliminating ``v``
    changes ``t`` only for ``v``'s neighbours and for common neighbours of
    the endpoints of each added fill edge, so a step costs time polynomial in
    ``deg(v)`` and not in the size of the graph.  Vertices whose key changed
    are pushed again onto a heap; outdated heap entries are recognised on
    pop and skipped (lazy deletion).

    Vertices of fill-in zero -- isolated, degree one and simplicial
    vertices -- come first automatically; eliminating them never raises the
    width beyond what is unavoidable.  Once at most ``width + 1`` vertices
    remain, they are put in one final bag (``tail``) without further work.

    If ``abort_at`` is given, the run stops and returns ``None`` as soon as
    the width reaches ``abort_at`` (used to cut short runs that cannot beat
    a known decomposition).
    """
    n = len(adj)
    adj = [set(a) for a in adj]
    deg = [len(a) for a in adj]
    t = triangle_counts(adj)
    if rank is None:
        rank = range(n)
    heap = [(deg[v] * (deg[v] - 1) // 2 - t[v], deg[v], rank[v], v) for v in range(n)]
    heapq.heapify(heap)
    pop = heapq.heappop
    push = heapq.heappush
    alive = [True] * n
    order: list[int] = []
    higher: list[list[int] | None] = [None] * n
    width = -1
    remaining = n
    while heap:
        if remaining - 1 <= width:
            break
        f, d, r, v = pop(heap)
        if not alive[v] or d != deg[v] or f != d * (d - 1) // 2 - t[v]:
            continue  # stale heap entry
        alive[v] = False
        remaining -= 1
        Nv = adj[v]
        if d > width:
            width = d
            if abort_at is not None and width >= abort_at:
                return None
        order.append(v)
        higher[v] = list(Nv)
        adj[v] = set()
        changed = set(Nv)
        # Remove v: every edge (v, w) with w a common neighbour of u and v
        # leaves u's neighbourhood.
        if f == 0:
            # simplicial: each neighbour sees all d - 1 others, nothing to count
            for u in Nv:
                adj[u].discard(v)
                deg[u] -= 1
                t[u] -= d - 1
        else:
            for u in Nv:
                au = adj[u]
                au.discard(v)
                deg[u] -= 1
                t[u] -= len(au & Nv)
        # Make the neighbourhood a clique, updating triangle counts per new edge.
        if d > 1 and f > 0:
            for a in higher[v]:
                aa = adj[a]
                # pairs (a, b) still missing; pairs met earlier in this loop
                # are already edges, so every missing pair is handled once
                missing = Nv - aa
                missing.discard(a)
                for b in missing:
                    ab = adj[b]
                    common = aa & ab
                    c = len(common)
                    if c:
                        for w in common:
                            t[w] += 1
                        changed |= common
                        t[a] += c
                        t[b] += c
                    aa.add(b)
                    ab.add(a)
                    deg[a] += 1
                    deg[b] += 1
        for u in changed:
            du = deg[u]
            push(heap, (du * (du - 1) // 2 - t[u], du, rank[u], u))
    tail = [v for v in range(n) if alive[v]]
    if tail and len(tail) - 1 > width:
        width = len(tail) - 1
    return order, higher, tail, width


def eliminate_min_degree(adj: list[set[int]], rank: list[int] | None = None, abort_at: int | None = None):
    """Greedy minimum-degree elimination; same contract as :func:`eliminate_min_fill`.

    The next vertex is one of least current degree.  Ties go first-in,
    first-out: initially by ``rank`` (default: vertex index), and a vertex
    whose degree changed queues behind those that have waited longer at
    that degree.  This is networkx's tie-breaking for min-degree, and on
    grids and the PACE instances it gives narrower decompositions than
    breaking ties by index.  Only the eliminated vertex's neighbours change
    degree, so each step is one set union and one heap push per neighbour.
    """
    n = len(adj)
    adj = [set(a) for a in adj]
    if rank is None:
        rank = range(n)
    heap = [(len(adj[v]), rank[v], v) for v in range(n)]
    heapq.heapify(heap)
    stamp = n  # later pushes queue behind all initial entries of equal degree
    pop = heapq.heappop
    push = heapq.heappush
    alive = [True] * n
    order: list[int] = []
    higher: list[list[int] | None] = [None] * n
    width = -1
    remaining = n
    while heap:
        if remaining - 1 <= width:
            break
        d, _, v = pop(heap)
        if not alive[v] or d != len(adj[v]):
            continue
        alive[v] = False
        remaining -= 1
        Nv = adj[v]
        if d > width:
            width = d
            if abort_at is not None and width >= abort_at:
                return None
        order.append(v)
        higher[v] = list(Nv)
        adj[v] = set()
        for u in Nv:
            au = adj[u]
            au.discard(v)
            if d > 1:
                au |= Nv
                au.discard(u)
            push(heap, (len(au), stamp, u))
            stamp += 1
    tail = [v for v in range(n) if alive[v]]
    if tail and len(tail) - 1 > width:
        width = len(tail) - 1
    return order, higher, tail, width


def eliminate_in_order(adj: list[set[int]], ordering: list[int]):
    """Eliminate the vertices in the given order; same result shape as the heuristics."""
    n = len(adj)
    adj = [set(a) for a in adj]
    higher: list[list[int] | None] = [None] * n
    width = -1
    for v in ordering:
        Nv = adj[v]
        higher[v] = list(Nv)
        if len(Nv) > width:
            width = len(Nv)
        adj[v] = set()
        for u in Nv:
            au = adj[u]
            au.discard(v)
            au |= Nv
            au.discard(u)
    return list(ordering), higher, [], width


def build_decomposition(nodes: list, order: list[int], higher: list, tail: list[int]) -> TreeDecomposition:
    """Make a tree decomposition from an elimination record, in linear time.

    The bag of an eliminated vertex ``v`` is ``{v} | higher[v]`` and its
    parent is the earliest-eliminated vertex of ``higher[v]`` (the tail
    vertices, if any, come last and share one bag).  This is the classical
    elimination tree; it is a valid decomposition because ``higher[v]`` was a
    clique when ``v`` was eliminated, so all of it outlives ``v``'s parent
    ``p`` and is contained in ``p``'s bag.

    To keep the tree small, a parent's bag is merged into a child's bag when
    it is a subset of it: that happens exactly when
    ``len(higher[child]) == len(higher[parent]) + 1`` (``higher[child]``
    minus ``parent`` is always a subset of ``higher[parent]``).  Vertices
    whose ``higher`` is empty are the roots of their components; the roots'
    bags are chained together so that a disconnected graph still gets one
    tree.
    """
    n = len(nodes)
    if n == 0:
        return TreeDecomposition([], [])
    pos = [0] * n
    for k, v in enumerate(order):
        pos[v] = k
    big = len(order)
    for v in tail:
        pos[v] = big
    tail_set = set(tail)
    bags: list[frozenset] = []
    node_of = [-1] * n
    absorbed = [-1] * n
    parent = [-1] * n
    tail_absorber = -1
    roots = []
    for v in order:
        H = higher[v]
        node = absorbed[v]
        if node < 0:
            node = len(bags)
            bags.append(frozenset([nodes[v], *[nodes[h] for h in H]]))
        node_of[v] = node
        if H:
            p = min(H, key=pos.__getitem__)
            parent[v] = p
            if p in tail_set:
                # all of H is in the tail; the tail's bag is inside v's if H is all of it
                if tail_absorber < 0 and len(H) == len(tail):
                    tail_absorber = node
            elif absorbed[p] < 0 and len(H) == len(higher[p]) + 1:
                absorbed[p] = node
        else:
            roots.append(v)
    tail_node = -1
    if tail:
        tail_node = tail_absorber
        if tail_node < 0:
            tail_node = len(bags)
            bags.append(frozenset(nodes[v] for v in tail))
        for v in tail:
            node_of[v] = tail_node
    edges = []
    for v in order:
        p = parent[v]
        if p >= 0:
            a, b = node_of[v], node_of[p]
            if a != b:
                edges.append((b, a))
    root_nodes = [node_of[r] for r in roots]
    if tail_node >= 0:
        root_nodes.insert(0, tail_node)
    for k in range(1, len(root_nodes)):
        edges.append((root_nodes[0], root_nodes[k]))
    return TreeDecomposition(bags, edges)
