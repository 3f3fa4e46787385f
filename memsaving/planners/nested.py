"""Multi-level (recursive) checkpointing under a memory budget (no TensorFlow).

Single-level plans keep checkpoints from the forward pass and recompute each
segment once; their peak cannot fall below about two segments' worth of
activations plus the checkpoints.  Recursive plans go lower for more compute:
when the backward pass reaches a segment, it first recomputes a few *inner*
checkpoints inside it, holds them, and backpropagates the pieces between them
one after the other, each possibly split again (Griewank's Revolve; for
chains whose stages differ in size and cost, the dynamic program of Beaumont
et al., "Optimal checkpointing for heterogeneous chains", the Rotor paper).

The dynamic program here works on the chain of candidate cuts with the same
surrogate costs as the single-level DP (:class:`memsaving.planners.chain.Chain`),
but for kernels' work buffers (see :func:`memsaving.planners.chain.chain`):

* ``solve(a, b, M)``: the least recomputation that backpropagates the stretch
  from cut ``a`` (held) to cut ``b`` (its gradient known) within ``M`` bytes,
  either by recomputing it whole (surrogate memory ``chain.memory(a, b)``),
  or by recomputing up to an inner cut ``c``, holding it, solving
  ``(c, b)`` with ``M - kept[c]`` and then ``(a, c)`` with ``M``;
* ``top(a, M)``: the plan after the forward pass, where cut ``a`` is the last
  one kept so far: either differentiate the rest in place (the output unit),
  or keep cut ``b`` from the forward pass for free, solve the rest with
  ``M - kept[b]`` and then ``solve(a, b, M)``.

Memory is counted in ``buckets`` units, so the DP is O(m^3 * buckets) for m
cuts: chains longer than ``max_cuts`` are thinned first.  The result is only
a proposal: :mod:`memsaving.planners.budget` simulates it like every other plan and
searches over the surrogate budget until the simulated peak fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from memsaving.planners.chain import Chain, as_cuts, chain
from memsaving.model.graph import GraphModel
from memsaving.model.schedule import Inner, closure, kept_set

LEAF = -1


@dataclass
class NestedPlan:
    """Level-1 checkpoints (kept from the forward pass) and inner ones."""

    checkpoint_ops: List[int]
    inner: Inner
    surrogate_cost: float


def nested_dp(chain_: Chain, budget: float, buckets: int = 128) -> Optional[Tuple[List[int], Dict[int, List[int]], float]]:
    """Cheapest recursive plan on the surrogate chain within ``budget`` bytes.

    Returns ``(level_one_cuts, inner_cuts, recompute_cost)`` with cut indices
    (0-based into the candidate list; ``inner_cuts[b]`` the inner cuts of the
    stretch ending at cut ``b``, or at ``-1`` never), or None when nothing fits.
    """
    m = chain_.size
    if budget <= 0:
        return None
    scale = budget / buckets
    size = buckets + 1
    # stage indices: 0 = inputs, 1..m = cuts, m + 1 = end
    kept = np.concatenate([[0], np.ceil(chain_.kept / scale).astype(int), [0]])
    end = m + 1
    grid = np.arange(size)
    cost, stretch_memory = chain_.stretch_tables()
    need = np.ceil(stretch_memory / scale)  # buckets each stretch needs when recomputed whole
    if not leaves_cover(need, kept, buckets):
        return None  # no plan fits: skip the cubic tables
    # shifted[c, M] = M - kept[c]: where solve(c, b) is read after holding cut c
    shifted = grid[None, :] - kept[:, None]
    valid = shifted >= 0
    shifted = np.clip(shifted, 0, None)
    solve = np.full((end + 1, end + 1, size), np.inf)
    choice = np.full((end + 1, end + 1, size), LEAF, dtype=int)
    for length in range(1, m + 1):
        # every stretch (a, a + length] at once; inner cuts c = a + 1 .. b - 1 in order
        starts = np.arange(0, m + 1 - length)
        ends = starts + length
        best: np.ndarray = np.where(grid[None, :] >= need[starts, ends][:, None], cost[starts, ends][:, None], np.inf)
        pick: np.ndarray = np.full((len(starts), size), LEAF)
        if length > 1:
            inner_cut = starts[:, None] + np.arange(1, length)[None, :]  # (stretches, inner cuts)
            rows = shifted[inner_cut]  # (stretches, inner cuts, size)
            later = np.where(valid[inner_cut], solve[inner_cut[:, :, None], ends[:, None, None], rows], np.inf)
            options = cost[starts[:, None], inner_cut][:, :, None] + later + solve[starts[:, None], inner_cut]
            at = np.argmin(options, axis=1)  # (stretches, size): the first inner cut on ties
            lowest = np.take_along_axis(options, at[:, None, :], axis=1)[:, 0, :]
            better = lowest < best
            best = np.where(better, lowest, best)
            pick = np.where(better, np.take_along_axis(inner_cut, at, axis=1), pick)
        solve[starts, ends] = best
        choice[starts, ends] = pick
    top = np.full((end + 1, size), np.inf)
    top_choice = np.full((end + 1, size), LEAF, dtype=int)
    for a in range(m, -1, -1):
        best = np.where(grid >= need[a, end], 0.0, np.inf)
        pick = np.full(size, LEAF)
        if a < m:
            later = np.arange(a + 1, m + 1)
            rest = np.where(valid[later], top[later[:, None], shifted[later]], np.inf)
            options = rest + solve[a, later]
            at = np.argmin(options, axis=0)
            lowest = options[at, grid]
            better = lowest < best
            best = np.where(better, lowest, best)
            pick = np.where(better, later[at], pick)
        top[a] = best
        top_choice[a] = pick
    if not np.isfinite(top[0][buckets]):
        return None

    level_one: List[Tuple[int, int, int]] = []  # (a, b, memory) of each level-one stretch
    inner: Dict[int, List[int]] = {}

    def unfold(a: int, b: int, memory: int):
        """Record the inner cuts of stretch (a, b]: its spine, then each piece."""
        spine = []
        start = a
        while True:
            c = int(choice[start, b][memory])
            if c == LEAF:
                break
            spine.append(c)
            memory -= kept[c]
            start = c
        if spine:
            inner[b - 1] = [c - 1 for c in spine]
        starts = [a] + spine
        memory_left = memory
        for k in range(len(spine) - 1, -1, -1):
            memory_left += kept[spine[k]]
            unfold(starts[k], spine[k], memory_left)

    a, memory = 0, buckets
    while True:
        b = int(top_choice[a][memory])
        if b == LEAF:
            break
        level_one.append((a, b, memory))
        memory -= kept[b]
        a = b
    for a, b, memory in level_one:
        unfold(a, b, memory)
    return [b - 1 for _, b, _ in level_one], inner, float(top[0][buckets])


def leaves_cover(need: np.ndarray, kept: np.ndarray, budget: float) -> bool:
    """Whether every stretch between adjacent stages lies inside some
    stretch ``(a, b]`` that fits ``budget`` when recomputed whole with stage
    ``a`` held (``need[a, b] + kept[a]``).

    Any plan of :func:`nested_dp` ends in leaves, stretches recomputed whole,
    that together cover the chain, and each leaf runs while its first cut is
    held; so when this is False the DP finds nothing.  It is much cheaper
    than the DP's tables, and the budget searches try many budgets too small
    for any plan.

    Examples
    --------
    >>> need = np.array([[0, 3, 9], [0, 0, 4], [0, 0, 0]])  # three stages: 0, one cut, the end
    >>> kept = np.array([0, 2, 0])
    >>> leaves_cover(need, kept, 6)  # (0, 1] needs 3; (1, 2] needs 4 with cut 1 (2) held
    True
    >>> leaves_cover(need, kept, 5)  # (1, 2] fits in no leaf: 6 with the cut held, 9 as part of (0, 2]
    False
    """
    stages = np.arange(len(kept))
    fits = need + kept[:, None] <= budget  # fits[a, b]
    x, a, b = stages[:, None, None], stages[None, :, None], stages[None, None, :]
    covered = ((a <= x) & (b > x) & fits[None]).any(axis=(1, 2))
    return bool(covered[:-1].all())  # every (x, x + 1]; the last stage starts no stretch


def thinned_chain(model: GraphModel, candidates: Sequence, max_cuts: int = 40) -> Tuple[List[List[int]], Chain]:
    """The candidate cuts (at most ``max_cuts``, evenly spread, so the cubic
    DP stays fast) and their surrogate chain."""
    cuts = as_cuts(candidates)
    if len(cuts) > max_cuts:
        keep = sorted({int(round(k * (len(cuts) - 1) / (max_cuts - 1))) for k in range(max_cuts)})
        cuts = [cuts[k] for k in keep]
    return cuts, chain(model, cuts, work_buffers=False)


def nested_plan(model: GraphModel, cuts: List[List[int]], summary: Chain, target: float) -> Optional[NestedPlan]:
    """The DP's recursive plan for a surrogate budget of ``target`` activation
    bytes, as op indices; None when the surrogate finds nothing or the best
    plan is single-level (the single-level search covers those)."""
    if not cuts:
        return None
    found = nested_dp(summary, target)
    if found is None:
        return None
    level_one, inner_cuts, cost = found
    return _to_ops(model, cuts, level_one, inner_cuts, cost)


def _to_ops(model: GraphModel, cuts, level_one, inner_cuts, cost) -> Optional[NestedPlan]:
    """Map cut indices to ops: each inner cut's op goes to one anchor (an op
    of the enclosing cut) whose segment contains it, the first the backward
    pass reaches.  Given to several, it would be differentiated once per
    anchor, each time with the gradient summed so far (wrong gradients);
    the other anchors recompute it inside their own segments instead."""
    checkpoint_ops = sorted({i for k in level_one for i in cuts[k]})
    kept = kept_set(model, checkpoint_ops)
    inner: Dict[int, Tuple[int, ...]] = {}
    taken: set = set()

    def assign(anchor_cut: int, context: set):
        inside_cuts = inner_cuts.get(anchor_cut, [])
        if not inside_cuts:
            return
        deeper = context | {i for k in inside_cuts for i in cuts[k]}
        for anchor in sorted(cuts[anchor_cut], reverse=True):  # the backward pass's order
            segment = set(closure(model, [anchor], context))
            mine = tuple(sorted(i for k in inside_cuts for i in cuts[k]
                                if i in segment and i != anchor and i not in taken))
            if mine:
                taken.update(mine)
                inner[anchor] = tuple(sorted(set(inner.get(anchor, ())) | set(mine)))
        for k in inside_cuts:
            assign(k, deeper)

    for k in level_one:
        assign(k, kept)
    if not inner:
        return None  # a single-level plan: the single-level search covers it
    return NestedPlan(checkpoint_ops, inner, cost)
