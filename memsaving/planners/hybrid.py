"""Planning recomputation and host swapping together (no TensorFlow).

Three plans are scored by the simulator under one cost model (compute rate,
transfer bandwidth, transfers overlapping compute on their own streams):

* **recompute-only**: the budget DP's single-level plan;
* **swap-only**: nothing recomputed, every tensor the backward pass reads
  from the forward pass swapped to the host (TFLMS);
* **hybrid**: starting from the recompute-only plan (or, when none fits,
  the single-level plan of lowest peak), one change at a time: turn a
  recomputed segment into kept and swapped tensors, swap one more kept
  tensor, or bring one back.  While the plan does not fit, the change that
  lowers the peak most is taken; once it fits, the one that saves the most
  predicted step time and still fits (the greedy of TSPLIT and PooCH).

The hybrid result is the fastest plan that fits among all plans the greedy
visited and the two pure plans, so it is never slower than the better of
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from memsaving.planners.budget import lowest_peak_plan, no_plan_fits, plan_for_budget
from memsaving.errors import BudgetError, feasible_budget
from memsaving.model.graph import GraphModel
from memsaving.model.proposal import Proposal
from memsaving.model.schedule import UnitKind, backward_units, kept_set
from memsaving.sim.allowance import used_up
from memsaving.sim.simulate import simulate
from memsaving.sim.swap import CostModel, swap_candidates


@dataclass
class HybridResult:
    """The chosen plan and the pure plans it was compared with (None when a
    pure plan does not fit)."""

    best: Proposal
    recompute_only: Optional[Proposal]
    swap_only: Optional[Proposal]
    visited: int


def _score(model: GraphModel, name: str, ops: Sequence[int], swapped: Sequence[int], cost: CostModel,
           keep_x_gradients: bool) -> Proposal:
    # every plan is scored (and emitted) with kept ops whose inputs are kept
    # differentiated in place, so plans compare on the same terms
    sim = simulate(model, ops, keep_x_gradients=keep_x_gradients, swapped=swapped, cost=cost, inplace=True)
    return Proposal(sorted(set(ops)), sim.peak_bytes, sim.recompute_cost, swapped=sorted(set(swapped)),
                    seconds=sim.step_seconds, name=name)


def _move_score(plan: Proposal, budget: int) -> tuple:
    """Plans that fit compare by time, others by peak (any fitting plan first)."""
    return (0, plan.seconds, plan.peak) if plan.fits(budget) else (1, plan.peak, plan.seconds)


def plan_hybrid(
    model: GraphModel,
    candidates: Sequence,
    budget: int,
    *,
    cost: Optional[CostModel] = None,
    keep_x_gradients: bool = False,
    cut_bytes: Optional[Sequence[float]] = None,
    max_rounds: int = 40,
    max_evaluations: int = 800,
    or_lowest: bool = False,
) -> HybridResult:
    """Keep / swap / recompute under ``budget`` (bytes), fastest predicted step.

    The greedy stops after ``max_rounds`` changes or ``max_evaluations``
    simulated plans, whichever comes first (each round simulates every
    possible change once).  ``or_lowest``: when nothing fits, return the
    lowest-peak plan reached instead of raising (as
    :func:`memsaving.planners.budget.plan_for_budget` does).

    Raises
    ------
    BudgetError
        neither pure plan nor any hybrid the greedy reached fits
        (and not ``or_lowest``).
    """
    cost = cost or CostModel()
    recompute_only = None
    try:
        chosen = plan_for_budget(model, candidates, budget, keep_x_gradients=keep_x_gradients, cut_bytes=cut_bytes,
                                 multilevel=False)
        start_ops = chosen.checkpoint_ops
        recompute_only = _score(model, "recompute-only", start_ops, [], cost, keep_x_gradients)
    except BudgetError:
        start_ops = lowest_peak_plan(model, candidates, keep_x_gradients=keep_x_gradients,
                                     cut_bytes=cut_bytes).checkpoint_ops
    swap_only = _score(model, "swap-only", [], swap_candidates(model, kept_set(model, [])), cost,
                       keep_x_gradients)
    current = _score(model, "hybrid", start_ops, [], cost, keep_x_gradients)
    visited = [current]
    for _ in range(max_rounds):
        if used_up():
            break
        kept = kept_set(model, current.checkpoint_ops)
        swapped = set(current.swapped)
        options = set(swap_candidates(model, kept))
        moves = []
        # turn a recomputed segment into kept (and swapped) tensors
        for unit in backward_units(model, kept):
            if unit.kind == UnitKind.SEGMENT and len(unit.ops) >= 2:
                ops = sorted(set(current.checkpoint_ops) | set(unit.ops))
                new = set(swap_candidates(model, kept_set(model, ops))) - options
                moves.append((ops, sorted((swapped & set(swap_candidates(model, kept_set(model, ops)))) | new)))
        # swap one more kept tensor, or bring one back
        for t in sorted(options - swapped):
            moves.append((current.checkpoint_ops, sorted(swapped | {t})))
        for t in sorted(swapped):
            moves.append((current.checkpoint_ops, sorted(swapped - {t})))
        if len(visited) + len(moves) > max_evaluations:
            moves = moves[: max(0, max_evaluations - len(visited))]
        scored: List[Proposal] = []
        for ops, sw in moves:
            if scored and used_up():
                break  # the planning time is spent: choose among the moves scored so far
            scored.append(_score(model, "hybrid", ops, sw, cost, keep_x_gradients))
        visited.extend(scored)
        if not scored:
            break
        candidate = min(scored, key=lambda m: _move_score(m, budget))
        if _move_score(candidate, budget) >= _move_score(current, budget):
            break
        current = candidate
    reached = [p for p in visited + [recompute_only, swap_only] if p is not None]
    pool = [p for p in reached if p.fits(budget)]
    if not pool:
        lowest = min(reached, key=lambda p: p.peak)
        if not or_lowest:
            raise no_plan_fits("recompute / swap plan", budget, feasible_budget(lowest.peak),
                               ". Raise the budget, or reduce the batch size.")
        pool = [lowest]
    best = min(pool, key=lambda p: (p.seconds, p.peak))
    if best.name != "hybrid":
        best = best.renamed("hybrid")
    fitting = [p for p in (recompute_only, swap_only) if p is not None and p.fits(budget)]
    return HybridResult(best, recompute_only if recompute_only in fitting else None,
                        swap_only if swap_only in fitting else None, len(visited))
