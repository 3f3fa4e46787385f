"""Reading and writing the PACE 2017 ``.gr`` (graph) and ``.td`` (decomposition) formats.

``.gr``::

    c optional comment lines
    p tw N M        (once, before any edge: N vertices numbered 1..N, M edges)
    u v             (M lines, one undirected edge each)

``.td``::

    c optional comment lines
    s td B W N      (B bags, largest bag size W, N vertices of the graph)
    b i v1 v2 ...   (bag i, for i = 1..B; vertices may be absent: empty bag)
    i j             (B - 1 lines, edges of the tree between bags i and j)

Readers accept plain files and ``.xz`` files (recognised by their magic
bytes, whatever the file name), skip blank lines, and raise
:class:`PaceFormatError` naming the file and line on malformed input.
Writers take a path (written ``xz``-compressed if it ends in ``.xz``) or an
open text stream.
"""

from __future__ import annotations

import io
import lzma
import os
from collections.abc import Hashable, Iterable
from typing import IO, cast

import networkx as nx

from .decomposition import TreeDecomposition

__all__ = ["PaceFormatError", "read_gr", "parse_gr", "write_gr", "read_td", "parse_td", "write_td"]

_XZ_MAGIC = b"\xfd7zXZ\x00"


class PaceFormatError(ValueError):
    """Malformed PACE input; ``.source`` and ``.line`` say where (line is 1-based, or None)."""

    def __init__(self, source: str, line: int | None, message: str):
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line


def _open_text(path: str | os.PathLike) -> IO[str]:
    with open(path, "rb") as fh:
        magic = fh.read(len(_XZ_MAGIC))
    if magic == _XZ_MAGIC:
        return io.TextIOWrapper(lzma.open(path, "rb"), encoding="ascii", errors="replace")
    return open(path, encoding="ascii", errors="replace")


def _ints(tokens: list[str], source: str, lineno: int, what: str) -> list[int]:
    try:
        return [int(t) for t in tokens]
    except ValueError:
        raise PaceFormatError(source, lineno, f"{what}: expected integers, got {' '.join(tokens)!r}") from None


def parse_gr(lines: Iterable[str], source: str = "<gr>") -> nx.Graph:
    """Parse ``.gr`` text (an iterable of lines) into a graph on vertices 1..N."""
    G: nx.Graph[int] | None = None
    declared_edges = 0
    edges_seen = 0
    p_line = None
    for lineno, raw in enumerate(lines, 1):
        tokens = raw.split()
        if not tokens or tokens[0] == "c":
            continue
        if tokens[0] == "p":
            if G is not None:
                raise PaceFormatError(source, lineno, f"second 'p' line (first on line {p_line})")
            if len(tokens) != 4 or tokens[1] != "tw":
                raise PaceFormatError(source, lineno, f"expected 'p tw N M', got {raw.strip()!r}")
            n, declared_edges = _ints(tokens[2:], source, lineno, "'p' line")
            if n < 0 or declared_edges < 0:
                raise PaceFormatError(source, lineno, "negative vertex or edge count")
            G = nx.Graph()
            G.add_nodes_from(range(1, n + 1))
            p_line = lineno
            continue
        if G is None:
            raise PaceFormatError(source, lineno, f"edge line before the 'p tw N M' line: {raw.strip()!r}")
        if len(tokens) != 2:
            raise PaceFormatError(source, lineno, f"expected an edge 'u v', got {raw.strip()!r}")
        u, v = _ints(tokens, source, lineno, "edge")
        n = G.number_of_nodes()
        if not (1 <= u <= n and 1 <= v <= n):
            raise PaceFormatError(source, lineno, f"edge ({u}, {v}) has a vertex outside 1..{n}")
        G.add_edge(u, v)
        edges_seen += 1
    if G is None:
        raise PaceFormatError(source, None, "no 'p tw N M' line")
    if edges_seen != declared_edges:
        raise PaceFormatError(
            source, p_line, f"'p' line declares {declared_edges} edges but {edges_seen} edge lines follow"
        )
    return G


def read_gr(path: str | os.PathLike) -> nx.Graph:
    """Read a PACE ``.gr`` file (plain or xz-compressed) into an undirected graph on 1..N.

    Isolated vertices are kept (all of 1..N are nodes).  Raises
    :class:`PaceFormatError` (a ``ValueError``) naming the line for
    malformed input, and ``OSError`` if the file cannot be read.
    """
    with _open_text(path) as fh:
        return parse_gr(fh, os.fspath(path))


def _numbering(G: nx.Graph) -> dict[Hashable, int]:
    nodes = list(G)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in nodes) and sorted(nodes) == list(
        range(1, len(nodes) + 1)
    ):
        return {v: v for v in nodes}
    return {v: i for i, v in enumerate(nodes, 1)}


class _Sink:
    """Text output to a path (xz if it ends in .xz) or to an open stream."""

    def __init__(self, target):
        self.target = target
        self.fh = None

    def __enter__(self) -> IO[str]:
        if hasattr(self.target, "write"):
            return self.target
        path = os.fspath(self.target)
        if path.endswith(".xz"):
            self.fh = io.TextIOWrapper(lzma.open(path, "wb"), encoding="ascii")
        else:
            self.fh = open(path, "w", encoding="ascii")
        return self.fh

    def __exit__(self, *exc):
        if self.fh is not None:
            self.fh.close()


