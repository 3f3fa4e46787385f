"""Choosing checkpoints under a memory budget (no TensorFlow).

A dynamic program over the chain of candidate checkpoints (ops that every
input-to-output path crosses) picks the subset that minimises recomputed
FLOPs while a surrogate of the backward peak stays within the budget; the
surrogate is then checked with the simulator, the one judge of every plan, and
the budget the DP works with is tightened until the simulated peak fits.

Surrogate: during the backward pass of the segment between kept candidates
``a`` and ``b``, memory holds every kept output up to ``a`` plus the forward
tensors the segment's gradients read plus the gradient and work buffers of
the op of the segment whose gradient holds most.  Recomputing that segment
costs the FLOPs of its ops (the segment after the last checkpoint is
differentiated in place and costs nothing).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import List, NoReturn, Optional, Sequence, Tuple, Union

import numpy as np

from memsaving.errors import BudgetError, feasible_budget
from memsaving.planners.chain import Chain, as_cuts as _as_cuts, chain as _chain, ops_of as _ops_of
from memsaving.model.graph import GraphModel
from memsaving.model.proposal import Proposal
from memsaving.planners.nested import nested_plan, thinned_chain
from memsaving.planners.refine import refined_plans
from memsaving.model.schedule import kept_set, validate_inner
from memsaving.sim.allowance import stopped, used_up
from memsaving.sim.simulate import peak_lower_bound, simulate

_UNITS = {
    "": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
    "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
}


def format_bytes(count: int, digits: int = 1) -> str:
    """``1536`` -> ``'1.5 KiB'``: a readable size for messages and tables,
    with ``digits`` decimals."""
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:.{digits}f} GiB"


def exact_bytes(count: int) -> str:
    """``6291456`` -> ``'6,291,456 bytes (6.00 MiB)'``: a size to the byte,
    for the figures an error compares (a budget and the smallest that fits),
    which a rounded size could show equal or in the wrong order.

    Examples
    --------
    >>> exact_bytes(6291456)
    '6,291,456 bytes (6.00 MiB)'
    >>> exact_bytes(1000)
    '1,000 bytes'
    """
    count = int(count)
    return f"{count:,} bytes" if abs(count) < 1024 else f"{count:,} bytes ({format_bytes(count, digits=2)})"


def no_plan_fits(what: str, budget: int, smallest: int, rest: str = "") -> BudgetError:
    """The BudgetError for a ``budget`` that no ``what`` fits, whose
    smallest feasible budget found is ``smallest`` (stored with it, and
    printed to the byte); ``rest`` ends the message."""
    return BudgetError.carrying(f"no {what} fits the budget of {exact_bytes(budget)}; the smallest feasible "
                                f"budget found is {exact_bytes(smallest)}{rest}", smallest)


_BUDGET_FORMS = ("an int number of bytes (e.g. 2_000_000_000), a whole float (2e9), or a string with a "
                 "unit such as '512MiB', '2GiB', '1.5GB'")


def parse_bytes(value: Union[int, float, str]) -> int:
    """``2GiB``, ``"512 MB"``, ``1.5e9`` or ``1073741824`` -> bytes.

    A budget below one byte, or a fraction of a byte (``1.5``, ``"0.5"``), is
    refused rather than rounded: such a value is almost always a size in
    GiB or MB given without its unit, and truncating it would plan for a
    budget nothing fits in.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            raise ValueError(f"memory budget must be finite: got budget={value!r}; give {_BUDGET_FORMS}")
        number = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read memory budget {value!r}: give {_BUDGET_FORMS}")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        raise TypeError(f"budget={value!r} ({type(value).__name__}) is not a memory size: give {_BUDGET_FORMS}")
    if number < 1:
        raise ValueError(f"budget={value!r} is {number:g} bytes; a budget must be a positive number of bytes, "
                         f"at least one: give {_BUDGET_FORMS}")
    if number != int(number):
        raise ValueError(f"budget={value!r} is {number:g} bytes, a fraction of a byte (a unit missing?): "
                         f"give {_BUDGET_FORMS}")
    return int(number)


