"""Per-op keep/recompute decisions on top of single-level plans (no TensorFlow).

Plans built from candidate cuts recompute every op between two cuts.  The
optimum of the rematerialization problem (Checkmate's MILP, see
:mod:`memsaving.references.milp`) usually does something finer: it keeps almost every
tensor and recomputes only a few ops that are cheap for the bytes they hold.
A checkpoint set need not be a chain of cuts (any set of kept ops is a valid
plan: each kept op's segment recomputes the non-kept ops it needs), so two
greedy passes, each judged by the simulator, move plans towards that:

* :func:`keep_more`: starting from a plan that fits, keep the recomputed ops
  that save the most recomputation per byte, in runs of consecutive ones,
  while the simulated peak still fits the budget;
* :func:`drop_from_keep_all`: starting from keeping every op (plain
  backprop), stop keeping ops one at a time, each lowering the simulated
  peak, until the plan fits: on graphs of up to 120 candidate ops the drop
  that lowers the peak most per unit of added recomputation (steepest
  descent), on larger ones the next op cheapest to recompute per byte.

Both are bounded by a number of simulations, so large graphs stay fast.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Set, Tuple

import numpy as np

from memsaving.model.graph import GraphModel
from memsaving.model.proposal import Proposal
from memsaving.model.schedule import RECOMPUTING, backward_units, kept_set
from memsaving.sim.allowance import used_up
from memsaving.sim.simulate import Simulation, simulate


def default_evaluations(model: GraphModel) -> int:
    """Simulations each pass may run: all ops on small graphs, fewer on big
    ones (a simulation costs time linear in the graph)."""
    return max(60, 60_000 // max(len(model.ops), 1))


def _output_bytes(model: GraphModel, i: int) -> int:
    return sum(model.tensors[t].nbytes for t in model.ops[i].outputs)


def recomputed_ops(model: GraphModel, checkpoint_ops: Sequence[int]) -> Set[int]:
    """Ops the plan keeping ``checkpoint_ops`` recomputes in some segment."""
    kept = kept_set(model, checkpoint_ops)
    found: Set[int] = set()
    for unit in backward_units(model, kept):
        if unit.kind in RECOMPUTING:
            found.update(i for i in unit.ops if i != unit.anchor)
    return found


def keep_more(
    model: GraphModel,
    checkpoint_ops: Sequence[int],
    budget: int,
    *,
    keep_x_gradients: bool = False,
    max_evaluations: Optional[int] = None,
) -> Tuple[List[int], Simulation]:
    """Add recomputed ops to the kept set while the simulated peak fits.

    Ops are tried in order of forward cost per output byte, highest first
    (the most recomputation saved for the memory it holds).  Views are left
    out: they hold no bytes of their own and cost nothing to recompute, so
    keeping one saves nothing, and with a cost per byte computed on zero
    bytes they would come first and use up the simulations.  Ops are tried
    in runs that double while they are kept and halve when a run is not
    (galloping): consecutive ops of the order are often all kept, and one
    simulation then takes many.  A run is kept when the plan with it still
    fits ``budget`` and recomputes less.  Returns the checkpoint ops and
    their simulation (the input plan's when nothing improves it).
    """
    current = sorted(set(checkpoint_ops))
    best = simulate(model, current, keep_x_gradients=keep_x_gradients)
    limit = default_evaluations(model) if max_evaluations is None else max_evaluations
    order = sorted((i for i in recomputed_ops(model, current) if _output_bytes(model, i) > 0),
                   key=lambda i: -model.ops[i].cost / _output_bytes(model, i))
    position, run, evaluations = 0, 1, 0
    while position < len(order) and evaluations < limit and not used_up():
        tried = order[position:position + run]
        trial = sorted(set(current).union(tried))
        sim = simulate(model, trial, keep_x_gradients=keep_x_gradients)
        evaluations += 1
        if sim.peak_bytes <= budget and sim.recompute_cost < best.recompute_cost:
            current, best = trial, sim
            position += len(tried)
            run *= 2
        elif run > 1:
            run //= 2
        else:
            position += 1
    return current, best


def _drop_candidates(model: GraphModel) -> List[int]:
    """The ops :func:`drop_from_keep_all` may stop keeping: forward ops that
    can be recomputed and hold bytes of their own."""
    return [i for i, op in enumerate(model.ops) if op.forward and op.copyable and _output_bytes(model, i) > 0]


def _held_bytes(model: GraphModel, i: int) -> int:
    """What keeping op ``i`` holds for the backward pass: its outputs, and
    the memory it saves for its gradient (a loop's intermediates)."""
    return _output_bytes(model, i) + model.ops[i].saved_bytes


def _excess(sim: Simulation, model: GraphModel, budget: int) -> int:
    """Bytes above the budget summed over the timeline (a tie-breaker that
    rewards lowering secondary peaks too)."""
    above = np.asarray(sim.timeline, dtype=np.int64) - (budget - model.resident_bytes)
    return int(above[above > 0].sum())


def drop_from_keep_all(
    model: GraphModel,
    budget: int,
    *,
    keep_x_gradients: bool = False,
    max_evaluations: Optional[int] = None,
) -> Optional[Tuple[List[int], Simulation]]:
    """Start from keeping every op and stop keeping ops until the plan fits.

    Small graphs: steepest descent (:data:`STEEPEST_MAX_CANDIDATES`).  Larger
    ones: ops are tried in order of forward cost per output byte, lowest
    first; a drop is accepted when it lowers the simulated peak (or, at an
    equal peak, the bytes above the budget over the whole step).  Returns the
    checkpoint ops and simulation of the first plan that fits, or None, at
    once when the ops it would try hold fewer bytes than the peak is over
    the budget: a plan that stops keeping some ops has a peak lower by what
    they hold (outputs, memory saved for their gradients) at most;
    recomputing them only adds memory.
    """
    candidates = _drop_candidates(model)
    current = set(candidates)
    sim = simulate(model, sorted(current), keep_x_gradients=keep_x_gradients)
    if sim.peak_bytes <= budget:
        return sorted(current), sim
    limit = default_evaluations(model) if max_evaluations is None else max_evaluations
    steepest = len(candidates) <= STEEPEST_MAX_CANDIDATES
    order = sorted(candidates, key=lambda i: model.ops[i].cost / _output_bytes(model, i))
    tried = candidates if steepest else order[:limit]
    if sim.peak_bytes - sum(_held_bytes(model, i) for i in tried) > budget:
        return None  # out of reach: stopping keeping an op lowers the peak by what it holds at most
    if steepest:
        return _steepest_drops(model, current, sim, budget, keep_x_gradients)
    excess = None  # of ``sim``, computed when a trial ties its peak
    for i in tried:
        if used_up():
            break
        trial = sorted(current - {i})
        trial_sim = simulate(model, trial, keep_x_gradients=keep_x_gradients)
        if trial_sim.peak_bytes == sim.peak_bytes:
            excess = _excess(sim, model, budget) if excess is None else excess
            trial_excess = _excess(trial_sim, model, budget)
            if trial_excess < excess:
                current, sim, excess = set(trial), trial_sim, trial_excess
        elif trial_sim.peak_bytes < sim.peak_bytes:
            current, sim, excess = set(trial), trial_sim, None
            if sim.peak_bytes <= budget:
                return sorted(current), sim
    return None


STEEPEST_MAX_CANDIDATES = 120
"""Up to this many candidate ops, each drop is chosen among all of them by
simulation (quadratic in the ops); above it, one pass in a fixed order."""


def _steepest_drops(model: GraphModel, current: Set[int], sim: Simulation, budget: int,
                    keep_x_gradients: bool) -> Optional[Tuple[List[int], Simulation]]:
    """Drop, one at a time, the op that lowers the simulated peak most per
    unit of recomputation added, until the plan fits (None if it stalls)."""
    while sim.peak_bytes > budget:
        best = None
        for i in sorted(current):
            if used_up():
                return None
            trial = simulate(model, sorted(current - {i}), keep_x_gradients=keep_x_gradients)
            gain = sim.peak_bytes - trial.peak_bytes
            if gain <= 0:
                continue
            value = gain / max(trial.recompute_cost - sim.recompute_cost, 1e-9)
            if best is None or value > best[0]:
                best = (value, i, trial)
        if best is None:
            return None
        current = current - {best[1]}
        sim = best[2]
    return sorted(current), sim


def refined_plans(
    model: GraphModel,
    start_plans: Sequence[Sequence[int]],
    budget: int,
    *,
    keep_x_gradients: bool = False,
    max_evaluations: Optional[int] = None,
    descend: bool = True,
) -> List[Proposal]:
    """Per-op refinements that fit ``budget``: each start plan that fits with
    more ops kept, and the plan grown down from keeping everything (also
    with more ops kept again where the drops overshot), named ``"per-op"``.

    ``descend=False`` leaves out the descent from keeping everything on
    graphs where it is one pass in a fixed order (over
    :data:`STEEPEST_MAX_CANDIDATES` candidate ops).  The budget planner
    does so when no plan of cuts fits: such a pass recomputes a few cheap
    ops, which reaches budgets near the plain peak, not below every plan of
    cuts.  The steepest descent of smaller graphs chooses each drop by
    simulation and can reach such budgets (a U-Net, whose skip connections
    stay alive across every cut), so it always runs."""
    found = []
    for start in start_plans:
        ops, sim = keep_more(model, start, budget, keep_x_gradients=keep_x_gradients, max_evaluations=max_evaluations)
        if sim.peak_bytes <= budget:
            found.append((ops, sim))
    steepest = len(_drop_candidates(model)) <= STEEPEST_MAX_CANDIDATES
    dropped = None
    if descend or steepest:
        dropped = drop_from_keep_all(model, budget, keep_x_gradients=keep_x_gradients,
                                     max_evaluations=max_evaluations)
    if dropped is not None:
        found.append(keep_more(model, dropped[0], budget, keep_x_gradients=keep_x_gradients,
                               max_evaluations=max_evaluations))
    return [Proposal(ops, sim.peak_bytes, sim.recompute_cost, name="per-op") for ops, sim in found]
