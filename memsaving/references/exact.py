"""Exact reference for small graphs: the best single-level plan by enumeration.

Every subset of the candidate checkpoints is simulated; the cheapest (least
recomputed compute) whose simulated peak fits the budget is returned.  This
is exponential and only meant for tests and benchmarks that check how far
the budget DP is from the optimum of the same plan space.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

from memsaving.model.graph import GraphModel
from memsaving.sim.simulate import simulate

MAX_CANDIDATES = 16


def optimal_plan(
    model: GraphModel,
    candidates: Sequence[int],
    budget: int,
    keep_x_gradients: bool = False,
) -> Optional[Tuple[List[int], float, int]]:
    """``(checkpoint_ops, recompute_cost, peak)`` of the best feasible subset.

    Returns None when no subset fits.

    Raises
    ------
    ValueError
        more than ``MAX_CANDIDATES`` candidates (2^n simulations).
    """
    if len(candidates) > MAX_CANDIDATES:
        raise ValueError(
            f"optimal_plan enumerates 2^n subsets; got {len(candidates)} candidates, "
            f"at most {MAX_CANDIDATES} are allowed"
        )
    best = None
    for k in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, k):
            sim = simulate(model, list(subset), keep_x_gradients=keep_x_gradients)
            if sim.peak_bytes <= budget and (best is None or sim.recompute_cost < best[1]):
                best = (list(subset), sim.recompute_cost, sim.peak_bytes)
    return best
