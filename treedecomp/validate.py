"""Checking that a :class:`TreeDecomposition` really decomposes a graph.

:func:`validate` checks, in this order,

* ``"tree"`` -- the bag graph is a tree: ``len(bags) - 1`` edges, no
  self-loop or repeated edge, connected;
* ``"vertices"`` -- every vertex of ``G`` is in some bag, and bags contain
  nothing that is not a vertex of ``G``;
* ``"edges"`` -- both ends of every edge of ``G`` share some bag;
* ``"connectedness"`` -- for every vertex, the bags containing it form a
  connected subtree (the running-intersection property);

and raises :class:`InvalidDecomposition` naming the first property that
fails, with an example.  The checks run in time linear in the total size of
the bags plus the sizes of the bag intersections along tree edges.

A directed graph is checked as its undirected version.  The empty graph's
only valid decomposition is the empty one; a decomposition of a non-empty
graph must have at least one bag.
"""

from __future__ import annotations

import networkx as nx

from .decomposition import TreeDecomposition

__all__ = ["InvalidDecomposition", "validate", "is_valid"]


class InvalidDecomposition(ValueError):
    """Raised by :func:`validate`; ``.property`` names the failing property.

    ``property`` is one of ``"tree"``, ``"vertices"``, ``"edges"`` and
    ``"connectedness"``.
    """

    def __init__(self, prop: str, message: str):
        super().__init__(f"{prop}: {message}")
        self.property = prop


def _check_tree(td: TreeDecomposition) -> None:
    nb = len(td.bags)
    if nb == 0:
        return
    if len(td.edges) != nb - 1:
        raise InvalidDecomposition(
            "tree", f"{nb} bags need exactly {nb - 1} tree edges, found {len(td.edges)}"
        )
    parent = list(range(nb))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in td.edges:
        if i == j:
            raise InvalidDecomposition("tree", f"tree edge ({i}, {j}) is a self-loop")
        ri, rj = find(i), find(j)
        if ri == rj:
            raise InvalidDecomposition("tree", f"tree edge ({i}, {j}) closes a cycle")
        parent[ri] = rj
    # n - 1 edges and no cycle: a tree.


def validate(G: nx.Graph, td: TreeDecomposition) -> None:
    """Raise :class:`InvalidDecomposition` unless ``td`` is a tree decomposition of ``G``.

    See the module documentation for the properties checked and their names.
    Returns ``None`` when ``td`` is valid.
    """
    _check_tree(td)
    bags = td.bags
    if len(G) and not bags:
        raise InvalidDecomposition("vertices", f"graph has {len(G)} vertices but there are no bags")
    bags_of: dict = {v: [] for v in G}
    for i, bag in enumerate(bags):
        for v in bag:
            lst = bags_of.get(v)
            if lst is None:
                raise InvalidDecomposition("vertices", f"bag {i} contains {v!r}, which is not a vertex of the graph")
            lst.append(i)
    for v, lst in bags_of.items():
        if not lst:
            raise InvalidDecomposition("vertices", f"vertex {v!r} is in no bag")
    for u, v in G.edges():
        if u == v:
            continue
        bu, bv = bags_of[u], bags_of[v]
        if len(bu) > len(bv):
            bu, u, v = bv, v, u
        if not any(v in bags[i] for i in bu):
            raise InvalidDecomposition("edges", f"no bag contains both ends of edge ({u!r}, {v!r})")
    # The bags holding v induce a subforest of the tree; it is connected
    # exactly when it has one edge fewer than nodes.
    inner_edges: dict = dict.fromkeys(bags_of, 0)
    for i, j in td.edges:
        for v in bags[i] & bags[j]:
            inner_edges[v] += 1
    for v, lst in bags_of.items():
        if inner_edges[v] != len(lst) - 1:
            raise InvalidDecomposition(
                "connectedness",
                f"the {len(lst)} bags containing {v!r} form {len(lst) - inner_edges[v]} "
                f"separate subtrees (first bags: {sorted(lst)[:5]})",
            )


def is_valid(G: nx.Graph, td: TreeDecomposition) -> bool:
    """True when ``td`` is a tree decomposition of ``G`` (see :func:`validate`)."""
    try:
        validate(G, td)
    except InvalidDecomposition:
        return False
    return True
