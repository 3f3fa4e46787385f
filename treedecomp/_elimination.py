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

The greedy heuristics start on these sets and, once they eliminate a vertex
of degree :data:`DENSE_DEGREE` or more, re-index the remaining vertices and
continue on bitsets (Python ints, one per vertex), where intersecting two
neighbourhoods of thousands of vertices is a single AND.  Both phases keep
the same counts and make the same choices.  Every engine takes a ``stop``
callback, checked often, so that callers with a time limit can cut a run
short and still get a valid elimination record.

Min-fill's set phase and :func:`build_decomposition` also exist in C (see
:data:`compiled`), for graphs of many small neighbourhoods where the
interpreter's per-step work, not the set operations, is the cost.
"""

from __future__ import annotations

import gc
import heapq
import os
from collections.abc import Hashable
from contextlib import contextmanager
from collections.abc import Sequence
from typing import Any, cast

import networkx as nx
import numpy as np

from .decomposition import TreeDecomposition

compiled: Any = None
"""The compiled inner loops (:mod:`treedecomp._compiled`), or None.

Built from C when the package is installed (``pip install -e .`` needs a C
compiler and the Python headers; without them the build is skipped).  They
make the same choices and the same decompositions as the Python code here,
several times faster: :func:`eliminate_min_fill`'s set phase and
:func:`build_decomposition`.  ``TREEDECOMP_PURE_PYTHON=1`` in the
environment before import, or setting this attribute to None, runs the
Python code.
"""
if os.environ.get("TREEDECOMP_PURE_PYTHON", "") in ("", "0"):
    try:
        import treedecomp._compiled as compiled  # type: ignore[no-redef]  # rebinds the name declared above
    except ImportError:
        compiled = None


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
    if not G.is_directed():
        return nodes, integer_sets(G.adj.values(), index)
    adj: list[set[int]] = [set() for _ in nodes]
    for u, v in G.edges():
        if u != v:
            iu = index[u]
            iv = index[v]
            adj[iu].add(iv)
            adj[iv].add(iu)
    return nodes, adj


def integer_sets(rows, index: dict) -> list[set[int]]:
    """``rows[v]`` (the labels of ``v``'s neighbours) as sets of their
    positions in ``index``, self-loops dropped.

    One set comprehension per vertex: three times faster than adding the
    edges one by one, which matters on dense graphs.
    """
    adj = [{index[u] for u in row} for row in rows]
    for i, a in enumerate(adj):
        a.discard(i)
    return adj


def graph_rows(G: nx.Graph) -> tuple[list[Hashable], list, dict | None]:
    """``(nodes, rows, index)`` for :func:`eliminate_min_fill` on ``G``.

    With the compiled engine and an undirected graph, ``rows`` are ``G``'s
    own neighbour dicts and ``index`` maps each vertex to its position:
    the engine reads labels directly, and no Python sets are built (for a
    graph of many small neighbourhoods, building them costs as much as the
    compiled elimination).  Otherwise ``rows`` are the integer
    sets of :func:`index_graph` and ``index`` is None.
    """
    adjacency = getattr(G, "_adj", None)
    if compiled is None or G.is_directed() or type(adjacency) is not dict:
        nodes, adj = index_graph(G)
        return nodes, adj, None
    nodes = list(G)
    return nodes, [adjacency[v] for v in nodes], dict(zip(nodes, range(len(nodes))))


def triangle_counts(adj: list[set[int]], stop=None) -> list[int] | None:
    """``t[v]`` = number of edges among the neighbours of ``v``.

    The fill-in of ``v`` is then ``deg(v) * (deg(v) - 1) / 2 - t[v]``.
    Sparse graphs use one set intersection per edge; dense graphs of
    moderate size one AND and popcount of two bitsets per edge, which is
    much faster there (a 2,800-vertex graph of 130,000 edges: 0.09 s
    against 0.8 s for the float32 matrix product used before).

    ``stop`` is called every :data:`TRIANGLE_STOP_EVERY` vertices; when it returns true the count
    is abandoned and None returned (it takes a second or more on graphs of
    several hundred thousand edges, longer than short time limits).
    """
    n = len(adj)
    m2 = sum(len(a) for a in adj)
    t = [0] * n
    if n and n <= DENSE_MAX_VERTICES and m2 >= 16 * n:
        bits = bitsets_of(adj, list(range(n)), list(range(n)))
        for u in range(n):
            if stop is not None and u % TRIANGLE_STOP_EVERY == TRIANGLE_STOP_EVERY - 1 and stop():
                return None
            bu = bits[u]
            for w in adj[u]:
                if w > u:
                    c = (bu & bits[w]).bit_count()
                    t[u] += c
                    t[w] += c
        return [x // 2 for x in t]
    for u in range(n):
        if stop is not None and u % TRIANGLE_STOP_EVERY == TRIANGLE_STOP_EVERY - 1 and stop():
            return None
        au = adj[u]
        for w in au:
            if w > u:
                c = len(au & adj[w])
                if c:
                    t[u] += c
                    t[w] += c
    return [x // 2 for x in t]


DENSE_DEGREE = 32
"""Degree of an eliminated vertex from which the elimination switches to bitsets.

While neighbourhoods are small, Python sets are the cheapest representation:
a step touches a handful of vertices.  Once neighbourhoods hold dozens or
thousands of vertices (wide graphs such as random regular graphs, whose
width is a fifth of their size), the work per fill edge -- an intersection
of two large neighbourhoods and one counter update per common neighbour --
dominates.  Bitsets held as Python ints do the intersection with one C-level
AND and the counter updates with a few word-parallel operations instead.
"""

DENSE_MAX_VERTICES = 24000
"""Switch to bitsets only when at most this many vertices remain.

The bitset of a vertex takes up to ``remaining / 8`` bytes, so all of them
take up to ``remaining**2 / 8`` bytes: 72 MB at this limit.
"""

TRIANGLE_STOP_EVERY = 256
"""Vertices between two calls of the ``stop`` callback while counting triangles."""

STOP_EVERY = 16
"""Elimination steps between two calls of the ``stop`` callback (set phase)."""

FILL_STOP_EVERY = 4096
"""Fill edges added between two calls of ``stop`` within one elimination step."""


class EliminationState:
    """A greedy elimination in progress, shared by its set and bitset phases.

    Parameters
    ----------
    adj : list of set of int
        Adjacency sets; copied, the caller's are not modified.
    rank : sequence of int, optional
        Tie-breaking position of each vertex (default: its index).

    Notes
    -----
    ``deg``, ``t`` (triangle counts, min-fill only) and ``alive`` are indexed
    by vertex and stay valid across the switch from sets to bitsets, so the
    heap entries made by one phase remain meaningful in the other and both
    phases make exactly the same choices.
    """

    __slots__ = (
        "adj", "deg", "t", "alive", "rank", "weight", "heap", "order", "higher", "width", "remaining", "stamp"
    )

    def __init__(self, adj: list[set[int]], rank: Sequence[int] | None = None):
        n = len(adj)
        self.adj = [set(a) for a in adj]
        self.deg = [len(a) for a in self.adj]
        self.t: list[int] | None = None  # set before a min-fill phase reads it
        self.alive = [True] * n
        self.rank = range(n) if rank is None else rank
        self.weight: list = [1] * n  # min-fill: a vertex's fill-in is multiplied by its weight
        self.heap: list[tuple] = []
        self.order: list[int] = []
        self.higher: list[list[int] | None] = [None] * n
        self.width = -1
        self.remaining = n
        self.stamp = n  # min-degree: later pushes queue behind the initial entries

    def take(self, v: int, degree: int, abort_at) -> bool:
        """Eliminate ``v``, of ``degree``, from the bookkeeping every phase
        keeps (alive, remaining, width, order).

        Returns False, leaving ``v`` out of the order, when the width has
        reached ``abort_at``: the caller stops there."""
        self.alive[v] = False
        self.remaining -= 1
        if degree > self.width:
            self.width = degree
            if abort_at is not None and degree >= abort_at:
                return False
        self.order.append(v)
        return True

    def result(self):
        """``(order, higher, tail, width)``: the vertices still alive form the tail.

        Valid also for a run stopped part-way: every vertex still alive goes
        into the tail's single bag, and the higher neighbours of every
        eliminated vertex were alive when it was eliminated, so they are
        eliminated later or in the tail.
        """
        tail = [v for v in range(len(self.alive)) if self.alive[v]]
        return self.order, self.higher, tail, width_with_tail(self.width, tail)


def width_with_tail(width: int, tail: list[int]) -> int:
    """The width of an elimination whose ``tail`` goes into one bag."""
    return max(width, len(tail) - 1) if tail else width


def bit_positions(x: int) -> list[int]:
    """Positions of the set bits of ``x``, in increasing order.

    Few bits: peel off the lowest one at a time (each step costs a few
    word-parallel operations).  Many bits: one pass through numpy, which
    costs about as much as 40 peelings but does not grow with the count.
    """
    if x.bit_count() <= 40:
        out = []
        while x:
            low = x & -x
            out.append(low.bit_length() - 1)
            x ^= low
        return out
    nbytes = (x.bit_length() + 7) // 8
    raw = np.frombuffer(x.to_bytes(nbytes, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def to_bitsets(adj: list[set[int]], alive: list[bool]):
    """Re-index the alive vertices ``0..k-1`` and give each its neighbourhood as a bitset.

    Returns ``(glob, loc, bitsets)``: ``glob[i]`` is the vertex of local
    index ``i``, ``loc[v]`` the local index of vertex ``v`` (-1 when not
    alive) and ``bitsets[i]`` an int with bit ``j`` set when ``glob[j]`` is a
    neighbour of ``glob[i]``.  Local indices keep the vertices' order, and
    dropping the eliminated vertices keeps the ints short.
    """
    glob = [v for v in range(len(adj)) if alive[v]]
    loc = [-1] * len(adj)
    for i, v in enumerate(glob):
        loc[v] = i
    return glob, loc, bitsets_of(adj, glob, loc)


def detach_row(A: list[int], loc: list[int], glob: list[int], higher: list, v: int) -> tuple[int, int, list[int]]:
    """Take vertex ``v`` out of the bitset adjacency ``A`` of the dense
    phases: clear its row, record its neighbours (global indices) as its
    ``higher`` ones, and return its bit, its old row and the row's bit
    positions, which the phase then updates the neighbours with."""
    i = loc[v]
    row = A[i]
    A[i] = 0
    positions = bit_positions(row)
    higher[v] = [glob[j] for j in positions]
    return 1 << i, row, positions


def bitsets_of(adj: list[set[int]], glob: list[int], loc: list[int]) -> list[int]:
    """Neighbourhood bitsets of the vertices ``glob`` in the local numbering ``loc``.

    Few edges: set one bit at a time.  Many: fill a boolean matrix a block
    of rows at a time and pack it with numpy; setting bits one by one would
    copy a growing int per edge, quadratic on dense graphs.
    """
    k = len(glob)
    entries = sum(len(adj[v]) for v in glob)
    if entries <= 8 * k:
        out = []
        for v in glob:
            m = 0
            for u in adj[v]:
                m |= 1 << loc[u]
            out.append(m)
        return out
    out = []
    loc_arr = np.asarray(loc, dtype=np.int64)
    block = max(1, (1 << 24) // max(k, 1))  # rows per block: about 16 MB of booleans
    for lo in range(0, k, block):
        rows = glob[lo : lo + block]
        mat = np.zeros((len(rows), k), dtype=bool)
        for i, v in enumerate(rows):
            a = adj[v]
            mat[i, loc_arr[np.fromiter(a, dtype=np.int64, count=len(a))]] = True
        packed = np.packbits(mat, axis=1, bitorder="little")
        out.extend(int.from_bytes(row.tobytes(), "little") for row in packed)
    return out


class CommonCounter:
    """Per-vertex counts of how many added bitsets contain each vertex.

    Each fill edge ``(a, b)`` raises the triangle count of every common
    neighbour of ``a`` and ``b`` by one.  Doing that one vertex at a time is
    what made wide graphs slow (hundreds of millions of Python increments on
    a 10,000-vertex random 3-regular graph), so the sets of common
    neighbours are summed bitwise instead, as in a carry-save adder tree:
    level ``k`` holds at most two pending bitsets of weight ``2**k``, and a
    third one arriving is folded with them into one bitset of that level and
    a carry for the next.  An addition then costs five word-parallel
    operations on average, however large the counts grow.
    """

    __slots__ = ("levels",)

    def __init__(self):
        self.levels: list[list[int]] = []

    def add(self, x: int, k: int = 0) -> None:
        """Add 1 (``2**k`` with ``k``) at every set bit of ``x``."""
        levels = self.levels
        while True:
            if k == len(levels):
                levels.append([x])
                return
            pending = levels[k]
            if len(pending) < 2:
                pending.append(x)
                return
            a, b = pending
            u = a ^ b
            pending[0] = u ^ x
            del pending[1]
            x = (a & b) | (u & x)
            k += 1

    def totals(self, nbits: int) -> tuple[list[int], list[int]]:
        """``(positions, counts)`` of the non-zero counts; positions below ``nbits``."""
        levels = self.levels
        if len(levels) == 1 and len(levels[0]) == 1:
            pos = bit_positions(levels[0][0])
            return pos, [1] * len(pos)
        nbytes = (nbits + 7) // 8
        total = np.zeros(nbytes * 8, dtype=np.int64)
        for k, pending in enumerate(levels):
            for x in pending:
                raw = np.frombuffer(x.to_bytes(nbytes, "little"), dtype=np.uint8)
                total += np.unpackbits(raw, bitorder="little").astype(np.int64) << k
        nz = np.flatnonzero(total)
        return nz.tolist(), total[nz].tolist()


def eliminate_min_fill(
    adj: list[set[int]], rank: list[int] | None = None, abort_at: int | None = None, stop=None, weight=None,
    index: dict | None = None,
):
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
    pop and skipped (lazy deletion).  Neighbourhoods are Python sets until a
    vertex of degree :data:`DENSE_DEGREE` is eliminated, bitsets afterwards
    (see :func:`min_fill_dense_phase`); the counts, and so the choices, are
    the same in both.

    Vertices of fill-in zero -- isolated, degree one and simplicial
    vertices -- come first automatically; eliminating them never raises the
    width beyond what is unavoidable.  Once at most ``width + 1`` vertices
    remain, they are put in one final bag (``tail``) without further work.

    If ``abort_at`` is given, the run stops and returns ``None`` as soon as
    the width reaches ``abort_at`` (used to cut short runs that cannot beat
    a known decomposition).  ``stop``, a callable checked every
    :data:`STOP_EVERY` steps and within long steps, ends the run early when
    it returns true: the vertices not yet eliminated then form the tail,
    which still gives a valid (if wide) decomposition.

    ``weight`` (one number per vertex, default all 1) multiplies each
    vertex's fill-in before comparison.  Random weights slightly above 1
    make the choice among vertices of nearly equal fill-in random, which
    explores more orderings than breaking exact ties at random: the
    improvement loop uses this.

    ``index`` (a dict from vertex label to int) says that ``adj[v]`` holds
    labels rather than ints, as the rows of :func:`graph_rows` do.
    """
    if index is not None and compiled is None:
        adj = integer_sets(adj, index)
    if compiled is not None:
        status, s = compiled_min_fill(adj, rank, weight, abort_at, stop, index)
        if status != "dense":
            return None if status == "abort" else s
    else:
        s = EliminationState(adj, rank)
        if weight is not None:
            s.weight = weight
        s.t = triangle_counts(s.adj, stop)
        if s.t is None:
            return s.result()  # stopped before the first step: one bag of everything
        s.heap = min_fill_heap(s)
        status = min_fill_set_phase(s, abort_at, stop)
    if status == "dense":
        status = min_fill_dense_phase(s, abort_at, stop)
    if status == "abort":
        return None
    return s.result()


def min_fill_heap(s: EliminationState) -> list[tuple]:
    """A heap of ``(weighted fill-in, degree, rank, vertex)`` over the live vertices."""
    deg, t, rank, weight = s.deg, cast("list[int]", s.t), s.rank, s.weight  # t: set for min-fill
    heap = [((deg[v] * (deg[v] - 1) // 2 - t[v]) * weight[v], deg[v], rank[v], v) for v in range(len(deg)) if s.alive[v]]
    heapq.heapify(heap)
    return heap


def compiled_min_fill(adj, rank, weight, abort_at, stop, index=None) -> tuple[str, Any]:
    """Run the set phase in :mod:`treedecomp._compiled`.

    ``adj[v]`` holds ``v``'s neighbours as ints, or as labels when ``index``
    (a dict from label to int) is given: :func:`graph_rows` gives a
    networkx graph's own adjacency that way, without building sets.

    Returns ``(status, state)`` with the state :func:`min_fill_set_phase`
    would have left when the bitset phase is to continue (``"dense"``), and
    ``(status, (order, higher, tail, width))`` otherwise.  The compiled phase
    makes the same choices as the Python one; the heap handed to the bitset
    phase is rebuilt from the live vertices (the stale entries the Python
    heap would also hold are skipped on pop, so the choices are unchanged).
    """
    status, order, higher, width, tail, rest, t = compiled.min_fill(
        adj, index, rank, weight, -1 if abort_at is None else abort_at, stop,
        STOP_EVERY, TRIANGLE_STOP_EVERY, DENSE_DEGREE, DENSE_MAX_VERTICES,
    )
    if status != "dense":
        return status, (order, higher, tail, width_with_tail(width, tail))
    s = EliminationState(rest, rank)
    if weight is not None:
        s.weight = weight
    s.order, s.higher, s.width, s.t = order, higher, width, t
    s.alive = [False] * len(rest)
    for v in tail:
        s.alive[v] = True
    s.remaining = len(tail)
    s.heap = min_fill_heap(s)
    return status, s


def min_fill_set_phase(s: EliminationState, abort_at, stop) -> str:
    """Min-fill steps on adjacency sets, until done or the graph turns dense.

    Returns ``"done"`` (all eliminated, or the rest fits in one bag),
    ``"abort"`` (width reached ``abort_at``), ``"stop"`` (``stop()`` said
    so) or ``"dense"`` (the next vertex has degree :data:`DENSE_DEGREE` or
    more: continue with :func:`min_fill_dense_phase`; that vertex is still
    on the heap).
    """
    # t: set before the min-fill phases
    adj, deg, t, alive, rank, weight, heap = s.adj, s.deg, cast("list[int]", s.t), s.alive, s.rank, s.weight, s.heap
    higher = s.higher
    pop = heapq.heappop
    push = heapq.heappush
    steps = 0
    status = "done"
    while heap:
        if s.remaining - 1 <= s.width:
            break
        key, d, r, v = pop(heap)
        if not alive[v] or d != deg[v]:
            continue  # stale heap entry
        f = d * (d - 1) // 2 - t[v]
        if key != f * weight[v]:
            continue  # stale heap entry
        if d >= DENSE_DEGREE and s.remaining <= DENSE_MAX_VERTICES:
            push(heap, (key, d, r, v))
            status = "dense"
            break
        steps += 1
        if stop is not None and steps % STOP_EVERY == 0 and stop():
            status = "stop"
            break
        if not s.take(v, d, abort_at):
            status = "abort"
            break
        Nv = adj[v]
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
            push(heap, ((du * (du - 1) // 2 - t[u]) * weight[u], du, rank[u], u))
    return status


def min_fill_dense_phase(s: EliminationState, abort_at, stop) -> str:
    """Min-fill steps on bitsets, from the state the set phase left; returns its status.

    Each fill edge ``(a, b)`` costs one AND of the two neighbourhoods, a
    popcount, and the addition of the common neighbours to a
    :class:`CommonCounter`, which is read once per step.  Triangle
    counts, degrees and the heap are those of the set phase, so the order of
    elimination is the same as if the set phase had run to the end.
    ``stop`` is checked at every step and every :data:`FILL_STOP_EVERY`
    fill edges.
    """
    glob, loc, A = to_bitsets(s.adj, s.alive)
    s.adj = None  # type: ignore[assignment]  # the bitsets are the adjacency from now on (nothing reads it)
    nbits = len(glob)
    deg, t, alive, rank, weight, heap = s.deg, cast("list[int]", s.t), s.alive, s.rank, s.weight, s.heap  # t: set
    higher = s.higher
    pop = heapq.heappop
    push = heapq.heappush
    status = "done"
    fills = 0
    next_check = FILL_STOP_EVERY
    while heap:
        if s.remaining - 1 <= s.width:
            break
        key, d, r, v = pop(heap)
        if not alive[v] or d != deg[v]:
            continue  # stale heap entry
        f = d * (d - 1) // 2 - t[v]
        if key != f * weight[v]:
            continue  # stale heap entry
        if stop is not None and stop():
            status = "stop"
            break
        if not s.take(v, d, abort_at):
            status = "abort"
            break
        bi, Nm, Nl = detach_row(A, loc, glob, higher, v)
        for j in Nl:
            aj = A[j] ^ bi
            A[j] = aj
            g = glob[j]
            deg[g] -= 1
            t[g] -= d - 1 if f == 0 else (aj & Nm).bit_count()
        changed = set(Nl)
        if d > 1 and f > 0:
            counter = CommonCounter()
            count = counter.add
            for a in Nl:
                aa = A[a]
                missing = (Nm & ~aa) ^ (1 << a)
                if not missing:
                    continue
                ba = 1 << a
                ta = 0
                for b in bit_positions(missing):
                    ab = A[b]
                    common = aa & ab
                    if common:
                        c = common.bit_count()
                        count(common)
                        ta += c
                        t[glob[b]] += c
                    aa |= 1 << b
                    A[b] = ab | ba
                    deg[glob[b]] += 1
                A[a] = aa
                ga = glob[a]
                deg[ga] += missing.bit_count()
                t[ga] += ta
                if stop is not None:
                    fills += missing.bit_count()
                    if fills >= next_check:
                        next_check = fills + FILL_STOP_EVERY
                        if stop():
                            status = "stop"
                            break
            if status == "stop":
                break
            if counter.levels:
                pos, counts = counter.totals(nbits)
                for j, c in zip(pos, counts):
                    t[glob[j]] += c
                changed.update(pos)
        for j in changed:
            u = glob[j]
            du = deg[u]
            push(heap, ((du * (du - 1) // 2 - t[u]) * weight[u], du, rank[u], u))
    return status


def eliminate_min_degree(
    adj: list[set[int]], rank: Sequence[int] | None = None, abort_at: int | None = None, stop=None,
):
    """Greedy minimum-degree elimination; same contract as :func:`eliminate_min_fill`.

    The next vertex is one of least current degree.  Ties go first-in,
    first-out: initially by ``rank`` (default: vertex index), and a vertex
    whose degree changed queues behind those that have waited longer at
    that degree.  This is networkx's tie-breaking for min-degree, and on
    grids and the PACE instances it gives narrower decompositions than
    breaking ties by index.  Only the eliminated vertex's neighbours change
    degree, so each step is one set union and one heap push per neighbour;
    once a vertex of degree :data:`DENSE_DEGREE` is eliminated the unions
    are done on bitsets (:func:`min_degree_dense_phase`).
    """
    s = EliminationState(adj, rank)
    rank = s.rank
    s.heap = [(len(s.adj[v]), rank[v], v) for v in range(len(s.adj))]
    heapq.heapify(s.heap)
    status = min_degree_set_phase(s, abort_at, stop)
    if status == "dense":
        status = min_degree_dense_phase(s, abort_at, stop)
    if status == "abort":
        return None
    return s.result()


def min_degree_set_phase(s: EliminationState, abort_at, stop) -> str:
    """Min-degree steps on adjacency sets; statuses as in :func:`min_fill_set_phase`."""
    adj, alive, heap = s.adj, s.alive, s.heap
    higher = s.higher
    pop = heapq.heappop
    push = heapq.heappush
    stamp = s.stamp
    steps = 0
    status = "done"
    while heap:
        if s.remaining - 1 <= s.width:
            break
        d, st, v = pop(heap)
        if not alive[v] or d != len(adj[v]):
            continue
        if d >= DENSE_DEGREE and s.remaining <= DENSE_MAX_VERTICES:
            push(heap, (d, st, v))
            status = "dense"
            break
        steps += 1
        if stop is not None and steps % STOP_EVERY == 0 and stop():
            status = "stop"
            break
        if not s.take(v, d, abort_at):
            status = "abort"
            break
        Nv = adj[v]
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
    s.stamp = stamp
    return status


def min_degree_dense_phase(s: EliminationState, abort_at, stop) -> str:
    """Min-degree steps on bitsets, continuing the set phase; returns its status.

    A step is one OR, one AND and one popcount per neighbour.  Neighbours
    are visited in increasing index, which fixes the first-in, first-out
    order of equal degrees; the set phase visits them in set order, which
    is nearly but not always the same.
    """
    glob, loc, A = to_bitsets(s.adj, s.alive)
    deg = s.deg
    for v in glob:
        deg[v] = len(s.adj[v])
    s.adj = None  # type: ignore[assignment]  # freed: the bitsets are the adjacency from now on
    alive, heap = s.alive, s.heap
    higher = s.higher
    pop = heapq.heappop
    push = heapq.heappush
    stamp = s.stamp
    status = "done"
    while heap:
        if s.remaining - 1 <= s.width:
            break
        d, _, v = pop(heap)
        if not alive[v] or d != deg[v]:
            continue
        if stop is not None and stop():
            status = "stop"
            break
        if not s.take(v, d, abort_at):
            status = "abort"
            break
        bi, Nm, Nl = detach_row(A, loc, glob, higher, v)
        for j in Nl:
            if d > 1:
                aj = (A[j] | Nm) & ~(bi | (1 << j))
            else:
                aj = A[j] ^ bi
            A[j] = aj
            u = glob[j]
            du = aj.bit_count()
            deg[u] = du
            push(heap, (du, stamp, u))
            stamp += 1
    s.stamp = stamp
    return status


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
    bags: list[frozenset]
    if compiled is not None:
        bags, edges = compiled.build_decomposition(nodes, order, higher, tail)
        return TreeDecomposition(bags, edges)
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
    bags = []
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