def _surrogate_dp(chain: Chain, budget: float, buckets: int = 256) -> Optional[List[int]]:
    """Indices (into the candidate list) of the cheapest surrogate-feasible subset."""
    m = len(chain.positions) - 2
    total_kept = float(chain.kept.sum()) if m else 0.0
    scale = max(total_kept, 1.0) / buckets
    kept_units = np.ceil(chain.kept / scale).astype(int) if m else np.zeros(0, int)
    size = int(kept_units.sum()) + 1
    inf = np.inf
    best = np.full((m + 2, size), inf)
    parent = np.full((m + 2, size), -1, dtype=int)
    best[0, 0] = 0.0
    columns = np.arange(size)
    for b in range(1, m + 2):
        last = b == m + 1
        # from every earlier cut a at once: state j (kept units so far) must
        # leave room for the stretch (a, b]
        allowed = np.floor((budget - chain.memory_to(b)) / scale)
        # Only earlier cuts that leave room, and only the states they allow:
        # the rest of the table stays infinite (the same argmin, far fewer cells).
        rows = np.flatnonzero(allowed >= 0)
        shift = 0 if last else int(kept_units[b - 1])
        width = size - shift
        if width <= 0 or not rows.size:
            continue
        reach = int(min(allowed[rows].max(), width - 1)) + 1
        recompute = np.zeros(b) if last else chain.cost_to(b)
        candidate = np.where(columns[None, :reach] <= allowed[rows, None],
                             best[rows, :reach] + recompute[rows, None], inf)
        picked = np.argmin(candidate, axis=0)
        value = candidate[picked, columns[:reach]]
        best[b, shift:shift + reach] = value
        parent[b, shift:shift + reach] = np.where(np.isfinite(value), rows[picked], -1)
    final = best[m + 1]
    if not np.isfinite(final).any():
        return None
    state = int(np.argmin(final))
    chosen = []
    b = m + 1
    while b > 0:
        a = int(parent[b][state])
        if b != m + 1:
            state -= kept_units[b - 1]
        if a > 0:
            chosen.append(a - 1)
        b = a
    return sorted(chosen)


