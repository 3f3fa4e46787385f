"""Which planner makes a step's plan: one small registry, one rule.

A call of ``memsaving.gradients`` or ``memsaving.plan`` asks for one of four
kinds of plan, and each has its own planner:

=============  =====================================================  ==========================================
name           asked for by                                           planner
=============  =====================================================  ==========================================
checkpoints    no ``budget``: a mode's checkpoints or the user's      :func:`memsaving.planners.modes`, the list
budget         ``budget=`` (checkpoints are the candidates)           :func:`memsaving.planners.budget.plan_for_budget`
hybrid         ``swap="auto"`` with a budget                          :func:`memsaving.planners.hybrid.plan_hybrid`
split          ``split=`` (regions computed in pieces of rows)         :mod:`memsaving.planners.splits`, then one
                                                                      of the three above on the folded model
=============  =====================================================  ==========================================

The TensorFlow side resolves the user's arguments against the graph first
(tensors and names become op and tensor indices of the graph model) and
hands a :class:`PlanRequest`; :func:`planner_name` is the rule that picks
the planner, and :func:`make_plan_for` runs it.  Keeping the choice here,
next to the planners, is what lets the TensorFlow side stay a caller: a new
kind of plan is one function added to :data:`PLANNERS` and one line of the
rule.

Examples
--------
>>> from memsaving.model.graph import chain_model
>>> request = PlanRequest(chain_model([4096] * 8), checkpoints="memory")
>>> planner_name(request)
'checkpoints'
>>> plan = make_plan_for(request)
>>> plan.mode, plan.predicted_peak < plan.plain_peak
('memory', True)
>>> budget_request = replace(request, budget=plan.predicted_peak)
>>> planner_name(budget_request), make_plan_for(budget_request).device_peak <= plan.predicted_peak
('budget', True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple, Union

from memsaving.candidates import cuts as candidates
from memsaving.errors import BudgetError, CheckpointError, feasible_budget
from memsaving.model.graph import GraphModel
from memsaving.model.schedule import kept_set
from memsaving.planners.budget import no_plan_fits, plan_for_budget
from memsaving.planners.chunk_fit import fit_in_chunks
from memsaving.planners.hybrid import plan_hybrid
from memsaving.model.loops import checkpointable_loops, with_loops_checkpointed
from memsaving.planners.modes import checkpoints_loops, memory_proposal, speed_proposal
from memsaving.planners.planning import Plan, make_plan
from memsaving.planners.splits import auto_split, explicit_split
from memsaving.sim.swap import CostModel, swap_candidates

NAMED_MODES = ("speed", "memory")
"""The modes whose checkpoints the planners choose; every other
``checkpoints`` value names tensors the caller resolved to ops."""


@dataclass(frozen=True)
class PlanRequest:
    """One call's arguments, resolved against its graph model.

    Attributes
    ----------
    model
        the sized graph model of the step.
    checkpoints
        ``"speed"`` or ``"memory"`` (chosen by the planners), or the label of
        the checkpoints the caller resolved into :attr:`named_ops`
        (``"collection"``, ``"list"``).
    named_ops
        for a label other than a named mode: the names of the ops whose
        outputs the user's checkpoints keep (names, not indices: the split
        planner plans again on a model with regions folded, whose indices
        differ; a name folded into a region is left out there).
    budget
        bytes to plan for (None: no budget).
    swap
        None (off), True (every tensor that can be), ``"auto"`` (the hybrid
        planner chooses, with a budget), or the names of the tensors to swap.
    split
        None, ``"auto"``, or ``((op index, pieces), ...)`` to split.
    keep_x_gradients, multilevel
        as the options of the same names.
    cost
        the speeds and swap timing the simulator uses.
    or_lowest
        with a budget nothing fits: the lowest plan found instead of a
        ``BudgetError`` (a calibration decides whether it may run).
    """

    model: GraphModel
    checkpoints: str = "memory"
    named_ops: Tuple[str, ...] = ()
    budget: Optional[int] = None
    swap: Union[None, bool, str, Tuple[str, ...]] = None
    split: Union[None, str, Tuple[Tuple[int, int], ...]] = None
    keep_x_gradients: bool = False
    multilevel: bool = False
    cost: CostModel = field(default_factory=CostModel)
    or_lowest: bool = False


# ----------------------------------------------------------------------------- pieces every planner shares


def checkpoint_ops(request: PlanRequest) -> List[int]:
    """The ops whose outputs the request's checkpoints keep: the named modes
    are planned on the model, the other forms were resolved by the caller."""
    if request.checkpoints == "speed":
        return speed_proposal(request.model).checkpoint_ops
    if request.checkpoints == "memory":
        return memory_proposal(request.model).checkpoint_ops
    return named_op_indices(request)


def named_op_indices(request: PlanRequest) -> List[int]:
    """The indices in the request's model of :attr:`PlanRequest.named_ops`
    (those the model has), in order."""
    index = request.model.op_index()
    return sorted({index[name] for name in request.named_ops if name in index})


def candidate_pool(request: PlanRequest) -> tuple:
    """Candidate cuts for budget planning (and their bytes for Chen's greedy):
    the speed mode's, the memory candidates for any other mode, or the
    user's list."""
    if request.checkpoints == "speed":
        return candidates.speed(request.model), None
    if request.checkpoints != "list":
        ranked = candidates.memory_candidates(request.model)
        return [cut for cut, _ in ranked], [b for _, b in ranked]
    return named_op_indices(request), None


def swapped_tensors(request: PlanRequest, chosen, inner=None) -> List[int]:
    """Tensor ids of the model to swap for the request's ``swap`` (off, True,
    or names), once ``chosen`` (and the multi-level ``inner``) are kept."""
    swap = request.swap
    if swap is None or swap is False:
        return []
    model = request.model
    possible = swap_candidates(model, kept_set(model, chosen), inner)
    if swap is True:
        return possible
    ids = {info.name: t for t, info in model.tensors.items()}
    wanted = []
    for name in swap:
        if name not in ids or ids[name] not in possible:
            raise CheckpointError(
                f"cannot swap {name!r}: only tensors of numbers the backward pass reads from the forward "
                "pass can be swapped (checkpoints, and inputs of ops differentiated in place; not a loop's "
                "TensorLists); recomputed tensors never stay on the device between the two passes"
            )
        wanted.append(ids[name])
    return wanted


def _mode_plan(request: PlanRequest, budget_bytes: int) -> Optional[Plan]:
    """The plan ``checkpoints="memory"`` makes without a budget (its own
    lowest-peak search, which the budget searches need not reach), made for
    ``budget_bytes``, where the budget's candidates are the memory mode's
    (a mode other than ``"speed"``); None for the speed mode's candidates
    and a user's list."""
    if request.checkpoints in ("speed", "list"):
        return None
    return make_plan(request.model, memory_proposal(request.model).checkpoint_ops, "budget", budget=budget_bytes,
                     keep_x_gradients=request.keep_x_gradients)


# ----------------------------------------------------------------------------- the planners


def loops_checkpointed(planner: Callable[[PlanRequest], Plan], mode: Callable[[PlanRequest], str]):
    """``planner``, made to plan on the model whose loops are checkpointed
    inside (:func:`memsaving.model.loops.with_loops_checkpointed`) when the
    plan's ``mode(request)`` checkpoints loops and the model has loops worth
    it; the plan then names them (``Plan.checkpointed_loops``), for the
    rewrite to follow.

    With a budget, loops are checkpointed only when the budget needs it: a
    checkpointed loop runs its forward twice more, so a plan that fits with
    the loops whole is the faster one.  (The chunk length does not trade
    memory for time: every chunk length runs the forward loop twice more,
    and sqrt(T) holds the least.)"""
    @functools.wraps(planner)
    def planned(request: PlanRequest) -> Plan:
        loops = checkpointable_loops(request.model) if checkpoints_loops(mode(request)) else []
        if not loops:
            return planner(request)
        if request.budget is not None:
            try:
                whole = planner(replace(request, or_lowest=False))
                if whole.device_peak <= request.budget:
                    return whole
            except BudgetError:
                pass
        made = planner(replace(request, model=with_loops_checkpointed(request.model)))
        return replace(made, checkpointed_loops=[request.model.ops[i].name for i in loops])

    return planned


def _plan_checkpoints(request: PlanRequest) -> Plan:
    """No budget: the mode's checkpoints, or the user's, with any swaps asked for."""
    chosen = checkpoint_ops(request)
    swapped = swapped_tensors(request, chosen)
    return make_plan(request.model, chosen, request.checkpoints, keep_x_gradients=request.keep_x_gradients,
                     swapped=swapped, cost=request.cost if swapped else None)


plan_checkpoints = loops_checkpointed(_plan_checkpoints, lambda request: request.checkpoints)


def _plan_budget(request: PlanRequest) -> Plan:
    """A budget: the budget search over the candidates, fitted to the
    allocator's whole chunks (:mod:`memsaving.planners.chunk_fit`)."""
    model, keep_x, budget_bytes = request.model, request.keep_x_gradients, int(request.budget or 0)
    pool, cut_bytes = candidate_pool(request)
    if not pool and model.splits:
        # the step between xs and ys is split regions only: nothing left to choose
        made = make_plan(model, [], "budget", budget=budget_bytes, keep_x_gradients=keep_x)
        if made.predicted_peak > budget_bytes and not request.or_lowest:
            raise no_plan_fits("plan", budget_bytes, feasible_budget(made.predicted_peak), " with these split regions")
        return made
    if not pool:
        raise CheckpointError(
            "budget= found no candidate checkpoint (the graph between xs and ys has no cut); "
            "pass checkpoints=[tensors] as the candidates to choose from."
        )

    def plan_at(target: int, lowest: bool) -> Plan:
        try:
            # a model with split regions gets single-level plans only: multi-level ones around its regions
            # give equal gradients, but their peaks have not been measured against their predictions yet
            chosen = plan_for_budget(model, pool, target, keep_x_gradients=keep_x, cut_bytes=cut_bytes,
                                     or_lowest=lowest, multilevel=request.multilevel and not model.splits)
        except BudgetError:
            # the mode's own plan (checkpoints="memory"'s lowest-peak search) is one more candidate
            proposed = _mode_plan(request, target)
            if proposed is None or proposed.predicted_peak > target:
                raise
            return proposed
        swapped = swapped_tensors(request, chosen.checkpoint_ops, chosen.inner)
        made = make_plan(model, chosen.checkpoint_ops, "budget", budget=target, keep_x_gradients=keep_x,
                         inner=chosen.inner, swapped=swapped, cost=request.cost if swapped else None)
        if lowest and made.device_peak > target:
            # nothing fits: the budget search's lowest plan, against the memory mode's own (a
            # depthwise-separable net's lowest budget plan held 75.4 MiB in chunks, memory mode's 60.5)
            proposed = _mode_plan(request, target)
            if proposed is not None and proposed.device_peak < made.device_peak:
                return proposed
        return made

    return fit_in_chunks(plan_at, budget_bytes, model.resident_bytes, request.or_lowest)


plan_budget = loops_checkpointed(_plan_budget, lambda request: "budget")


def plan_hybrid_swap(request: PlanRequest) -> Plan:
    """``swap="auto"``: keep / swap / recompute chosen together (:mod:`memsaving.planners.hybrid`)."""
    if request.budget is None:
        raise ValueError("swap='auto' chooses between recomputing and swapping under a memory budget: "
                         "pass budget= as well (e.g. budget='2GiB'), or use swap=True")
    pool, cut_bytes = candidate_pool(request)
    keep_x = request.keep_x_gradients
    result = plan_hybrid(request.model, pool, request.budget, cost=request.cost, keep_x_gradients=keep_x,
                         cut_bytes=cut_bytes, or_lowest=request.or_lowest)
    return make_plan(request.model, result.best.checkpoint_ops, "hybrid", budget=request.budget,
                     keep_x_gradients=keep_x, swapped=result.best.swapped, cost=request.cost, inplace=True)


def plan_split(request: PlanRequest) -> Plan:
    """``split=``: the regions it names (or that :func:`auto_split` chooses)
    folded into the model, then the unsplit planner on the folded model."""
    if request.swap is not None and request.swap is not False:
        raise ValueError("split= cannot be combined with swap= yet: choose one of them")
    unsplit = replace(request, split=None)

    def plan_model(folded: GraphModel, lowest: bool = request.or_lowest) -> Plan:
        return make_plan_for(replace(unsplit, model=folded, or_lowest=lowest))

    has_budget = request.budget is not None
    if request.split == "auto":
        if not request.or_lowest or not has_budget:
            return auto_split(request.model, plan_model, has_budget)
        # a plan that does not fit must not pass for one that does: the lowest comes only when none fits
        try:
            return auto_split(request.model, lambda folded: plan_model(folded, lowest=False), True)
        except BudgetError:
            return auto_split(request.model, plan_model, has_budget=False)
    assert isinstance(request.split, tuple)
    return plan_model(explicit_split(request.model, list(request.split)))


PLANNERS: Dict[str, Callable[[PlanRequest], Plan]] = {
    "checkpoints": plan_checkpoints,
    "budget": plan_budget,
    "hybrid": plan_hybrid_swap,
    "split": plan_split,
}
"""Each kind of plan's planner, by the name :func:`planner_name` gives."""


def planner_name(request: PlanRequest) -> str:
    """The rule: ``split=`` first (its regions are folded, then planned by
    the rule again), then ``swap="auto"``, then a budget, else the
    checkpoints as asked for."""
    if request.split is not None:
        return "split"
    if request.swap == "auto":
        return "hybrid"
    if request.budget is not None:
        return "budget"
    return "checkpoints"


def make_plan_for(request: PlanRequest) -> Plan:
    """The plan for ``request``, by the planner :func:`planner_name` picks."""
    return PLANNERS[planner_name(request)](request)
