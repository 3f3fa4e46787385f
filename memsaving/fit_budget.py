"""Make a budget hold as *measured*: :func:`fit_to_budget`.

The planner sizes a plan with a simulator, and the allocator's real peak can
be above the prediction (the allocator's chunks, the executor's order,
Grappler's rewrites, whatever else lives on the device).  On a device a step
over the budget is an out-of-memory error, so :func:`fit_to_budget` never
runs a step predicted over the budget by less than the error known so far,
and climbs towards the budget from below (:mod:`memsaving.calibration`).

The planner learns the budget to plan for through a :class:`PlanningTarget`:
``memsaving.gradients(..., budget=B)`` plans for its target instead of ``B``
(:func:`planning_budget`) and records every plan it makes there, so the
caller sees the plans of the step it traced without the step returning
them.  ``memsaving.keras.enable(model, budget=...)`` passes the record
explicitly to the gradient call it makes; :func:`fit_to_budget`, whose
step is the user's code, enters it with :func:`planning_target`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from memsaving.calibration import HEADROOM, CalibrationRound, Calibrator, Next, PeakRise
from memsaving.planners.known_error import KNOWN_ERROR, needed_budget, safe_target
from memsaving.errors import BudgetError, PeakMemoryUnavailableError, feasible_budget
from memsaving.planners.budget import exact_bytes, format_bytes, parse_bytes
from memsaving.planners.planning import Plan
from memsaving.tf.measure import (bytes_in_use, default_device, measure_peak, out_of_memory_raises, peak_bytes,
                                  reset_peak)

logger = logging.getLogger("memsaving")

MEASURED_STEPS = 3
"""Steps measured per plan, after the warm-up; the highest peak counts."""


# ----------------------------------------------------------------------------- the target while tracing


@dataclass
class PlanningTarget:
    """What a calibration tells the planner about one traced step, and the
    plans the planner made for it.

    A calibration hands this record to ``memsaving.gradients_and_plan``
    explicitly where memsaving makes the call itself (Keras' train step:
    its ``planning=`` argument).  Where the user's code makes the call
    (:func:`fit_to_budget`'s step, a ``memsaving.function``'s tape), the
    record reaches it through :func:`planning_target`, the one context
    variable of the package: the calibration cannot pass an argument
    through code it did not write.  ``memsaving.gradients`` reads it there
    once, on entry (:func:`active_target`), and passes it on explicitly.

    Attributes
    ----------
    target
        bytes to plan for instead of the budget asked for (None: the budget
        asked for, less the known error).
    or_lowest
        when no plan fits the target as predicted, the planner's lowest plan
        instead of a ``BudgetError``: the calibration decides whether that
        plan may run.
    held
        bytes the caller holds on the device while the step is traced
        (:func:`held_room`) that the step will not find in use: the memory in
        use before the step leaves them out.
    plans
        every plan made for the step (:meth:`record`), in order.

    Examples
    --------
    >>> record = PlanningTarget(64 << 20, or_lowest=True)
    >>> record.calibrating, planning_budget("1GiB", 8 << 20, record) == 64 << 20
    (True, True)
    """

    target: Optional[int]
    or_lowest: bool = False
    held: int = 0
    plans: List[Plan] = field(default_factory=list)

    @property
    def calibrating(self) -> bool:
        """Whether a calibration chose the budget the planner plans for."""
        return self.target is not None

    def record(self, plan: Plan) -> None:
        """Keep a plan made for the step, for the calibration to judge."""
        self.plans.append(plan)


_ACTIVE: contextvars.ContextVar[Optional[PlanningTarget]] = contextvars.ContextVar("memsaving_planning_target",
                                                                                   default=None)


@contextlib.contextmanager
def planning_target(target: Optional[int], or_lowest: bool = False, held: int = 0) -> Iterator[PlanningTarget]:
    """While active, ``memsaving.gradients(..., budget=B)`` called by code
    inside plans for ``target`` (bytes) instead of ``B``
    (:class:`PlanningTarget` says what each argument means).

    Yields the record that collects every plan ``memsaving.gradients`` makes
    inside (the calls happen when a ``tf.function`` is traced, so enter this
    around the trace, not around later calls of the traced function).
    """
    record = PlanningTarget(None if target is None else int(target), bool(or_lowest), int(held))
    token = _ACTIVE.set(record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def active_target() -> Optional[PlanningTarget]:
    """The record of the innermost :func:`planning_target` (None outside one):
    read once where a gradient call enters memsaving, then passed on."""
    return _ACTIVE.get()


def planning_budget(budget: Optional[Union[int, float, str]], resident: int,
                    planning: Optional[PlanningTarget] = None) -> Optional[int]:
    """The budget the planner plans for when asked for ``budget``.

    Inside a calibration (``planning`` with a target), its target.
    Otherwise (``budget=`` alone, never measured) ``budget`` less room for
    the model's known error (:data:`memsaving.planners.known_error.KNOWN_ERROR`
    of the step memory above ``resident``) and for the allocator's headroom
    (:data:`memsaving.planners.known_error.HEADROOM`): a plan predicted that
    far under the budget still fits when its step memory is that much above
    its prediction.  None when no budget was given.
    """
    if budget is None:
        return None
    if planning is not None and planning.target is not None:
        return max(1, planning.target)
    return safe_target(parse_bytes(budget), resident, 1 + KNOWN_ERROR, HEADROOM)


def predicted_figures(plans: Sequence[Plan]) -> Tuple[int, int]:
    """The largest predicted peak on the device (:attr:`Plan.device_peak`, the
    allocator's chunks counted) among a trace's plans, and the resident
    bytes of that plan."""
    highest = max(plans, key=lambda plan: plan.device_peak)
    return highest.device_peak, highest.resident_bytes


def recomputes_nothing(plans: Sequence[Plan]) -> bool:
    """Whether a trace's plans recompute nothing: no higher plan exists.

    >>> from memsaving.planners.planning import Plan
    >>> recomputes_nothing([Plan("budget", [], [], [], 100, 100, 1.0)])
    True
    """
    return all(plan.predicted_compute <= 1.0 and not plan.swapped for plan in plans)


def planned_target(plans: Sequence[Plan], target: int) -> int:
    """The target a trace's plans were made for: ``target``, or lower where
    the budget planner lowered it so that a plan's allocator chunks fit
    (:attr:`Plan.planned_for`).  The calibration climbs only to a target
    above it: the planner gives no higher plan for one at or below it."""
    return min([target] + [plan.planned_for for plan in plans if plan.planned_for is not None])


# ----------------------------------------------------------------------------- the record users see


@dataclass
class Calibration:
    """The record of a calibration (``step.calibration`` on :func:`fit_to_budget`'s
    result, :func:`memsaving.keras.calibration_of` for Keras).

    Attributes
    ----------
    budget : int
        the budget in bytes the measured peak must stay under.
    rounds : list of CalibrationRound
        every measured round, first to last: the calibrator's own list, so
        rounds measured after calibration (a step that crept, and the
        calibration it started) appear here as they are measured.
    chosen : int or None
        index in ``rounds`` of the round whose plan runs.
    plans : list of Plan
        the plans ``memsaving.gradients`` made when the returned step was
        traced (plans are immutable: the peak their step measured is this
        record's :attr:`measured_peak`, and :meth:`table` shows the two together).
    seconds : float
        wall time the calibration took (traces, plans and measured steps).
    """

    budget: int
    rounds: List[CalibrationRound] = field(default_factory=list)
    chosen: Optional[int] = None
    plans: List[Plan] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def _final(self) -> Optional[CalibrationRound]:
        if not self.rounds:
            return None
        return self.rounds[-1 if self.chosen is None else self.chosen]

    @property
    def fits(self) -> bool:
        """True when the chosen round fits the budget."""
        final = self._final
        return final is not None and not final.out_of_memory and final.measured_peak <= self.budget

    @property
    def measured_peak(self) -> Optional[int]:
        """The peak measured for the chosen round's step (None before any round)."""
        return self._final.measured_peak if self._final else None

    @property
    def predicted_peak(self) -> Optional[int]:
        """The chosen round's predicted peak (None before any round)."""
        return self._final.predicted_peak if self._final else None

    def table(self) -> str:
        """The tables of :attr:`plans` (:meth:`Plan.table`), each with the peak
        the chosen round measured for its step.

        Example
        -------
        >>> print(step.calibration.table())  # doctest: +SKIP
        memsaving plan (budget): 3 checkpoints, 4 recomputed segments
        predicted peak 40.1 MiB (plain tf.gradients 61.0 MiB, 1.52x lower), budget 48.0 MiB
        measured peak 41.3 MiB (budget 48.0 MiB)
        ...
        """
        return "\n".join(plan.table(self.measured_peak) for plan in self.plans)

    def __str__(self) -> str:
        lines = [f"memsaving calibration for a budget of {format_bytes(self.budget)}:"]
        lines += [f"  round {n}: {r.describe(self.budget)}" for n, r in enumerate(self.rounds, 1)]
        return "\n".join(lines)


def refusal(what: str, budget: int, predicted: int, resident: int, ratio: float,
            rounds: Sequence[CalibrationRound] = (), headroom: float = HEADROOM, how: str = "",
            otherwise: str = "") -> BudgetError:
    """The BudgetError of a plan that may not run: predicted over ``budget``
    (less ``headroom``), or under it by less than the error ``ratio`` says
    its step memory may be off by.  Its ``smallest_budget`` is the budget
    that plan may run under, with the slack every smallest budget has for
    the memory in use moving between traces (:func:`memsaving.errors.feasible_budget`).
    ``otherwise``: a last sentence, another way out for the route refused."""
    needed = feasible_budget(needed_budget(predicted, resident, ratio, headroom))
    known = (f"the model's known error ({KNOWN_ERROR:.0%} of the step's memory{', ' + how if how else ''})"
             if not rounds else f"the error measured so far (x{ratio:.2f} of the step's predicted memory)")
    ran = "Nothing was run." if not rounds else "Nothing was run beyond the rounds below."
    lines = [f"{what}: no plan fits the budget of {exact_bytes(budget)} with room for {known}: the lowest plan "
             f"found is predicted at {exact_bytes(predicted)}, {format_bytes(resident)} of it in use before the "
             f"step; the smallest feasible budget found is {exact_bytes(needed)} (the budget that plan may run "
             f"under). {ran}"]
    lines += [f"  round {n}: {r.describe(budget)}" for n, r in enumerate(rounds, 1)]
    lines.append("Raise the budget to at least that, or reduce the batch size." + (f" {otherwise}" if otherwise else ""))
    error = BudgetError.carrying("\n".join(lines), needed)
    error.calibration = Calibration(budget=budget, rounds=list(rounds))
    return error


def calibration_error(what: str, budget: int, calibrator: Calibrator) -> BudgetError:
    """A BudgetError listing every round; ``.smallest_budget`` is the lowest
    peak measured plus the room its spread needs (None when every round ran
    out of memory)."""
    rounds = calibrator.rounds
    lines = [f"{what}: {calibrator.reason}:"]
    lines += [f"  round {n}: {r.describe(budget)}" for n, r in enumerate(rounds, 1)]
    smallest = calibrator.smallest_measured_budget()
    if smallest is not None and calibrator.lowest_ran_out():
        lines.append(f"The smallest feasible budget is at least {exact_bytes(smallest)}: the lowest plan measured "
                     "ran out of memory under this budget, so it needs this budget plus the room a step keeps "
                     "free. Raise the budget to at least that, or reduce the batch size.")
    elif smallest is not None:
        lines.append(f"The smallest feasible budget is {exact_bytes(smallest)}: the lowest peak measured, plus "
                     "room for its run-to-run variation. Raise the budget to at least that, allow more rounds, or "
                     "reduce the batch size.")
    else:
        lines.append("Raise the budget or reduce the batch size.")
    error = BudgetError.carrying("\n".join(lines), smallest)
    error.calibration = Calibration(budget=budget, rounds=list(rounds))
    return error


# ----------------------------------------------------------------------------- fit_to_budget


def fit_to_budget(
    step_fn: Callable[..., Any],
    *args: Any,
    budget: Union[int, float, str],
    max_rounds: int = 4,
    device: Optional[str] = None,
    restore_variables: bool = False,
    verbose: bool = False,
    **kwargs: Any,
) -> "WatchedStep":
    """Trace ``step_fn`` so that its *measured* peak memory fits ``budget``, approached from below.

    The budget is the memory the device has: no step runs whose plan is
    predicted over it, and the first plan leaves room for the model's known
    error (:data:`memsaving.planners.known_error.KNOWN_ERROR` of the step's memory).

    1. trace ``tf.function(step_fn)`` with ``args`` / ``kwargs``, every
       ``memsaving.gradients(..., budget=...)`` in it planning for that room;
       run it once (warm-up), then :data:`MEASURED_STEPS` times under
       :func:`memsaving.measure_peak`; the highest peak counts;
    2. the ratio of the measured to the predicted step memory replaces the
       known error: when the peak is under the budget (less the allocator's
       headroom, :data:`memsaving.planners.known_error.HEADROOM`) and
       a higher plan is allowed, trace again for it; when it is over (or a
       run fails with an out-of-memory error: the variables are restored),
       trace again lower;
    3. stop when a measured plan uses 90% of the budget, no higher plan
       would differ, or the rounds run out; the highest plan measured under
       the budget (less the headroom) is returned.

    A budget whose lowest plan is predicted over it (or under it by less
    than the known error) is refused with ``BudgetError`` before any step
    runs.

    **Each round runs the step for real** (1 + :data:`MEASURED_STEPS`
    times): optimizer updates and other side effects happen.  Pass
    ``restore_variables=True`` to put every variable the step reads or
    writes back to its value from before calibration; the copies are held in
    host memory.  A round that runs out of memory restores them in any case,
    and so does a calibration that ends in a ``BudgetError``: a refused
    budget counts no step.

    **Probes.**  Where running out of memory raises (a GPU; the CPU only
    under ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` with ``TF_ENABLE_ONEDNN_OPTS=0``),
    a budget whose every plan the known error forbids, while the lowest
    plan is predicted under it less the headroom, is not refused at once:
    that plan is measured (:meth:`memsaving.calibration.Calibrator.may_probe`),
    kept if it fits, else refused with its steps undone.

    Parameters
    ----------
    step_fn
        the training step, a Python function (a ``tf.function`` is
        unwrapped). It must call ``memsaving.gradients(..., budget=...)``.
    *args, **kwargs
        the arguments of one step (a representative batch).
    budget
        bytes, or a string such as ``"512MiB"``: the allocator's whole peak
        (weights, optimizer slots, inputs included) must stay under it.
    max_rounds : int
        how many plans to measure at most.
    device : str, optional
        where to measure (default: the first GPU, else the CPU).
    restore_variables : bool
        undo the calibration's training steps (see above).
    verbose : bool
        print one line per round.

    Returns
    -------
    WatchedStep
        The traced ``tf.function``, ready for the training loop, called
        through a :class:`WatchedStep` that goes on measuring its steps
        against the budget (a step whose peak crept into the room the
        budget keeps free makes the next call calibrate again, lower).
        ``.calibration`` holds a :class:`Calibration`; each plan's
        ``measured_peak`` is set.

    Raises
    ------
    TypeError
        ``step_fn`` is not callable.
    ValueError
        a bad budget or ``max_rounds``, or a step that makes no
        ``memsaving.gradients(..., budget=...)`` call.
    memsaving.BudgetError
        no plan may run under the budget, or none measured under it; the
        message lists every round and gives ``.smallest_budget``.

    Examples
    --------
    >>> import memsaving, tensorflow as tf
    >>> w = tf.Variable(tf.random.normal([64, 64]))
    >>> x = tf.random.normal([256, 64])
    >>> def step(x):
    ...     h = x
    ...     for _ in range(8):
    ...         h = tf.tanh(h @ w)
    ...     loss = tf.reduce_sum(h * h)
    ...     (g,) = memsaving.gradients(loss, [w], budget="1GiB")
    ...     w.assign_sub(1e-3 * g)
    ...     return loss
    >>> fitted = memsaving.fit_to_budget(step, x, budget="1GiB")
    >>> fitted.calibration.fits
    True
    """
    return calibrate_step(step_fn, args, kwargs, budget=budget, max_rounds=max_rounds, device=device,
                          restore_variables=restore_variables, verbose=verbose)


def calibrate_step(step_fn: Callable[..., Any], args: tuple, kwargs: dict, *, budget: Union[int, float, str],
                   max_rounds: int = 4, device: Optional[str] = None, restore_variables: bool = False,
                   verbose: bool = False, caller: str = "memsaving.fit_to_budget") -> "WatchedStep":
    """:func:`fit_to_budget` for an entry point that calibrates on its
    user's behalf (``memsaving.function(budget=...)``): the same rule, with
    the step's arguments passed as a tuple and a dict (so no keyword of the
    step can collide with these), and ``caller`` naming the entry point in
    every message and error, as the user wrote it."""
    start = time.perf_counter()
    budget_bytes = _check_arguments(step_fn, budget, max_rounds, caller)
    python_fn = getattr(step_fn, "python_function", step_fn)  # a tf.function would not retrace
    calibrator = Calibrator(budget=budget_bytes, max_rounds=max_rounds, probes=out_of_memory_raises(device))
    report = Calibration(budget=budget_bytes, rounds=calibrator.rounds)
    gc.collect()
    calibrator.first_target(resident=bytes_in_use(device))
    function = _calibrate_or_undo(python_fn, args, kwargs, calibrator, report, device, verbose, restore_variables,
                                  caller)
    report.seconds = time.perf_counter() - start
    return WatchedStep(function, python_fn, calibrator, report, device, verbose, caller)


def _calibrate_or_undo(python_fn: Callable, args: tuple, kwargs: dict, calibrator: Calibrator,
                       report: "Calibration", device: Optional[str], verbose: bool, restore_variables: bool,
                       caller: str):
    """:func:`_calibrate`; the variables are put back as they were before its
    first round when ``restore_variables``, and whenever it ends in a
    ``BudgetError``: a budget refused after measured rounds (a probe that ran
    out of memory, a lowest plan measured over) counts no step, as Keras'
    calibration does."""
    snapshot: List[Optional[List[tuple]]] = [None]
    undo = restore_variables
    try:
        return _calibrate(python_fn, args, kwargs, calibrator, report, device, verbose, snapshot, caller)
    except BudgetError:
        undo = True
        raise
    finally:
        if undo and snapshot[0] is not None:
            restore_values(snapshot[0])


def _calibrate(python_fn: Callable, args: tuple, kwargs: dict, calibrator: Calibrator, report: "Calibration",
               device: Optional[str], verbose: bool, snapshot: List[Optional[List[tuple]]], caller: str):
    """Trace and measure rounds from ``calibrator.target`` until the rule
    (:meth:`Calibrator.record`) keeps a plan; returns that plan's traced
    function and records the rounds in ``report``.  ``snapshot[0]``: the
    variables' values before the first round that ran (set here); ``caller``:
    the entry point the messages name."""
    budget_bytes = calibrator.budget
    kept: dict = {}  # round index -> (step, plans) of the rounds that fit
    while True:
        round_number = len(calibrator.rounds) + 1
        step, plans = _traced(python_fn, calibrator.target, or_lowest=True)
        concrete = step.get_concrete_function(*args, **kwargs)
        _check_plans(plans, round_number, caller)
        predicted, resident = predicted_figures(plans)
        if not calibrator.may_run(predicted, resident):
            if calibrator.best is not None:
                break  # a higher plan may not run: keep the best measured
            retarget = safe_target(budget_bytes, resident, calibrator.ratio, HEADROOM)
            if predicted <= calibrator.target and retarget < calibrator.target:
                # planned for a target made with less memory in use than the step found: plan again
                calibrator.target = retarget
                continue
            probe = calibrator.may_probe(predicted, resident)
            if not probe:
                raise refusal(caller, budget_bytes, predicted, resident, calibrator.ratio,
                              calibrator.rounds)
        else:
            probe = False
        if snapshot[0] is None:
            snapshot[0] = snapshot_values(concrete.variables)
        current = replace(_measured_round(step, args, kwargs, planned_target(plans, calibrator.target), predicted,
                                          resident, budget_bytes, device, snapshot[0],
                                          room=calibrator.room_to_hold(resident)),
                          highest=recomputes_nothing(plans), asked_for=calibrator.target, probe=probe)
        decision = calibrator.record(current)
        _say(verbose, f"{caller}: round {round_number}: "
                      f"{calibrator.rounds[-1].describe(budget_bytes)}")
        if calibrator.rounds[-1].fits(budget_bytes):  # with the widest spread seen
            kept[len(calibrator.rounds) - 1] = (step, plans)
        step = concrete = None
        if decision is Next.RETRACE:
            gc.collect()  # this round's step, unless kept: its constants must not count next
            continue
        if decision is Next.FAIL:
            raise calibration_error(caller, budget_bytes, calibrator)
        break
    best_step, report.plans = kept[calibrator.best]
    report.chosen = calibrator.best
    return best_step


class WatchedStep:
    """What :func:`fit_to_budget` returns: its calibrated ``tf.function``,
    called as it is, whose later steps are measured against the budget.

    A round measures a few steps, and the allocator's chunks go on moving
    after them: the chosen plan's peak can creep up (keras.applications'
    EfficientNetB0, calibrated at an 86 MiB cap, ran out of memory at its
    12th step with 83.3 MiB in use).  Each call resets the device's peak
    and reads it after the step (two calls into the allocator's
    statistics); a step whose peak leaves less than the chosen round's room
    under the budget (:meth:`memsaving.calibration.Calibrator.steady_step`)
    makes the next call calibrate again, from a lower plan, on its own
    batch (rounds run real steps, as the first calibration did).

    **Out of memory after calibration.**  Until the step's peak has stopped
    rising (:data:`memsaving.calibration.STEADY_CALLS` calls in a row at or under the highest
    seen since the last calibration), each call first copies the variables
    the step reads or writes to host memory, and, where running out of
    memory raises (:attr:`memsaving.calibration.Calibrator.probes`), holds
    the room the chosen round left (:func:`held_room`), as the rounds did.
    A call that then fails with ``ResourceExhaustedError`` (a step may have
    applied part of its updates when it failed) puts the variables back,
    judges the plan out of memory, calibrates again lower on the same batch
    and runs it: training goes on with nothing half applied.  On the
    planner's lowest plan it raises ``BudgetError`` instead, the variables
    as they were before the call.  Once the peak is steady the copies stop
    and the room is the step's to use (there, only a peak over the budget
    itself sends the plan lower), and an out-of-memory error propagates as
    TensorFlow raised it.

    ``calibration`` is the :class:`Calibration` record; any other attribute
    (``get_concrete_function``, ``python_function``...) is the current
    ``tf.function``'s.

    Examples
    --------
    >>> import memsaving, tensorflow as tf
    >>> w = tf.Variable(tf.ones([8, 8]))
    >>> def step(x):
    ...     loss = tf.reduce_sum(tf.tanh(x @ w))
    ...     (g,) = memsaving.gradients(loss, [w], budget="1GiB")
    ...     w.assign_sub(1e-3 * g)
    ...     return loss
    >>> fitted = memsaving.fit_to_budget(step, tf.ones([4, 8]), budget="1GiB")
    >>> float(fitted(tf.ones([4, 8]))) > 0, fitted.calibration.fits
    (True, True)
    """

    def __init__(self, function: Any, python_fn: Callable, calibrator: Calibrator, report: "Calibration",
                 device: Optional[str], verbose: bool, caller: str = "memsaving.fit_to_budget"):
        self.function = function
        self._caller = caller
        self.calibration = report
        self._python_fn = python_fn
        self._calibrator = calibrator
        self._device = device
        self._verbose = verbose
        self._again = False  # the next call calibrates again first
        self._watching = True
        self._rise = PeakRise()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["function"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._again:
            self._again = False
            self._calibrate_again(args, kwargs)
        if not self._watching:
            return self.function(*args, **kwargs)
        try:
            reset_peak(self._device or default_device())
        except PeakMemoryUnavailableError:
            self._watching = False
            return self.function(*args, **kwargs)
        steady = self._rise.steady()
        snapshot = None if steady else snapshot_values(self._variables(args, kwargs))
        room = 0 if steady else self._calibrator.steady_room_to_hold()
        try:
            with held_room(room, self._device) as held:
                result = self.function(*args, **kwargs)
                measured = peak_bytes(self._device) - held
        except tf.errors.ResourceExhaustedError:
            if snapshot is None:
                raise
            restore_values(snapshot)
            return self._after_out_of_memory(args, kwargs)
        self._rise.add(measured)
        self._watch(measured, settled=steady)
        return result

    def _variables(self, args: tuple, kwargs: dict) -> list:
        """The variables the current function reads or writes for these arguments (its trace's)."""
        return list(self.function.get_concrete_function(*args, **kwargs).variables)

    def _calibrate_again(self, args: tuple, kwargs: dict) -> None:
        self.function = _calibrate_or_undo(self._python_fn, args, kwargs, self._calibrator, self.calibration,
                                           self._device, self._verbose, restore_variables=False,
                                           caller=self._caller)
        self._rise = PeakRise()

    def _after_out_of_memory(self, args: tuple, kwargs: dict) -> Any:
        """A call failed with an out-of-memory error, its variables already put
        back: judge the plan, calibrate lower on this batch and run it again."""
        calibrator = self._calibrator
        decision = calibrator.steady_step(calibrator.budget, out_of_memory=True)
        self.calibration.chosen = None
        if decision is Next.FAIL:
            raise calibration_error(self._caller, calibrator.budget, calibrator)
        _say(self._verbose, f"{self._caller}: {calibrator.describe_steady(0, out_of_memory=True)}; the "
                            f"variables are back as before the step, which is traced again from "
                            f"{format_bytes(calibrator.target)}")
        self._calibrate_again(args, kwargs)
        return self(*args, **kwargs)

    def _watch(self, measured: int, settled: bool) -> None:
        calibrator = self._calibrator
        decision = calibrator.steady_step(measured, settled=settled)
        if decision is Next.DONE:
            return
        self.calibration.chosen = None
        _say(self._verbose, f"{self._caller}: {calibrator.describe_steady(measured)}; the next step "
                            f"calibrates again from {format_bytes(calibrator.target)}")
        self._again = True


def _measured_round(step, args, kwargs, target: int, predicted: int, resident: int, budget: int,
                    device: Optional[str], snapshot: List[tuple], room: int = 0) -> CalibrationRound:
    """Run the step once (warm-up) and :data:`MEASURED_STEPS` times measured; a
    run that runs out of memory ends the round, and the variables are put
    back as they were before it.

    ``room``: bytes held on the device while the step runs (:func:`held_room`),
    so that under the device's limit a step that would not leave that room
    free runs out of memory; the peaks read exclude them."""
    before = snapshot_values(v for v, _ in snapshot)
    try:
        with held_room(room, device) as held:
            step(*args, **kwargs)  # the first run of a graph allocates once-only buffers
            peaks = [measure_peak(step, *args, device=device, **kwargs) - held for _ in range(MEASURED_STEPS)]
    except tf.errors.ResourceExhaustedError:
        restore_values(before)
        # the device's limit is the budget: the step needed at least that
        return CalibrationRound(target, predicted, budget, 0, resident, out_of_memory=True)
    return CalibrationRound.from_peaks(target, predicted, peaks, resident)


@contextlib.contextmanager
def held_room(nbytes: int, device: Optional[str] = None) -> Iterator[int]:
    """Hold ``nbytes`` on ``device`` (one buffer) while the block runs; yields
    the bytes the allocator counts for it (its chunk), 0 when ``nbytes`` is 0.

    Why: the allocator's peak *bytes in use* is no measure of what a step
    needs when the device's limit is near.  TensorFlow's BFC allocator hands
    a request a free chunk of up to twice its size whole, so in a pool that
    is the budget (a GPU's, or the CPU's under ``TF_CPU_BFC_MEM_LIMIT_IN_MB``)
    a step's peak reads close to the limit whenever a large request comes
    when little is free: Eigen's 24.5 MiB convolution work buffer took the
    last 42 MiB of a 60 MiB pool whole, and a residual conv net measured
    44.6 MiB without a cap read 59.0 under it.  Where running out of memory
    raises, a calibration instead measures with the room a plan must leave
    held: a step that runs leaves it free, whatever its peak reads, and one
    that does not runs out of memory (and is undone).

    Examples
    --------
    >>> import tensorflow as tf
    >>> with held_room(4 << 20, "CPU:0") as held:
    ...     held >= 4 << 20
    True
    """
    if nbytes <= 0:
        yield 0
        return
    device = device or default_device()
    before = bytes_in_use(device)
    with tf.device(device):
        ballast = tf.zeros([nbytes], tf.uint8)
    held = max(bytes_in_use(device) - before, 0)
    try:
        yield held
    finally:
        del ballast


def snapshot_values(variables: Iterable[tf.Variable]) -> List[Tuple[tf.Variable, np.ndarray]]:
    """Each variable with a host copy of its value, for :func:`restore_values`."""
    return [(variable, np.array(variable.numpy(), copy=True)) for variable in variables]


def restore_values(snapshot: Iterable[Tuple[tf.Variable, np.ndarray]]) -> None:
    """Put back the values :func:`snapshot_values` copied (:func:`restore_variable`)."""
    for variable, value in snapshot:
        restore_variable(variable, value)


def restore_variable(variable: tf.Variable, value: np.ndarray) -> None:
    """Put ``value`` back into ``variable``, in the buffer it already has when that is exact.

    ``assign`` makes the variable adopt a new buffer: a new allocator chunk,
    which the allocator may count larger or smaller than the old one, or the
    host array itself when TensorFlow wraps it without copying.  Either way
    the memory in use after calibration would not be the memory calibration
    measured with.  Two in-place additions keep the buffer: adding the
    negated current value gives exactly zero, and adding ``value`` to zero
    gives exactly ``value``.  That holds for finite floats, so other dtypes,
    non-finite current values and negative zeros in ``value`` (zero plus -0.0
    is +0.0) are assigned instead.  A buffer shared with a live tensor is
    copied by the addition too, as it would be by any update.
    """
    dtype = tf.as_dtype(variable.dtype)
    if dtype.is_floating and not np.any(np.signbit(value) & (value == 0)):
        current = np.array(variable.numpy(), copy=True)
        if np.all(np.isfinite(current)):
            variable.assign_add(-current)
            variable.assign_add(value)
            return
    variable.assign(value)


def _check_arguments(step_fn, budget, max_rounds, caller: str) -> int:
    if not callable(step_fn):
        raise TypeError(
            f"{caller}: step_fn must be the training step, a Python function that calls "
            f"memsaving.gradients(..., budget=...); got {type(step_fn).__name__}: {step_fn!r:.80}")
    if budget is None:
        raise ValueError(f"{caller} needs budget= (bytes, or a string such as '512MiB'): the "
                         "peak memory the step must fit, as measured")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, (int, np.integer)) or max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r}: give a positive int, how many plans to measure at most")
    return parse_bytes(budget)


def _traced(python_fn: Callable, target: Optional[int], or_lowest: bool = False):
    """A new ``tf.function`` of ``python_fn`` that plans for ``target`` (and
    ``or_lowest``, see :func:`planning_target`) whenever it is traced.

    The target is entered inside the traced function, so a retrace for new
    input shapes after calibration plans for it too.  Returns the function
    and the list its traces' plans are appended to.
    """
    plans: List[Plan] = []

    @functools.wraps(python_fn)
    def with_target(*args, **kwargs):
        with planning_target(target, or_lowest) as record:
            try:
                return python_fn(*args, **kwargs)
            finally:
                plans.extend(record.plans)

    return tf.function(with_target), plans


def _check_plans(plans: List[Plan], round_number: int, caller: str) -> None:
    if any(plan.budget is not None for plan in plans):
        return
    if not plans and round_number > 1:
        raise ValueError(
            f"{caller}: the step's memsaving.gradients call was not traced again in round "
            f"{round_number}, so it cannot be replanned: it is probably inside a tf.function of its own. "
            "Pass the plain Python function (no @tf.function inside the step around memsaving.gradients).")
    made = f"made {len(plans)} memsaving.gradients call(s), none with budget=" if plans else \
        "made no memsaving.gradients call"
    raise ValueError(
        f"{caller}: the step {made}. The step must call memsaving.gradients(..., budget=...) "
        "(with the budget passed here) so that it can be replanned for the measured peak.")


def _say(verbose: bool, line: str) -> None:
    logger.info(line)
    if verbose:
        print(line)