def _evaluations(model: GraphModel, at_least: int) -> int:
    """Simulations a search may run by default: 20,000 ops' worth of
    replays (a replay costs time linear in the graph), and ``at_least``."""
    return max(at_least, 20_000 // max(len(model.ops), 1))


@dataclass
class _SearchResult:
    cuts: List[List[int]]
    evaluated: dict  # chosen cut indices -> (recompute_cost, simulated_peak)
    best: Optional[Tuple[int, ...]]  # cheapest plan that fits, if any


def _search(
    model: GraphModel,
    candidates: Sequence[Union[int, Sequence[int]]],
    budget: int,
    *,
    keep_x_gradients: bool,
    cut_bytes: Optional[Sequence[float]],
    max_evaluations: Optional[int],
    rounds: int = 8,
    max_candidates: int = 500,
) -> _SearchResult:
    """The search behind :func:`select_for_budget` and :func:`lowest_peak_plan`."""
    cuts = _as_cuts(candidates)
    if len(cuts) > max_candidates:
        # The DP is quadratic in the candidates: keep an evenly spread subset
        # (always the last cut), so large graphs are planned in seconds.
        keep = sorted({int(round(k * (len(cuts) - 1) / (max_candidates - 1))) for k in range(max_candidates)})
        cuts = [cuts[k] for k in keep]
        if cut_bytes is not None:
            cut_bytes = [cut_bytes[k] for k in keep]
    if max_evaluations is None:
        max_evaluations = _evaluations(model, at_least=40)
    cache = {}

    def evaluate(chosen: Tuple[int, ...]):
        if chosen not in cache:
            sim = simulate(model, _ops_of(cuts, chosen), keep_x_gradients=keep_x_gradients)
            cache[chosen] = (sim.recompute_cost, sim.peak_bytes)
        return cache[chosen]

    def feasible(chosen):
        return evaluate(chosen)[1] <= budget

    best: Optional[Tuple[int, ...]] = None

    def consider(chosen: Tuple[int, ...]):
        nonlocal best
        if feasible(chosen) and (best is None or evaluate(chosen)[0] < evaluate(best)[0]):
            best = chosen

    # 1. the surrogate DP, tightened until the simulated peak fits
    chain = _chain(model, cuts)
    target = float(budget - model.resident_bytes)
    previous_peak = None
    for round_ in range(rounds):
        if round_ and used_up():
            break
        picked = _surrogate_dp(chain, target) if target > 0 else None
        if picked is None:
            break
        chosen = tuple(picked)
        consider(chosen)
        peak = evaluate(chosen)[1]
        if peak <= budget or (previous_peak is not None and peak >= previous_peak):
            break  # it fits, or a tighter surrogate no longer lowers what sets the peak
        previous_peak = peak
        # Tighten from the plan's own surrogate, which may lie far under the
        # target (memory the surrogate does not see, such as weight gradients,
        # makes it optimistic): tightening the target alone by the excess
        # would return the same plan round after round.
        target = min(target, chain.peak(picked)) - (peak - budget)
    # 2. Chen et al.'s greedy plans
    if cut_bytes is None:
        before = np.concatenate([[0.0], np.cumsum([
            sum(model.tensors[t].nbytes for t in op.outputs) if op.forward else 0 for op in model.ops])])
        cut_bytes = [before[max(cut) + 1] for cut in cuts]
    for chosen in spread(greedy_plans(cut_bytes, model.activation_bytes()), max_evaluations - len(cache)):
        if len(cache) >= max_evaluations or (cache and used_up()):
            break
        consider(chosen)
    # 2b. evenly spaced plans of a dozen sizes (cheap, and robust where the
    #    surrogate misjudges)
    m = len(cuts)
    for k in sorted({int(v) for v in np.geomspace(1, max(m, 1), 12)}):
        if len(cache) >= max_evaluations or (cache and used_up()):
            break
        consider(tuple(sorted({int(round((j + 1) * (m + 1) / (k + 1))) - 1 for j in range(k)} & set(range(m)))))
    # 3. local search over add / drop / shift-by-one moves.  While nothing
    #    fits, a move is better when it lowers the simulated peak; once a
    #    plan fits, when it fits and recomputes less.
    def score(chosen):
        cost, peak = evaluate(chosen)
        return (0, cost) if peak <= budget else (1, peak)

    current = best if best is not None else (min(cache, key=lambda c: cache[c][1]) if cache else ())
    improved = True
    while improved and len(cache) < max_evaluations and not used_up():
        improved = False
        members = list(current)
        moves = [tuple(c for c in members if c != drop) for drop in members]
        for idx, c in enumerate(members):
            for step in (-1, 1):
                moved = c + step
                if 0 <= moved < m and moved not in members:
                    moves.append(tuple(sorted(members[:idx] + [moved] + members[idx + 1:])))
        if score(current)[0] == 1:  # adding only helps while nothing fits
            moves += [tuple(sorted(members + [k])) for k in range(m) if k not in members]
        for move in moves:
            if len(cache) >= max_evaluations or used_up():
                break
            if score(move) < score(current):
                current = move
                consider(move)
                improved = True
                break
    return _SearchResult(cuts, cache, best)


def select_for_budget(
    model: GraphModel,
    candidates: Sequence[Union[int, Sequence[int]]],
    budget: int,
    *,
    keep_x_gradients: bool = False,
    rounds: int = 8,
    max_evaluations: Optional[int] = None,
    cut_bytes: Optional[Sequence[float]] = None,
    max_candidates: int = 500,
) -> Proposal:
    """Checkpoint ops minimising recomputation with simulated peak <= ``budget``.

    ``candidates`` are op indices or sets of op indices (cuts), ordered from
    the inputs to the outputs.  Every plan is judged by the simulator: the
    surrogate DP (its budget tightened below the last plan's surrogate peak
    until the simulated peak fits, or stops falling),
    Chen et al.'s greedy plans and evenly spaced plans as fallbacks, then a
    local search (add, drop or shift one cut) that lowers the peak while
    nothing fits and the recomputation once something does.  The number of simulations is
    bounded (``max_evaluations``, scaled down for large graphs).

    ``cut_bytes`` (optional) gives the activation bytes computed before each
    candidate, for the greedy plans; by default the bytes before the
    candidate's last op in the model's order.  More than ``max_candidates``
    candidates are thinned to an evenly spread subset first.

    Returns the plan as a :class:`~memsaving.model.proposal.Proposal`
    named ``"single-level"``.

    Raises
    ------
    BudgetError
        nothing found fits; the message gives the smallest
        budget found feasible.
    """
    found = _search(model, candidates, budget, keep_x_gradients=keep_x_gradients, cut_bytes=cut_bytes,
                    max_evaluations=max_evaluations, rounds=rounds, max_candidates=max_candidates)
    if found.best is not None:
        cost, peak = found.evaluated[found.best]
        return Proposal(_ops_of(found.cuts, found.best), peak, cost, name="single-level")
    floor = min([peak for _, peak in found.evaluated.values()]
                + [minimum_peak(model, found.cuts, keep_x_gradients=keep_x_gradients)])
    _raise_infeasible(model, budget, floor)


def _raise_infeasible(model: GraphModel, budget: int, lowest_peak: int) -> NoReturn:
    notes = ""
    bound = peak_lower_bound(model)
    if budget < bound:
        notes += (f" No plan can fit it: the forward pass alone holds {format_bytes(bound - model.resident_bytes)}"
                  " above that memory while its largest op runs (outputs and work buffers).")
    if stopped():
        notes += (" Planning stopped at its planning_time before it had tried every plan it would: a larger "
                  "planning_time= (or None) may find a plan that fits.")
    raise no_plan_fits("checkpoint plan", budget, feasible_budget(lowest_peak), (
        f", of which {format_bytes(model.resident_bytes)} are in use before the step (parameters, inputs and "
        "what the device already holds). Raise the budget, or reduce the batch size." + notes))


LOWEST_PEAK_EVALUATIONS = 12
"""Simulations the lowest-peak search may run on large graphs (above
about 1,700 ops; smaller graphs get up to 40, as the budget search).  Its
plans' peaks differ by a few percent at most, and on graphs of thousands
of ops the first dozen (Chen's greedy plans over the whole range of
thresholds) came within 0.7% of a search three times as long
(README, "Planning time on large graphs")."""


def lowest_peak_plan(
    model: GraphModel,
    candidates: Sequence[Union[int, Sequence[int]]],
    *,
    keep_x_gradients: bool = False,
    cut_bytes: Optional[Sequence[float]] = None,
    max_evaluations: Optional[int] = None,
) -> Proposal:
    """The single-level plan of lowest simulated peak that the search finds.

    The same search as :func:`select_for_budget` with a budget nothing fits,
    so every step lowers the peak; ties go to less recomputation.  Returns
    the plan as a :class:`~memsaving.model.proposal.Proposal` named
    ``"lowest"``.
    """
    if max_evaluations is None:
        max_evaluations = _evaluations(model, at_least=LOWEST_PEAK_EVALUATIONS)
    found = _search(model, candidates, 0, keep_x_gradients=keep_x_gradients, cut_bytes=cut_bytes,
                    max_evaluations=max_evaluations)
    plain = simulate(model, keep_x_gradients=keep_x_gradients)
    options: List[Tuple[Tuple[int, float], List[int]]] = [((plain.peak_bytes, 0.0), [])] + [
        ((peak, cost), _ops_of(found.cuts, chosen)) for chosen, (cost, peak) in found.evaluated.items()]
    (peak, cost), ops = min(options, key=lambda option: option[0])
    return Proposal(ops, peak, cost, name="lowest")


def spread(plans: Sequence, room: int) -> list:
    """``plans`` when ``room`` evaluations cover them all, else ``room`` of
    them spread evenly over the list, in order: a search cut short still
    tries small and large thresholds alike.

    Examples
    --------
    >>> spread(list("abcdefg"), 3)
    ['a', 'd', 'g']
    >>> spread(list("abc"), 5)
    ['a', 'b', 'c']
    """
    if room >= len(plans):
        return list(plans)
    if room <= 1:
        return list(plans[:max(room, 0)])
    picked = sorted({int(round(k * (len(plans) - 1) / (room - 1))) for k in range(room)})
    return [plans[k] for k in picked]


def greedy_plans(cut_bytes: Sequence[float], total_bytes: float, thresholds: int = 30) -> List[Tuple[int, ...]]:
    """Chen et al.'s greedy plans, one per threshold.

    Walking the candidates from the inputs, a candidate is kept whenever the
    activation bytes since the last kept one reach the threshold; thresholds
    are spread geometrically from ``total/200`` to ``total``.  Returns the
    candidate indices of each plan.
    """
    total = max(float(total_bytes), 1.0)
    plans = []
    for threshold in np.geomspace(total / 200, total, thresholds):
        chosen, last = [], 0.0
        for k, at in enumerate(cut_bytes):
            if at - last >= threshold:
                chosen.append(k)
                last = at
        plans.append(tuple(chosen))
    return list(dict.fromkeys(plans))


def low_peak_plans(model: GraphModel, candidates: Sequence) -> List[List[int]]:
    """Checkpoint ops of the surrogate DP's plans for a range of small budgets.

    Each is a single-level plan (every op recomputed at most once), so each
    costs at most about one extra forward pass; the simulator decides which
    is lowest.
    """
    cuts = _as_cuts(candidates)
    chain = _chain(model, cuts)
    plain = simulate(model).peak_bytes - model.resident_bytes
    plans = []
    for fraction in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7):
        picked = _surrogate_dp(chain, fraction * plain)
        if picked is not None:
            plans.append(_ops_of(cuts, picked))
    return plans