def write_gr(G: nx.Graph, target, *, comment: str | None = None) -> dict[Hashable, int]:
    """Write ``G`` as ``.gr`` to a path or text stream; return the vertex numbering used.

    Vertices that are already exactly the integers 1..N keep their numbers;
    otherwise they are numbered 1..N in ``G``'s order.  A directed graph is
    written as its undirected version; self-loops are dropped.
    """
    num = _numbering(G)
    edges = set()
    for u, v in G.edges():
        if u != v:
            a, b = num[u], num[v]
            edges.add((a, b) if a < b else (b, a))
    with _Sink(target) as fh:
        if comment:
            for line in comment.splitlines():
                fh.write(f"c {line}\n")
        fh.write(f"p tw {len(num)} {len(edges)}\n")
        fh.writelines(f"{a} {b}\n" for a, b in sorted(edges))
    return num


def parse_td(lines: Iterable[str], source: str = "<td>") -> TreeDecomposition:
    """Parse ``.td`` text (an iterable of lines); vertices are the ints of the file."""
    header = None
    bags: list[list[int] | None] = []
    edges: list[tuple[int, int]] = []
    s_line = None
    for lineno, raw in enumerate(lines, 1):
        tokens = raw.split()
        if not tokens or tokens[0] == "c":
            continue
        if tokens[0] == "s":
            if header is not None:
                raise PaceFormatError(source, lineno, f"second 's' line (first on line {s_line})")
            if len(tokens) != 5 or tokens[1] != "td":
                raise PaceFormatError(source, lineno, f"expected 's td B W N', got {raw.strip()!r}")
            header = _ints(tokens[2:], source, lineno, "'s' line")
            if min(header) < 0:
                raise PaceFormatError(source, lineno, "negative number in 's' line")
            bags = [None] * header[0]
            s_line = lineno
            continue
        if header is None:
            raise PaceFormatError(source, lineno, f"line before the 's td B W N' line: {raw.strip()!r}")
        nbags, _, nverts = header
        if tokens[0] == "b":
            nums = _ints(tokens[1:], source, lineno, "bag line")
            if not nums:
                raise PaceFormatError(source, lineno, "bag line without a bag number")
            i = nums[0]
            if not 1 <= i <= nbags:
                raise PaceFormatError(source, lineno, f"bag number {i} outside 1..{nbags}")
            if bags[i - 1] is not None:
                raise PaceFormatError(source, lineno, f"bag {i} given twice")
            for v in nums[1:]:
                if not 1 <= v <= nverts:
                    raise PaceFormatError(source, lineno, f"vertex {v} outside 1..{nverts}")
            bags[i - 1] = nums[1:]
            continue
        if len(tokens) != 2:
            raise PaceFormatError(source, lineno, f"expected a tree edge 'i j', got {raw.strip()!r}")
        i, j = _ints(tokens, source, lineno, "tree edge")
        if not (1 <= i <= nbags and 1 <= j <= nbags):
            raise PaceFormatError(source, lineno, f"tree edge ({i}, {j}) has a bag outside 1..{nbags}")
        edges.append((i - 1, j - 1))
    if header is None:
        raise PaceFormatError(source, None, "no 's td B W N' line")
    missing = [i + 1 for i, b in enumerate(bags) if b is None]
    if missing:
        raise PaceFormatError(source, s_line, f"bags declared but not given: {missing[:10]}")
    td = TreeDecomposition(cast("list[list[int]]", bags), edges)  # none is missing
    if max((len(b) for b in td.bags), default=0) != header[1]:
        raise PaceFormatError(
            source, s_line, f"'s' line says the largest bag has {header[1]} vertices, the bags say {td.width + 1}"
        )
    return td


def read_td(path: str | os.PathLike) -> TreeDecomposition:
    """Read a PACE ``.td`` file (plain or xz-compressed).

    Bag ``i`` of the file becomes bag ``i - 1``; vertices stay the file's
    integers.  The ``s`` line's largest-bag size must match the bags.
    """
    with _open_text(path) as fh:
        return parse_td(fh, os.fspath(path))


def write_td(
    td: TreeDecomposition,
    target,
    *,
    n_vertices: int | None = None,
    numbering: dict[Hashable, int] | None = None,
    comment: str | None = None,
) -> None:
    """Write ``td`` in ``.td`` format to a path or a text stream.

    Vertices must be the integers 1..N, or ``numbering`` (as returned by
    :func:`write_gr`) maps them to those integers.  ``n_vertices`` (N in the
    ``s`` line) defaults to ``len(numbering)`` or the largest vertex number.
    """
    if numbering is not None:
        td = td.relabel(numbering)
    if n_vertices is None:
        n_vertices = len(numbering) if numbering is not None else max(td.vertices(), default=0)
    with _Sink(target) as fh:
        if comment:
            for line in comment.splitlines():
                fh.write(f"c {line}\n")
        fh.write(f"s td {len(td.bags)} {td.width + 1} {n_vertices}\n")
        for i, bag in enumerate(td.bags, 1):
            fh.write(" ".join(["b", str(i), *map(str, sorted(bag))]) + "\n")
        fh.writelines(f"{i + 1} {j + 1}\n" for i, j in td.edges)
