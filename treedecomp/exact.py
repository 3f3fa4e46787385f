"""Exact treewidth for small graphs.

The method is a search over *sets of eliminated vertices* (the dynamic
programme of Bodlaender, Fomin, Koster, Kratsch and Thilikos, "On exact
algorithms for treewidth", run depth first), answering for increasing
``k`` the question "is the treewidth at most ``k``?".  What makes it
practical on graphs of a few dozen vertices:

* After eliminating a set ``S`` in any order, the remaining graph ``H_S`` is
  the same: two remaining vertices are adjacent when they are adjacent in
  ``G`` or joined by a path through ``S``.  So the search needs only the set
  ``S``, not the order, and a set that failed once is never searched again.
  Sets are Python integers used as bitsets.
* Safe reduction rules (Bodlaender and Koster, "Safe separators and
  reduction rules"): a simplicial vertex, or an almost simplicial vertex of
  degree at most a known lower bound, can be eliminated first without loss.
  They are applied to the whole graph first and, in the decision search, to
  every state (there "lower bound" becomes the ``k`` being tested), where a
  safe vertex is the only branch taken.
* Any clique can be eliminated last in some optimal ordering, so a large
  clique found greedily is never branched on.
* When testing ``k``, two non-adjacent vertices with more than ``k``
  common neighbours may be joined by an edge first (this cannot change
  whether the treewidth is at most ``k``), which shrinks the search; and
  if the minor-min-width of that denser graph exceeds ``k`` the answer is
  no without any search.
* Connected components are solved separately, the heuristic width serves
  as an upper bound, and minor-min-width plus clique size as lower bounds;
  when they meet no search happens at all.

The running time is exponential in the number of vertices in the worst
case.  In practice (two cores, CPython 3.11): graphs of up to 60 vertices and
width up to about 8 take milliseconds when the bounds meet, random graphs of
25-30 vertices and width 10-13 take seconds to a minute, and grid-like graphs
of 49-60 vertices where the lower bound is weak do not finish in a minute.
``max_vertices`` and ``timeout`` keep calls from running away.
"""

from __future__ import annotations

import time
from collections import deque

import networkx as nx

from ._elimination import build_decomposition, eliminate_in_order, eliminate_min_degree, eliminate_min_fill, index_graph
from .bounds import min_width_of_adjacency
from .decomposition import TreeDecomposition

__all__ = ["treewidth_exact"]


class _Timeout(Exception):
    """Raised inside the solver when the deadline passes; becomes ``TimeoutError``."""


class Deadline:
    """The optional time limit of one :func:`treewidth_exact` call.

    Parameters
    ----------
    timeout : float or None
        Seconds from now; ``None`` means no limit.

    Notes
    -----
    Every loop of the solver that can run long on a large graph (the
    heuristic upper bounds, the reductions, the clique search, the graph
    improvement, the decision search) calls :meth:`check` often enough that
    the limit is kept to a few milliseconds.
    """

    __slots__ = ("at",)

    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.perf_counter() + timeout

    def expired(self) -> bool:
        """True once the limit has passed (never without a limit)."""
        return self.at is not None and time.perf_counter() > self.at

    def check(self) -> None:
        """Raise ``_Timeout`` once the limit has passed."""
        if self.at is not None and time.perf_counter() > self.at:
            raise _Timeout


def _neighbourhood_mask(adj_set: set[int]) -> int:
    m = 0
    for u in adj_set:
        m |= 1 << u
    return m


def _safe_reductions(adj: list[set[int]], low: int, deadline: Deadline):
    """Apply the simplicial and almost-simplicial rules until none applies.

    Returns ``(prefix, adj_reduced, alive, low)``: the eliminated vertices in
    order, the adjacency after eliminating them, which vertices remain, and
    the (possibly raised) lower bound.  ``low`` must be a lower bound on the
    treewidth of the graph.
    """
    n = len(adj)
    adj = [set(a) for a in adj]
    alive = [True] * n
    prefix: list[int] = []
    queue = deque(range(n))
    queued = [True] * n
    pops = 0
    while queue:
        pops += 1
        if pops % 64 == 0:
            deadline.check()
        v = queue.popleft()
        queued[v] = False
        if not alive[v]:
            continue
        N = adj[v]
        d = len(N)
        missing = {u: d - 1 - len(N & adj[u]) for u in N}
        f2 = sum(missing.values())  # twice the fill-in of v
        if f2 == 0:
            safe = True
            if d > low:
                low = d
                for u in range(n):  # a higher bound may unlock more vertices
                    if alive[u] and not queued[u]:
                        queue.append(u)
                        queued[u] = True
        else:
            safe = d <= low and any(2 * m == f2 for m in missing.values())
        if not safe:
            continue
        alive[v] = False
        prefix.append(v)
        adj[v] = set()
        for u in N:
            au = adj[u]
            au.discard(v)
            au |= N
            au.discard(u)
            if not queued[u]:
                queue.append(u)
                queued[u] = True
    return prefix, adj, alive, low


