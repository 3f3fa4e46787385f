"""The :class:`TreeDecomposition` container and its separators.

A tree decomposition of a graph ``G`` is a tree ``T`` whose nodes carry
*bags* (sets of vertices of ``G``) such that

1. every vertex of ``G`` is in some bag,
2. both ends of every edge of ``G`` are together in some bag, and
3. for every vertex, the bags containing it form a connected subtree of ``T``.

The *width* is the size of the largest bag minus one.

In this module the tree's nodes are the integers ``0 .. len(bags) - 1`` (the
positions of the bags), so a decomposition is just a tuple of frozensets and
a list of index pairs.  Keeping the tree over indices rather than over the
bags themselves (as networkx's treewidth functions do) allows two bags with
equal contents and makes the structure cheap to copy and to serialise.

The property that makes decompositions useful for checkpointing is that
every bag, and every intersection of two neighbouring bags, *separates* the
graph: removing ``bags[i] & bags[j]`` for a tree edge ``(i, j)`` leaves no
path between the vertices that occur only on ``i``'s side of the tree and
those that occur only on ``j``'s side.  :meth:`TreeDecomposition.separators`
lists these separators together with the two sides.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

import networkx as nx

__all__ = ["TreeDecomposition", "Separator"]


class Separator:
    """The separator along one tree edge ``(i, j)`` of a decomposition.

    Attributes
    ----------
    edge : tuple[int, int]
        The tree edge, oriented as it is stored in the decomposition.
    separator : frozenset
        ``bags[i] & bags[j]``.  In a valid decomposition of ``G`` every path
        of ``G`` from :attr:`side_i` to :attr:`side_j` passes through it.
    size_i, size_j : int
        Number of vertices on each side (cheap: no set is built).

    :attr:`side_i` and :attr:`side_j` (the vertices that occur only in bags
    on ``i``'s, respectively ``j``'s, side of the tree, separator excluded)
    are built on first access, because materialising both sides of every
    edge of a long decomposition would take quadratic time and memory.
    """

    __slots__ = ("edge", "separator", "_order", "_lo", "_hi", "_child_is_i", "_sides")

    def __init__(self, edge, separator, order, lo, hi, child_is_i):
        self.edge: tuple[int, int] = edge
        self.separator: frozenset = separator
        # order[lo:hi] are exactly the vertices strictly on the child's side.
        self._order = order
        self._lo = lo
        self._hi = hi
        self._child_is_i = child_is_i
        self._sides = None

    @property
    def size_i(self) -> int:
        return self._child_size() if self._child_is_i else self._parent_size()

    @property
    def size_j(self) -> int:
        return self._parent_size() if self._child_is_i else self._child_size()

    def _child_size(self) -> int:
        return self._hi - self._lo

    def _parent_size(self) -> int:
        return len(self._order) - (self._hi - self._lo) - len(self.separator)

    def _build_sides(self):
        if self._sides is None:
            order = self._order
            child = frozenset(order[self._lo : self._hi])
            rest = [v for v in order[: self._lo] if v not in self.separator]
            rest.extend(v for v in order[self._hi :] if v not in self.separator)
            parent = frozenset(rest)
            self._sides = (child, parent) if self._child_is_i else (parent, child)
        return self._sides

    @property
    def preorder_slice(self) -> tuple[list, int, int]:
        """``(order, lo, hi)``: ``order`` lists every vertex of the
        decomposition once, in a preorder of its tree, and ``order[lo:hi]``
        are the vertices strictly on the side away from the root.

        All separators of one decomposition share the same ``order`` list
        object, so prefix sums over it (computed once, keyed by
        ``id(order)``) give any per-vertex total of a side in constant time
        per separator, where :attr:`side_i` and :attr:`side_j` would build
        sets.  Do not modify the list.

        Examples
        --------
        >>> from treedecomp import TreeDecomposition
        >>> td = TreeDecomposition([{1, 2}, {2, 3}, {3, 4}], [(0, 1), (1, 2)])
        >>> order, lo, hi = td.separators()[1].preorder_slice
        >>> sorted(order[lo:hi])
        [4]
        """
        return self._order, self._lo, self._hi

    @property
    def side_i(self) -> frozenset:
        return self._build_sides()[0]

    @property
    def side_j(self) -> frozenset:
        return self._build_sides()[1]

    def __repr__(self) -> str:
        return (
            f"Separator(edge={self.edge}, separator={set(self.separator)!r}, "
            f"size_i={self.size_i}, size_j={self.size_j})"
        )


class TreeDecomposition:
    """A tree decomposition: bags (frozensets) and a tree over bag indices.

    Parameters
    ----------
    bags : iterable of iterables of hashable vertices
        Bag ``i`` becomes ``frozenset(bags[i])``.
    edges : iterable of pairs of ints
        The tree edges, as pairs of bag indices.

    The constructor checks only that the edge indices are in range; whether
    the structure really is a tree decomposition of some graph is checked by
    :func:`treedecomp.validate`.

    The decomposition of the empty graph has no bags and width ``-1``.
    """

    __slots__ = ("_bags", "_edges", "_adj")

    def __init__(self, bags: Iterable[Iterable[Hashable]], edges: Iterable[tuple[int, int]] = ()):
        self._bags: tuple[frozenset, ...] = tuple(frozenset(b) for b in bags)
        nb = len(self._bags)
        checked = []
        for e in edges:
            i, j = e
            i, j = int(i), int(j)
            if not (0 <= i < nb and 0 <= j < nb):
                raise ValueError(f"tree edge {e!r} refers to a bag index outside 0..{nb - 1}")
            checked.append((i, j))
        self._edges: tuple[tuple[int, int], ...] = tuple(checked)
        self._adj: list[list[int]] | None = None  # each bag's tree neighbours, made when first asked

    # ------------------------------------------------------------------ basics
    @property
    def bags(self) -> tuple[frozenset, ...]:
        """The bags, indexed by tree node."""
        return self._bags

    @property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """The tree edges as pairs of bag indices."""
        return self._edges

    @property
    def width(self) -> int:
        """Largest bag size minus one (``-1`` when there are no bags)."""
        return max((len(b) for b in self._bags), default=0) - 1

    def __len__(self) -> int:
        return len(self._bags)

    def __iter__(self) -> Iterator[frozenset]:
        return iter(self._bags)

    def __repr__(self) -> str:
        return f"TreeDecomposition({len(self._bags)} bags, {len(self._edges)} edges, width {self.width})"

    def __eq__(self, other: object) -> bool:
        """Equal when bags and tree agree exactly (same indices, edge order ignored)."""
        if not isinstance(other, TreeDecomposition):
            return NotImplemented
        norm = lambda es: sorted((min(e), max(e)) for e in es)  # noqa: E731
        return self._bags == other._bags and norm(self._edges) == norm(other._edges)

    # mutable-looking container semantics; not hashable (the ignore: object's __hash__ is a method)
    __hash__ = None  # type: ignore[assignment]

    def neighbors(self, i: int) -> list[int]:
        """Tree neighbours of bag ``i``."""
        return list(self._adjacency()[i])

    def _adjacency(self) -> list[list[int]]:
        if self._adj is None:
            adj: list[list[int]] = [[] for _ in self._bags]
            for i, j in self._edges:
                adj[i].append(j)
                adj[j].append(i)
            self._adj = adj
        return self._adj

    def vertices(self) -> frozenset:
        """All vertices occurring in some bag."""
        return frozenset().union(*self._bags)

    def relabel(self, mapping: Mapping | Callable[[Any], Hashable]) -> "TreeDecomposition":
        """Return a copy with every vertex ``v`` replaced by ``mapping[v]``.

        ``mapping`` may be a mapping or a callable.
        """
        f = mapping.__getitem__ if hasattr(mapping, "__getitem__") else mapping
        return TreeDecomposition(([f(v) for v in b] for b in self._bags), self._edges)

    # ------------------------------------------------------------- separators
    def separators(self) -> list[Separator]:
        """One :class:`Separator` per tree edge, in the order of :attr:`edges`.

        For a tree edge ``(i, j)`` the separator is ``S = bags[i] & bags[j]``;
        ``side_i`` is the set of vertices that occur in bags on ``i``'s side
        of the edge but not in ``S``, and ``side_j`` likewise.  In a valid
        decomposition of ``G``, ``S`` separates ``side_i`` from ``side_j`` in
        ``G`` and ``side_i | S | side_j`` is every vertex in the bags.

        All sides are found with one depth-first traversal: root the tree,
        list every vertex once, at the first bag (in preorder) that contains
        it.  By the connectedness property, a vertex lies strictly below the
        edge ``(parent, c)`` exactly when its first bag is in the subtree of
        ``c``, and subtrees are contiguous in preorder, so the vertices on
        ``c``'s side are a contiguous slice of that list.  Each separator then
        costs ``O(|S|)`` plus the size of the sides if they are requested.

        The result is only meaningful for a valid decomposition (a tree whose
        bags satisfy the connectedness property); a forest is handled
        component by component.
        """
        nb = len(self._bags)
        if nb == 0:
            return []
        adj = self._adjacency()
        bags = self._bags
        parent = [-1] * nb
        preorder_index = [-1] * nb
        first_pos: list[int] = []  # first_pos[t]: len(order) before the t-th preorder node
        order: list = []
        seen = set()
        subtree_end = [0] * nb  # preorder index one past the node's subtree
        t = 0
        for root in range(nb):
            if preorder_index[root] >= 0:
                continue
            stack = [(root, 0)]
            preorder_index[root] = t
            first_pos.append(len(order))
            t += 1
            for v in bags[root]:
                if v not in seen:
                    seen.add(v)
                    order.append(v)
            while stack:
                node, k = stack[-1]
                nbrs = adj[node]
                if k < len(nbrs):
                    stack[-1] = (node, k + 1)
                    c = nbrs[k]
                    if c == parent[node] or preorder_index[c] >= 0:
                        continue
                    parent[c] = node
                    preorder_index[c] = t
                    first_pos.append(len(order))
                    t += 1
                    for v in bags[c]:
                        if v not in seen:
                            seen.add(v)
                            order.append(v)
                    stack.append((c, 0))
                else:
                    subtree_end[node] = t
                    stack.pop()
        first_pos.append(len(order))
        result = []
        for i, j in self._edges:
            if parent[j] == i:
                child, child_is_i = j, False
            elif parent[i] == j:
                child, child_is_i = i, True
            else:  # not a tree edge of the traversal: the "tree" has a cycle
                raise ValueError(f"edge {(i, j)} closes a cycle; the decomposition is not a tree")
            lo = first_pos[preorder_index[child]]
            hi = first_pos[subtree_end[child]]
            result.append(Separator((i, j), bags[i] & bags[j], order, lo, hi, child_is_i))
        return result

    # ------------------------------------------------------------- conversion
    def to_networkx(self, bag_nodes: bool = False) -> nx.Graph:
        """Return the tree as a networkx graph.

        By default the nodes are the bag indices and each has a ``"bag"``
        attribute.  With ``bag_nodes=True`` the nodes are the bags themselves
        (frozensets), the convention of networkx's ``treewidth_min_fill_in``;
        bags with equal contents then collapse into one node, so this form
        is only faithful when all bags differ.
        """
        T: nx.Graph[Hashable] = nx.Graph()  # nodes: bag indices, or the bags themselves
        if bag_nodes:
            T.add_nodes_from(self._bags)
            T.add_edges_from((self._bags[i], self._bags[j]) for i, j in self._edges)
        else:
            T.add_nodes_from((i, {"bag": b}) for i, b in enumerate(self._bags))
            T.add_edges_from(self._edges)
        return T

    @classmethod
    def from_networkx(cls, T: nx.Graph) -> "TreeDecomposition":
        """Build a decomposition from a networkx tree.

        Two forms are accepted: every node has a ``"bag"`` attribute (the form
        :meth:`to_networkx` writes), or the nodes are themselves collections
        of vertices, as returned by networkx's ``treewidth_min_fill_in`` and
        ``treewidth_min_degree``.
        """
        nodes = list(T.nodes)
        if nodes and all("bag" in T.nodes[u] for u in nodes):
            bags = [T.nodes[u]["bag"] for u in nodes]
        else:
            bags = nodes
        index = {u: k for k, u in enumerate(nodes)}
        return cls(bags, ((index[u], index[v]) for u, v in T.edges))

    def simplified(self) -> "TreeDecomposition":
        """Return an equivalent decomposition without redundant bags.

        Repeatedly contracts tree edges whose one bag is a subset of the
        other (keeping the larger bag).  Validity and width are preserved;
        the number of bags can only drop.
        """
        nb = len(self._bags)
        if nb <= 1:
            return TreeDecomposition(self._bags, self._edges)
        bags = list(self._bags)
        nbrs: list[set[int]] = [set() for _ in range(nb)]
        for i, j in self._edges:
            if i != j:
                nbrs[i].add(j)
                nbrs[j].add(i)
        alive = [True] * nb
        work = list(range(nb))
        while work:
            i = work.pop()
            if not alive[i]:
                continue
            for j in list(nbrs[i]):
                if bags[i] <= bags[j] or bags[j] <= bags[i]:
                    keep, drop = (j, i) if len(bags[i]) <= len(bags[j]) else (i, j)
                    alive[drop] = False
                    for k in nbrs[drop]:
                        if k != keep:
                            nbrs[k].discard(drop)
                            nbrs[k].add(keep)
                            nbrs[keep].add(k)
                    nbrs[keep].discard(drop)
                    nbrs[drop] = set()
                    work.append(keep)
                    break
        new_index = {}
        new_bags: list[frozenset] = []
        for i in range(nb):
            if alive[i]:
                new_index[i] = len(new_bags)
                new_bags.append(bags[i])
        edges = {
            (new_index[i], new_index[j])
            for i in range(nb)
            if alive[i]
            for j in nbrs[i]
            if i < j
        }
        return TreeDecomposition(new_bags, sorted(edges))
