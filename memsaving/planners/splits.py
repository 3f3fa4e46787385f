"""Choosing split regions (no TensorFlow): the third option beside keeping
or recomputing a tensor, and swapping it.

A split region (:mod:`memsaving.model.splitting`) lowers what one
operation holds, which no choice of checkpoints can: the floor under every
plan.  Splitting costs time (each piece is a kernel launch of its own, and
the region's forward runs again in its gradient), so it is used only where
it pays:

* ``split={tensor_or_op: k}`` splits the regions grown around the ops
  named (each bounded by its block, :func:`region_choices`), in ``k``
  pieces, and the plan is made on the folded model;
* ``split="auto"`` with a budget first plans without splitting; when no
  plan fits, it splits the regions around the ops that hold the most by
  themselves (:func:`memsaving.model.splitting.largest_splittable_ops`),
  grown bounded by their block and not, alone and beside one region per
  block of the rest of the step (:func:`further_regions`), in 2, 4, 8...
  pieces, until a plan fits, and takes the plan that fits with the least
  compute; without a budget, it takes the split that gives the lowest
  predicted peak, doubling the pieces while that lowers the peak by more
  than :data:`WORTH_A_DOUBLING`.

A folded region may be recomputed like any op (its forward pieces run
again), so splitting every block costs no more kept memory than
checkpointing them.

Every candidate is planned by the same planners and scored by the same
simulator as the unsplit model.
"""

from __future__ import annotations

from typing import Any, Callable, FrozenSet, List, Optional, Sequence, Set, Tuple

from memsaving.candidates.cuts import bottleneck_ops
from memsaving.errors import BudgetError, CheckpointError
from memsaving.model.graph import GraphModel
from memsaving.model.splitting import grow_region, largest_splittable_ops
from memsaving.planners.budget import exact_bytes
from memsaving.sim.split_regions import fold_regions

Planner = Callable[[GraphModel], Any]
"""Plans a (possibly folded) model: returns a plan with a ``predicted_peak``,
or raises :class:`~memsaving.errors.BudgetError`."""

WORTH_A_DOUBLING = 0.02
"""Without a budget, pieces are doubled while the memory the step adds
(the predicted peak less the memory in use before it) falls by more than
this fraction."""

MAX_PIECES = 64
"""The most pieces ``"auto"`` cuts a region into (each is a kernel launch)."""

SEEDS = 2
"""Ops ``"auto"`` grows regions around: those holding the most by themselves."""

FURTHER_SEEDS = 64
"""Ops ``"auto"`` grows further regions around, beside the first one
(:func:`further_regions`): those holding the most by themselves."""

FURTHER_PIECES = 2
"""Pieces of each further region: one per block of a network, whose
pieces are small already, so two halve what a block holds for few more
kernels."""


def explicit_split(model: GraphModel, seeds: Sequence[Tuple[int, int]]) -> GraphModel:
    """``model`` with a region grown around each seed op, ``(op, pieces)``,
    folded.  Of the ways the seed can be cut into rows (the batch, or
    batch and sequence for token-wise ops) the one whose region computes
    the most (:func:`region_choice`) is taken.

    Raises
    ------
    CheckpointError
        a seed cannot be split (its op mixes rows, or its shapes are
        unknown), or into that many pieces.
    """
    regions = []
    taken: Set[int] = set()
    for seed, pieces in seeds:
        op = model.ops[seed]
        if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 2:
            raise CheckpointError(f"split={{{op.name}: {pieces!r}}}: give the number of pieces as an int >= 2")
        choices = [choice for choice in region_choices(model, seed) if choice[1] >= pieces]
        if not choices:
            raise CheckpointError(_why_not(model, seed, pieces))
        found, rows = max(choices, key=lambda choice: (_region_cost(model, choice[0]), choice[1]))
        if taken.intersection(found):
            raise CheckpointError(f"split: the region of {op.name} overlaps another region asked for; "
                                  "name one op per region")
        taken.update(found)
        regions.append((found, rows, pieces))
    return fold_regions(model, regions)


FENCE_FRACTION = 0.5
"""A region stops at the tensors every path of the step crosses that are
smaller than this fraction of its seed's largest output: the boundaries
between a network's blocks (a residual stream between a transformer's
attention and MLP, the features before a language model's head)."""


def region_choices(model: GraphModel, seed: int, fenced: bool = True) -> List[Tuple[Tuple[int, ...], int]]:
    """The regions that can be grown around op ``seed``, one per number of
    rows it can be cut into: ``[(ops, rows), ...]``.  With ``fenced``, each
    stops at the small tensors every path crosses (:data:`FENCE_FRACTION`):
    a region grown on past one takes in the next block of a transformer,
    whose results it must then hand on whole; unfenced, it may take in a
    whole network (a U-Net's pieces of the batch, from its input to its
    loss)."""
    floor = FENCE_FRACTION * max((model.tensors[t].gradient_bytes for t in model.ops[seed].outputs), default=0)
    fences = frozenset(t for t in crossed_tensors(model) if model.tensors[t].gradient_bytes < floor) if fenced \
        else frozenset()
    found = []
    for rows, _ in model.ops[seed].row_splits:
        region = grow_region(model, seed, rows, fences=fences)
        if region is not None:
            found.append((region, rows))
    return found


def crossed_tensors(model: GraphModel) -> FrozenSet[int]:
    """The outputs of the forward ops every path from the step's inputs to
    its results crosses (:func:`memsaving.candidates.cuts.bottleneck_ops`)."""
    return model.derived("crossed tensors", lambda: frozenset(
        t for i in bottleneck_ops(model) for t in model.ops[i].outputs))