def _greedy_clique(am: list[int], deadline: Deadline) -> int:
    """A large clique (bitmask) found greedily from every start vertex."""
    best = 0
    c = len(am)
    for s in range(c):
        deadline.check()
        clique = 1 << s
        cand = am[s]
        while cand:
            # take the candidate with most neighbours among the candidates
            best_v, best_deg = -1, -1
            x = cand
            while x:
                b = x & -x
                v = b.bit_length() - 1
                dv = (am[v] & cand).bit_count()
                if dv > best_deg:
                    best_v, best_deg = v, dv
                x ^= b
            clique |= 1 << best_v
            cand &= am[best_v]
        if clique.bit_count() > best.bit_count():
            best = clique
    return best


def _improved_graph(am: list[int], k: int, deadline: Deadline) -> list[int]:
    """Add edges between non-adjacent vertices with more than ``k`` common neighbours.

    If the treewidth is at most ``k`` such an edge can be added without
    raising it (the pair would be joined in every minimal triangulation of
    width ``k``; Bodlaender and Koster, "Treewidth lower bounds"), so the
    question "treewidth <= k?" has the same answer on the denser graph,
    whose search space is smaller.  Repeated until nothing changes.
    """
    am = list(am)
    c = len(am)
    changed = True
    while changed:
        changed = False
        for v in range(c):
            deadline.check()
            for w in range(v + 1, c):
                if not (am[v] >> w) & 1 and (am[v] & am[w]).bit_count() > k:
                    am[v] |= 1 << w
                    am[w] |= 1 << v
                    changed = True
    return am


def _mmw_exceeds(nh: list[int], alive: int, k: int, deadline: Deadline) -> bool:
    """True if the minor-min-width of the graph (bitmask adjacency ``nh`` on ``alive``) exceeds ``k``."""
    nh = list(nh)
    r = alive.bit_count()
    while r > k + 1:
        deadline.check()
        # vertex of minimum degree
        best_v, best_d = -1, 1 << 30
        x = alive
        while x:
            b = x & -x
            v = b.bit_length() - 1
            x ^= b
            d = nh[v].bit_count()
            if d < best_d:
                best_v, best_d = v, d
        if best_d > k:
            return True
        v = best_v
        bv = 1 << v
        N = nh[v]
        alive &= ~bv
        r -= 1
        if not N:
            continue
        # contract v into the neighbour with the fewest common neighbours
        best_u, best_c = -1, 1 << 30
        y = N
        while y:
            b = y & -y
            u = b.bit_length() - 1
            y ^= b
            cu = (nh[u] & N).bit_count()
            if cu < best_c:
                best_u, best_c = u, cu
        u = best_u
        bu = 1 << u
        y = N & ~bu
        while y:
            b = y & -y
            w = b.bit_length() - 1
            y ^= b
            nh[w] = (nh[w] & ~bv) | bu
        nh[u] = (nh[u] | N) & ~bv & ~bu
    return False


def _decide(am: list[int], k: int, last: int, deadline: Deadline) -> list[int] | None:
    """An elimination ordering of width <= ``k`` of the graph ``am`` (bitmask adjacency), or None.

    ``last`` is a clique (bitmask) that may be kept for the end.
    """
    c = len(am)
    full = (1 << c) - 1
    am = _improved_graph(am, k, deadline)
    if _mmw_exceeds(am, full, k, deadline):
        return None
    failed: set[int] = set()
    path: list[int] = []
    counter = [0]

    def remaining_graph(S: int) -> list[int]:
        """Neighbourhoods in H_S of every vertex outside S (0 for vertices in S)."""
        nh = [0] * c
        comps_nb = []
        rest = S
        while rest:
            b = rest & -rest
            comp = b
            frontier = b
            border = 0
            while frontier:
                nb = 0
                f = frontier
                while f:
                    bb = f & -f
                    nb |= am[bb.bit_length() - 1]
                    f ^= bb
                border |= nb
                frontier = nb & S & ~comp
                comp |= frontier
            comps_nb.append(border & ~S)
            rest &= ~comp
        out = full & ~S
        x = out
        while x:
            b = x & -x
            v = b.bit_length() - 1
            m = am[v]
            for nbm in comps_nb:
                if nbm & b:
                    m |= nbm
            nh[v] = m & out & ~b
            x ^= b
        return nh

    def search(S: int, size: int) -> bool:
        if c - size <= k + 1:
            return True
        if S in failed:
            return False
        counter[0] += 1
        if counter[0] % 16 == 0:
            deadline.check()
        nh = remaining_graph(S)
        cands = []
        x = full & ~S & ~last
        while x:
            b = x & -x
            v = b.bit_length() - 1
            x ^= b
            d = nh[v].bit_count()
            if d <= k:
                cands.append((d, v))
        cands.sort()
        for d, v in cands:
            # almost simplicial (or simplicial) in H_S with degree <= k: safe, forced
            N = nh[v]
            miss = []
            y = N
            while y:
                bu = y & -y
                u = bu.bit_length() - 1
                y ^= bu
                miss.append((N & ~nh[u] & ~bu).bit_count())
            f2 = sum(miss)
            if f2 == 0 or any(2 * m == f2 for m in miss):
                path.append(v)
                if search(S | (1 << v), size + 1):
                    return True
                path.pop()
                failed.add(S)
                return False
        for d, v in cands:
            path.append(v)
            if search(S | (1 << v), size + 1):
                return True
            path.pop()
        failed.add(S)
        return False

    if not search(0, 0):
        return None
    done = 0
    for v in path:
        done |= 1 << v
    return path + [v for v in range(c) if not (done >> v) & 1]