def minimum_peak(model: GraphModel, candidates: Sequence, *, keep_x_gradients: bool = False) -> int:
    """The smallest simulated peak over DP plans for a range of budgets."""
    peaks = [simulate(model, ops, keep_x_gradients=keep_x_gradients).peak_bytes
             for ops in [[], *low_peak_plans(model, candidates)]]
    return min(peaks)


REFINED_SEARCH_EVALUATIONS = 8
"""Simulations of the single-level search when the per-op refinement
follows it (:func:`plan_for_budget`; 40 when the search alone decides, as in
:func:`select_for_budget`): the refinement starts from the search's plan
and recomputes far less, so a rougher start costs little.  More on graphs
under 2,500 ops (:func:`_evaluations`), whose simulations are cheap."""


def plan_for_budget(
    model: GraphModel,
    candidates: Sequence[Union[int, Sequence[int]]],
    budget: int,
    *,
    keep_x_gradients: bool = False,
    cut_bytes: Optional[Sequence[float]] = None,
    max_evaluations: Optional[int] = None,
    multilevel: bool = True,
    per_op: bool = True,
    or_lowest: bool = False,
) -> Proposal:
    """The least-recomputation plan whose simulated peak fits ``budget``.

    Single-level plans come from :func:`select_for_budget`'s search;
    with ``per_op``, their per-op refinements (:mod:`memsaving.planners.refine`:
    keep more of the recomputed ops, or start from keeping everything and
    recompute only ops cheap per byte) compete with them; with
    ``multilevel``, when none of those fits, recursive plans from the
    multi-level DP (:mod:`memsaving.planners.nested`), all judged by the
    same simulator.  Recursive plans reach budgets below any single-level
    plan, for more recomputation (an op may be recomputed twice), so they
    are searched only where no single-level plan fits.

    ``or_lowest``: when nothing fits, return the lowest-peak plan found
    instead of raising (its ``peak`` is then above ``budget``).  A
    calibration that measures peaks wants that plan: predictions err both
    ways, so it may fit as measured.

    Raises
    ------
    BudgetError
        nothing fits (and not ``or_lowest``); the message gives
        the smallest budget found feasible.
    """
    if budget < peak_lower_bound(model):
        # no plan fits: skip the searches for this budget, find the floor to report
        lowest = _lowest_plan(model, candidates, keep_x_gradients, cut_bytes, multilevel)
        if or_lowest:
            return lowest
        _raise_infeasible(model, budget, lowest.peak)
    searched = max_evaluations
    if searched is None and per_op:
        searched = _evaluations(model, at_least=REFINED_SEARCH_EVALUATIONS)
    found = _search(model, candidates, budget, keep_x_gradients=keep_x_gradients, cut_bytes=cut_bytes,
                    max_evaluations=searched)
    proposals = []
    if found.best is not None:
        cost, peak = found.evaluated[found.best]
        proposals.append(Proposal(_ops_of(found.cuts, found.best), peak, cost, name="single-level"))
    if per_op:
        starts = [_ops_of(found.cuts, found.best)] if found.best is not None else []
        proposals += refined_plans(model, starts, budget, keep_x_gradients=keep_x_gradients,
                                   max_evaluations=max_evaluations, descend=bool(starts))
    if multilevel and not proposals:
        for nested, sim in _nested_search(model, candidates, budget, keep_x_gradients):
            if sim.peak_bytes <= budget:
                proposals.append(Proposal(nested.checkpoint_ops, sim.peak_bytes, sim.recompute_cost,
                                          inner=nested.inner, name="multi-level"))
    if proposals:
        return min(proposals, key=lambda proposal: (proposal.recompute_cost, proposal.peak))
    lowest = _lowest_plan(model, candidates, keep_x_gradients, cut_bytes, multilevel)
    if lowest.peak <= budget or or_lowest:
        return lowest
    _raise_infeasible(model, budget, lowest.peak)