def _region_cost(model: GraphModel, ops: Sequence[int]) -> float:
    return sum(model.ops[i].cost for i in ops)


def _why_not(model: GraphModel, seed: int, pieces: int) -> str:
    op = model.ops[seed]
    if not op.row_splits:
        return (f"cannot split {op.name} ({op.type}): it does not compute each row of its output (an example "
                "of the batch, or a token) from the same row of its inputs, or its shapes are unknown; split a "
                "token-wise or example-wise op (products with weights, elementwise ops, softmax, "
                "cross-entropy, convolutions over the batch)")
    if not op.copyable:
        return f"cannot split {op.name} ({op.type}): it is stateful or random, so its pieces would differ"
    most = max(rows for rows, _ in op.row_splits)
    if pieces > most:
        return f"cannot split {op.name} into {pieces} pieces: it has only {most} rows; ask for at most {most}"
    return (f"cannot split {op.name}: it makes one of ys (a result must be the tensor you hold), or one of xs, "
            "or its rows differ from its outputs'")


def auto_split(model: GraphModel, plan: Planner, has_budget: bool):
    """The plan of ``split="auto"`` (module docstring): unsplit when it fits
    (or, without a budget, when no split lowers its peak).  Each seed is
    tried with each way it can be cut into rows; with a budget, of the
    splits that fit, the one that computes least wins."""
    try:
        best = plan(model)
    except BudgetError as error:
        if not has_budget:
            raise
        best, failure = None, error
    if has_budget and best is not None:
        return best
    tried = set()
    floors: List[Optional[int]] = []  # the smallest budgets the failed splits report
    for seed, _ in largest_splittable_ops(model, SEEDS):
        for region, rows in region_choices(model, seed, fenced=False) + region_choices(model, seed):
            if (region, rows) in tried:
                continue  # the regions of two seeds are often the same
            tried.add((region, rows))
            found = _split_for(model, plan, region, rows, has_budget, floors)
            if found is not None and (best is None or _better(found, best, has_budget)):
                best = found
            # the same region beside one region per block of the rest of the step
            further = further_regions(model, region)
            if further:
                found = _split_for(model, plan, region, rows, has_budget, floors, further)
                if found is not None and (best is None or _better(found, best, has_budget)):
                    best = found
    if best is None:
        floor = min((f for f in floors if f), default=None)
        unsplit = failure.smallest_budget
        if floor is not None and (unsplit is None or floor < unsplit):
            without = f", {exact_bytes(unsplit)} without" if unsplit is not None else ""
            raise BudgetError.carrying(
                f"no plan fits the budget, even with split regions (split='auto'); the smallest feasible budget "
                f"found is {exact_bytes(floor)} with them{without}. Raise the budget, or reduce the batch size.",
                floor) from failure
        raise failure
    return best


def further_regions(model: GraphModel, first: Sequence[int]) -> List[Tuple[Tuple[int, ...], int, int]]:
    """Regions around the ops that hold the most by themselves outside
    ``first``, each grown as :func:`explicit_split` grows a seed's and
    taken when it overlaps none taken before, in :data:`FURTHER_PIECES`
    pieces: ``[(ops, rows, pieces), ...]``.  Fenced (:func:`region_choices`),
    they are one per block of a network (a transformer's attention and
    MLP), which the planners may then recompute like any op."""
    taken = set(first)
    found = []
    for seed, _ in largest_splittable_ops(model, FURTHER_SEEDS):
        if seed in taken:
            continue
        choices = [choice for choice in region_choices(model, seed)
                   if choice[1] >= FURTHER_PIECES and taken.isdisjoint(choice[0])]
        if not choices:
            continue
        region, rows = max(choices, key=lambda choice: (_region_cost(model, choice[0]), choice[1]))
        taken.update(region)
        found.append((region, rows, FURTHER_PIECES))
    return found


def _split_for(model: GraphModel, plan: Planner, region: Tuple[int, ...], rows: int,
               has_budget: bool, floors: List[Optional[int]], further: Sequence = ()) -> Optional[object]:
    """The plan of ``region`` cut into 2, 4, 8... pieces, beside the
    ``further`` regions (as :func:`fold_regions` takes them): with a budget,
    the first that fits (None if none does; the smallest budgets the
    failures report are added to ``floors``); without, the lowest peak,
    doubling while it falls by more than :data:`WORTH_A_DOUBLING`."""
    best = None
    pieces = 2
    while pieces <= min(rows, MAX_PIECES):
        try:
            found = plan(fold_regions(model, [(region, rows, pieces)] + list(further)))
        except BudgetError as error:
            found = None
            floors.append(error.smallest_budget)
        if has_budget and found is not None:
            return found
        if not has_budget and found is not None:
            if best is not None and _added(found) > (1 - WORTH_A_DOUBLING) * _added(best):
                break
            if best is None or found.predicted_peak < best.predicted_peak:
                best = found
        pieces *= 2
    return best


def _better(found, best, has_budget: bool) -> bool:
    if has_budget:
        return found.predicted_compute < best.predicted_compute
    return _added(found) < (1 - WORTH_A_DOUBLING) * _added(best)


def _added(plan) -> int:
    """What a plan's step adds to the memory in use before it: the part a
    split can lower (the rest, weights and whatever the device holds, is
    the same in every plan)."""
    return plan.predicted_peak - plan.resident_bytes
