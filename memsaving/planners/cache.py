"""Plans remembered per graph and arguments (no TensorFlow).

Tracing the same step again gives the same graph model: ``plan`` and then
``gradients`` on one graph, a second ``tf.function`` around the same model
(a new ``model.fit`` after ``compile``), a retrace for a Python argument
that does not change the graph.  The planner is deterministic (its search
is bounded by counted work, not by a clock), so planning such a model again
would spend the same search to find the same plan, or to conclude again
that no plan fits.  A plan (or that ``BudgetError``) is therefore
remembered under the model's contents and the arguments that chose it, and
handed back, marked :attr:`~memsaving.planners.planning.Plan.reused` (or
raised again), when both match exactly.

Everything the planner reads is in the key (every op and tensor: names,
sizes, costs, measured temporaries and times; and the arguments), except
two things.  How the kernel profiles were obtained (a retrace finds in the
cache what the first trace measured): the reused plan reports the new
model's profiling.  And the memory in use before the step, which moves by a
few KiB between two traces as the process allocates: it adds the same
bytes to every plan's peak, so the plan of lowest peak stays the lowest and
is reused with its figures moved by the difference; a budget plan is
reused only if it still fits, a ``BudgetError`` only for the same memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Hashable, Optional, Tuple, Union

from memsaving.errors import BudgetError
from memsaving.model.graph import GraphModel
from memsaving.planners.planning import Plan, profile_fields

REMEMBERED_PLANS = 32
"""Plans kept per process; the oldest is forgotten first."""

_plans: "OrderedDict[Hashable, Tuple[int, Union[Plan, BudgetError]]]" = OrderedDict()
"""key -> (the model's resident bytes, the plan or the BudgetError)."""
_lock = threading.Lock()  # tf.function traces may run on several threads


def model_key(model: GraphModel) -> tuple:
    """Everything about ``model`` a plan depends on, except the memory in
    use before the step, as a hashable value.

    Two models with equal keys give the same plan for the same arguments
    (with the same resident memory).

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> model_key(chain_model([4, 4])) == model_key(chain_model([4, 4]))
    True
    >>> model_key(chain_model([4, 4])) == model_key(chain_model([4, 8]))
    False
    """
    return (tuple(model.ops), tuple(sorted(model.tensors.items())), tuple(model.xs), tuple(model.ys),
            model.separate_result_kernels, model.ready_gradients_early)


def remembered(key: Hashable, model: GraphModel) -> Optional[Plan]:
    """The plan remembered under ``key`` (see :func:`remember`), as a copy
    marked reused and carrying ``model``'s profiling; None when there is none.

    Raises
    ------
    BudgetError
        the one remembered under ``key``: no plan fit."""
    with _lock:
        found = _plans.get(key)
        if found is None:
            return None
        _plans.move_to_end(key)
    resident, outcome = found
    if isinstance(outcome, BudgetError):
        if resident != model.resident_bytes:
            return None
        raise outcome.again()
    plan = _moved(outcome, model.resident_bytes - resident)
    if outcome.budget is not None and outcome.predicted_peak <= outcome.budget < plan.predicted_peak:
        return None
    return replace(plan, reused=True, **profile_fields(model))


def _moved(plan: Plan, extra: int) -> Plan:
    """``plan`` with ``extra`` more bytes in use before the step (counted in every peak)."""
    if not extra:
        return plan
    simulation = plan.simulation
    if simulation is not None:
        simulation = replace(simulation, peak_bytes=simulation.peak_bytes + extra)
    return replace(plan, predicted_peak=plan.predicted_peak + extra, plain_peak=plan.plain_peak + extra,
                   resident_bytes=plan.resident_bytes + extra, simulation=simulation)


def remember(key: Hashable, model: GraphModel, outcome: Union[Plan, BudgetError]) -> None:
    """Keep ``outcome`` (a plan for ``model``, or the error saying none
    fits) under ``key``: ``(model_key(model), arguments...)``, every
    argument that chose it.

    An error is kept as a copy never raised: a raised one's traceback holds
    the frames it passed through and, through them, the frames that called
    them (the trace of the step, and after the step has run, its results),
    which would stay on the device for as long as the error is remembered,
    in every later plan's memory in use."""
    if isinstance(outcome, BudgetError):
        outcome = outcome.again()
    with _lock:
        _plans[key] = (model.resident_bytes, outcome)
        _plans.move_to_end(key)
        while len(_plans) > REMEMBERED_PLANS:
            _plans.popitem(last=False)


def clear_plan_cache() -> None:
    """Forget every remembered plan: the next ``plan`` or ``gradients`` call plans again.

    A plan handed back from memory says so
    (:attr:`~memsaving.planners.planning.Plan.reused`); after this call, the
    same graph and arguments are planned afresh.

    Examples
    --------
    Without TensorFlow, on a graph model (:mod:`memsaving.model`):

    >>> import memsaving
    >>> from memsaving.model.graph import chain_model
    >>> from memsaving.planners.planning import make_plan
    >>> model = chain_model([4096] * 8)
    >>> key = (model_key(model), "the arguments that chose the plan")
    >>> remember(key, model, make_plan(model, [3], "list"))
    >>> remembered(key, model).reused
    True
    >>> memsaving.clear_plan_cache()
    >>> remembered(key, model) is None
    True
    """
    with _lock:
        _plans.clear()
