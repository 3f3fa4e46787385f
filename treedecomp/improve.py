"""Improving a heuristic decomposition within a time budget.

Greedy heuristics face many ties (vertices of equal fill-in and degree), and
the width they reach depends on how ties are broken.  :func:`improve` runs
the heuristics again and again with random tie-breaking and keeps the
narrowest decomposition.  Two things keep this cheap: a run is abandoned as
soon as its width reaches the best width found so far, and the search ends
early when the best width meets the minor-min-width lower bound, since no
decomposition can then be narrower.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import networkx as nx

from ._elimination import build_decomposition, eliminate_min_degree, eliminate_min_fill, gc_paused, index_graph
from .bounds import min_width_of_adjacency
from .decomposition import TreeDecomposition
from .heuristics import elimination_engine

__all__ = ["improve", "ImproveResult"]


class ImproveResult:
    """Outcome of :func:`improve_with_stats`: the decomposition and how it was found."""

    __slots__ = ("decomposition", "runs", "lower_bound", "first_width")

    def __init__(self, decomposition, runs, lower_bound, first_width):
        self.decomposition: TreeDecomposition = decomposition
        self.runs: int = runs  # heuristic runs made, the first included
        self.lower_bound: int = lower_bound  # minor-min-width
        self.first_width: int = first_width  # width of the deterministic first run

    @property
    def proven_optimal(self) -> bool:
        """True when the width equals the lower bound."""
        return self.decomposition.width <= self.lower_bound


def improve_with_stats(
    G: nx.Graph,
    *,
    timeout: float = 1.0,
    heuristic: str = "min-fill",
    seed: int | None = None,
    max_runs: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> ImproveResult:
    """Like :func:`improve`, but also report run count and bounds."""
    with gc_paused():
        return _improve(G, timeout, heuristic, seed, max_runs, should_stop)


def _improve(G, timeout, heuristic, seed, max_runs, should_stop) -> ImproveResult:
    deadline = time.perf_counter() + timeout
    rng = random.Random(seed)
    nodes, adj = index_graph(G)
    n = len(nodes)
    first = elimination_engine(heuristic)
    other = eliminate_min_degree if first is eliminate_min_fill else eliminate_min_fill
    best = first(adj)
    runs = 1
    first_width = best[3]
    lb = min_width_of_adjacency(adj)

    def done() -> bool:
        return (
            best[3] <= lb
            or time.perf_counter() >= deadline
            or (max_runs is not None and runs >= max_runs)
            or (should_stop is not None and should_stop())
        )

    k = 0
    while not done():
        # Run 2 is the other heuristic as is; afterwards three randomised
        # runs of the chosen heuristic for each randomised run of the other.
        engine = other if k % 4 == 0 else first
        randomised = k > 0
        k += 1
        rank = None
        if randomised:
            rank = list(range(n))
            rng.shuffle(rank)
        result = engine(adj, rank, abort_at=best[3])
        runs += 1
        if result is not None and result[3] < best[3]:
            best = result
    order, higher, tail, _ = best
    td = build_decomposition(nodes, order, higher, tail)
    return ImproveResult(td, runs, lb, first_width)


def improve(
    G: nx.Graph,
    *,
    timeout: float = 1.0,
    heuristic: str = "min-fill",
    seed: int | None = None,
    max_runs: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TreeDecomposition:
    """Best decomposition found by repeated randomised heuristic runs.

    The first run is the deterministic ``heuristic`` (so the result is never
    wider than :func:`min_fill` / :func:`min_degree` give), the second the
    other heuristic; later runs are mostly ``heuristic`` with ties broken
    in a random order drawn from ``seed``.

    Stops at the first of: ``timeout`` seconds have passed (checked between
    runs, so the first run always completes), ``max_runs`` runs made,
    ``should_stop()`` returns true, or the width equals the minor-min-width
    lower bound (then the result is optimal).
    """
    return improve_with_stats(
        G, timeout=timeout, heuristic=heuristic, seed=seed, max_runs=max_runs, should_stop=should_stop
    ).decomposition
