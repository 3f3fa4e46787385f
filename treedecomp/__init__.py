"""treedecomp: fast tree decompositions of sparse graphs (networkx in, bags out).

Tree decompositions of computation graphs give checkpoint candidates: every
bag, and every intersection of two neighbouring bags, separates the graph.
Neural-network graphs have small treewidth, so greedy elimination
heuristics find narrow decompositions; this package implements them with
incremental data structures so that graphs of tens of thousands of
vertices take well under a second.

Public API
----------
TreeDecomposition, Separator      the result type and its edge separators
min_fill, min_degree              greedy heuristics -> TreeDecomposition
improve                           repeated randomised runs within a time budget
treewidth_exact                   exact treewidth of small graphs
minor_min_width                   a lower bound
validate, is_valid                check the three decomposition properties
read_gr, write_gr, read_td, write_td   PACE 2017 file formats
elimination_ordering, decomposition_from_ordering

Command line: ``python -m treedecomp [--heuristic min-fill|min-degree]
[--timeout S] FILE.gr > FILE.td``.
"""

from .bounds import minor_min_width
from .decomposition import Separator, TreeDecomposition
from .exact import treewidth_exact
from .heuristics import decomposition_from_ordering, elimination_ordering, min_degree, min_fill
from .improve import ImproveResult, improve, improve_with_stats
from .pace import PaceFormatError, parse_gr, parse_td, read_gr, read_td, write_gr, write_td
from .validate import InvalidDecomposition, is_valid, validate

__all__ = [
    "TreeDecomposition",
    "Separator",
    "min_fill",
    "min_degree",
    "elimination_ordering",
    "decomposition_from_ordering",
    "improve",
    "improve_with_stats",
    "ImproveResult",
    "treewidth_exact",
    "minor_min_width",
    "validate",
    "is_valid",
    "InvalidDecomposition",
    "read_gr",
    "parse_gr",
    "write_gr",
    "read_td",
    "parse_td",
    "write_td",
    "PaceFormatError",
]

__version__ = "0.1.0"