def _lowest_plan(model: GraphModel, candidates, keep_x_gradients: bool, cut_bytes, multilevel: bool) -> Proposal:
    """The lowest-peak plan found by searches that do not depend on the
    budget asked for: the floor the BudgetError message reports, which
    therefore fits when passed back as the budget."""
    best = lowest_peak_plan(model, candidates, keep_x_gradients=keep_x_gradients, cut_bytes=cut_bytes)
    if not multilevel:
        return best
    resident = model.resident_bytes
    activations = simulate(model, keep_x_gradients=keep_x_gradients).peak_bytes - resident
    for fraction in (0.3, 0.15, 0.08, 0.04):
        if used_up():
            break
        target = resident + int(fraction * activations)
        for nested, sim in _nested_search(model, candidates, target, keep_x_gradients, rounds=5):
            if (sim.peak_bytes, sim.recompute_cost) < (best.peak, best.recompute_cost):
                best = Proposal(nested.checkpoint_ops, sim.peak_bytes, sim.recompute_cost, inner=nested.inner,
                                name="lowest")
    return best


def _nested_search(model: GraphModel, candidates, budget: int, keep_x_gradients: bool, rounds: int = 7):
    """Recursive plans for ``budget`` with their simulations.

    The surrogate's memory is only an estimate (often pessimistic), so the
    surrogate budget is searched (bisection in log space between 0.3x and 3x
    the real one): too small and the DP finds nothing, too large and the plan's
    simulated peak exceeds the budget.
    """
    cuts, summary = thinned_chain(model, candidates)
    real = float(budget - model.resident_bytes)
    if real <= 0 or not cuts:
        return []
    low, high = np.log(0.3 * real), np.log(3.0 * real)
    found = []
    for _ in range(rounds):
        if used_up():
            break
        middle = 0.5 * (low + high)
        proposal = nested_plan(model, cuts, summary, float(np.exp(middle)))
        if proposal is None:
            low = middle
            continue
        kept = kept_set(model, proposal.checkpoint_ops)
        try:
            validate_inner(model, kept, proposal.inner)
        except ValueError:
            low = middle
            continue
        sim = simulate(model, kept=kept, keep_x_gradients=keep_x_gradients, inner=proposal.inner)
        found.append((proposal, sim))
        if sim.peak_bytes <= budget:
            low = middle  # fits: a looser surrogate budget may recompute less
        else:
            high = middle
    return found