def treewidth_exact(G: nx.Graph, *, max_vertices: int = 60, timeout: float | None = None) -> TreeDecomposition:
    """A tree decomposition of ``G`` of minimum width.

    Parameters
    ----------
    G : networkx graph
        Directed graphs are treated as undirected; self-loops are ignored.
    max_vertices : int
        The exponential search runs on the connected components left after
        the safe reduction rules.  If one of those that actually needs
        searching has more than ``max_vertices`` vertices, ``ValueError`` is
        raised instead of starting a search that could take hours.  Larger
        graphs are fine when reductions and bounds settle them (trees,
        cycles, chordal graphs, ...).
    timeout : float, optional
        Seconds; when exceeded, ``TimeoutError`` is raised.

    Returns
    -------
    TreeDecomposition
        Of width equal to the treewidth of ``G`` (``-1`` for the empty graph).
    """
    deadline = Deadline(timeout)
    try:
        return _treewidth_exact(G, max_vertices, deadline)
    except _Timeout:
        raise TimeoutError(f"exact treewidth: no answer within {timeout} s") from None


def _components(radj: list[set[int]], alive: list[bool]) -> list[list[int]]:
    """Connected components of the alive vertices, smallest first (settled fastest)."""
    comps = []
    seen = [not a for a in alive]
    for s in range(len(radj)):
        if seen[s]:
            continue
        comp = [s]
        seen[s] = True
        for v in comp:
            for u in radj[v]:
                if not seen[u]:
                    seen[u] = True
                    comp.append(u)
        comps.append(comp)
    comps.sort(key=len)
    return comps


def _treewidth_exact(G: nx.Graph, max_vertices: int, deadline: Deadline) -> TreeDecomposition:
    """:func:`treewidth_exact` with the time limit as a :class:`Deadline` (raises ``_Timeout``)."""
    nodes, adj = index_graph(G)
    n = len(nodes)
    if n == 0:
        return TreeDecomposition([], [])
    runs = [engine(adj, stop=deadline.expired) for engine in (eliminate_min_fill, eliminate_min_degree)]
    deadline.check()  # a run cut short by the deadline is no upper bound worth having
    upper = min(runs, key=lambda r: r[3])
    ub = upper[3]

    def heuristic_answer() -> TreeDecomposition:
        order, higher, tail, _ = upper
        return build_decomposition(nodes, order, higher, tail)

    low = min_width_of_adjacency(adj, stop=deadline.expired)
    deadline.check()
    if low >= ub:
        return heuristic_answer()
    prefix, radj, alive, low = _safe_reductions(adj, low, deadline)
    if low >= ub:
        return heuristic_answer()
    answer = low
    ordering = list(prefix)
    for comp in _components(radj, alive):
        if len(comp) - 1 <= answer:
            ordering.extend(comp)
            continue
        solved = _solve_component(comp, radj, answer, ub, max_vertices, deadline)
        if solved is None:
            return heuristic_answer()  # no width below the heuristic's is possible
        answer, local_order = solved
        ordering.extend(local_order)
    order, higher, tail, width = eliminate_in_order(adj, ordering)
    if width != answer:  # pragma: no cover - would be a bug in this module
        raise AssertionError(f"exact treewidth: ordering has width {width}, expected {answer}")
    return build_decomposition(nodes, order, higher, tail)


def _solve_component(comp, radj, answer, ub, max_vertices, deadline):
    """Treewidth of one component, if below ``ub``: ``(max(answer, width), ordering)`` or None.

    ``answer`` is the width already needed by the components solved so far,
    so widths up to it need no search here.  Returns None when no width
    below ``ub`` (the heuristic's) is possible, so the heuristic answer is
    optimal.
    """
    local = {v: i for i, v in enumerate(comp)}
    am = [_neighbourhood_mask({local[u] for u in radj[v]}) for v in comp]
    comp_adj = [{local[u] for u in radj[v]} for v in comp]
    low = max(answer, min_width_of_adjacency(comp_adj, stop=deadline.expired))
    deadline.check()
    if low >= ub:
        return None
    clique = _greedy_clique(am, deadline)
    start = max(low, clique.bit_count() - 1)
    if start >= ub:
        return None
    if len(comp) > max_vertices:
        raise ValueError(
            f"exact treewidth: after safe reductions a component of {len(comp)} vertices "
            f"remains (widths {start}..{ub} possible), above max_vertices={max_vertices}"
        )
    for k in range(start, ub):
        local_order = _decide(am, k, clique, deadline)
        if local_order is not None:
            return k, [comp[i] for i in local_order]
    return None
