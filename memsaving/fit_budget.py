"""Make a budget hold as *measured*, not only as predicted.

The planner sizes a plan with a simulator, and the allocator's real peak runs
above the prediction: kernel temporaries, the executor's order, Grappler's
rewrites and everything else living on the device are not in the model.
:func:`fit_to_budget` closes the loop: it runs the training step, measures
its peak with :func:`memsaving.measure_peak`, and when the peak is above the
budget it replans with the measured excess taken off the budget, until the
measured peak fits or the rounds run out.

The planner learns the excess through a *margin* that this module keeps in a
context variable while a step is traced: ``memsaving.gradients`` plans for
``budget - margin`` (:func:`planning_budget`, read where the budget is parsed
for planning) and hands every plan it makes to :func:`record_plan`, so the
caller sees the plans of the step it traced without the step returning them.
``memsaving.keras.enable(model, budget=...)`` uses the same margin for its
own calibration during ``fit``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from memsaving.planners.budget import exact_bytes, format_bytes, parse_bytes
from memsaving.errors import BudgetError
from memsaving.tf.measure import bytes_in_use, measure_peak
from memsaving.planners.planning import Plan

logger = logging.getLogger("memsaving")

MEASURED_STEPS = 4
"""Steps measured per plan, after the warm-up; the highest peak counts. The
peak of one traced step moves by a few tensors from one run to the next
(TensorFlow's executor orders ready ops partly by their measured cost, and
the allocator's choice of free chunk follows that order), and often only
one run in three or four reaches the high end: two runs alone missed it
for steps that then measured above their budget when run again."""

LOWEST_MEASURED_STEPS = 6
"""Steps :func:`fit_to_budget` measures of the planner's lowest plan when
that plan may be the last one it can try: its highest peak is the
``smallest_budget`` a BudgetError reports, a figure the same plan must
meet when it is measured again, so it is taken over more runs."""

SLACK = 0.02
"""Fraction of the budget added to each measured excess: the next plan aims a
little lower than the excess alone, so a peak that moves by a few kilobytes
from one trace to the next does not cost another round."""

TRACES_AHEAD = 2
"""Traces a calibration called again makes before it measures the lowest plan
(at most: the plan for the budget, then the lowest one).  A step whose every
trace leaves memory on the device (a model that caches tensors per trace)
measures that much higher each time; a BudgetError's ``smallest_budget``
allows for this many more traces' worth."""

HEADROOM = 0.02
"""Fraction of the budget :func:`fit_to_budget` wants a round's measured peak
to stay under before it stops.  The same step measured again later, after
other work has changed what the allocator holds, can measure a little higher
than in its calibration rounds.  A round that fits only within the headroom
is kept, and returned when no later round fits with room.  A step whose
measured runs differ by more than the headroom is given that spread instead
(:func:`room_needed`)."""


def room_needed(figure: int, spread: int, fraction: float = HEADROOM) -> int:
    """Room for a step's run-to-run variation beside ``figure`` (bytes):
    ``fraction`` of it, or ``spread``, the highest less the lowest peak its
    measured runs gave, when that is larger.

    A step whose peak moved by ``spread`` between runs of one trace can move
    as much again in the runs that follow; a fixed fraction covers only
    steps that repeat to within it.  :func:`fit_to_budget` wants a round's
    peak this far under the budget (:data:`HEADROOM` of it), and
    :func:`smallest_measured_budget` adds it to the lowest peak
    (:data:`SLACK` of it).

    Examples
    --------
    >>> room_needed(1000, 5)    # repeats: 2% of the budget
    20
    >>> room_needed(1000, 50)   # moved by 50 between runs
    50
    """
    return max(int(math.ceil(fraction * figure)), spread)


@dataclass
class _Margin:
    """What one traced step sees: the margin, and the plans made under it."""

    margin: int
    or_lowest: bool = False
    plans: List[Plan] = field(default_factory=list)


_ACTIVE: contextvars.ContextVar[Optional[_Margin]] = contextvars.ContextVar("memsaving_budget_margin",
                                                                             default=None)


@contextlib.contextmanager
def budget_margin(margin: int, or_lowest: bool = False) -> Iterator[_Margin]:
    """While active, ``memsaving.gradients(..., budget=B)`` plans for ``B - margin``.

    With ``or_lowest``, when no plan fits ``B - margin`` as predicted the
    planner returns the lowest plan it finds instead of raising
    ``BudgetError`` (:func:`planning_or_lowest`): a calibration measures
    that plan, which may fit as measured what it does not as predicted.

    Yields the record that collects every plan ``memsaving.gradients`` makes
    inside (the calls happen when a ``tf.function`` is traced, so enter this
    around the trace, not around later calls of the traced function).
    """
    record = _Margin(int(margin), bool(or_lowest))
    token = _ACTIVE.set(record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def planning_budget(budget: Optional[Union[int, float, str]]) -> Optional[Union[int, float, str]]:
    """The budget the planner should plan for: ``budget`` minus the active margin.

    ``budget`` itself when no margin is active or no budget was given (so
    plans made outside a calibration are unchanged).  Never below one byte:
    a margin larger than the budget leaves a budget nothing fits, and the
    planner then says so with a ``BudgetError``.
    """
    record = _ACTIVE.get()
    if budget is None or record is None or not record.margin:
        return budget
    return max(1, parse_bytes(budget) - record.margin)


def planning_or_lowest() -> bool:
    """True when the active calibration wants the planner's lowest plan for a budget nothing fits."""
    record = _ACTIVE.get()
    return record is not None and record.or_lowest


def record_plan(plan: Plan) -> None:
    """Hand a plan ``memsaving.gradients`` executes to the active calibration, if any."""
    record = _ACTIVE.get()
    if record is not None:
        record.plans.append(plan)


def is_lowest_plan(planned_for: int, predicted: int) -> bool:
    """True when a plan is predicted above the budget it was planned for: no
    plan fitted it, and the planner gave its lowest plan (``or_lowest``).
    That plan does not depend on the budget, so no lower budget gives a
    lower plan."""
    return predicted > planned_for


def nothing_lower_to_try(rounds: Sequence[CalibrationRound], planned_for: int, predicted: int,
                         resident: int = 0) -> bool:
    """True when a new trace got the planner's lowest plan and it is predicted
    no lower than the last plan measured: measuring it cannot help.

    The plans are compared above their resident bytes (``resident``, and the
    last round's): a trace counts what the device holds when it is traced as
    resident, so when the step leaves memory on the device at each trace, a
    lower plan can be predicted at the same peak as the last one.
    """
    if not rounds or not is_lowest_plan(planned_for, predicted):
        return False
    return predicted - resident >= rounds[-1].predicted_peak - rounds[-1].resident


def predicted_figures(plans: Sequence[Plan]) -> Tuple[int, int]:
    """The largest predicted peak among a trace's plans, and the resident bytes of that plan."""
    highest = max(plans, key=lambda plan: plan.predicted_peak)
    return highest.predicted_peak, highest.resident_bytes


@dataclass(frozen=True)
class CalibrationRound:
    """One measured step: what was planned for, predicted and measured (bytes)."""

    planned_for: int
    """The budget the planner planned for: the budget minus the margin."""
    predicted_peak: int
    """The largest predicted peak among the step's plans."""
    measured_peak: int
    """The allocator's peak during the step (everything on the device); the
    highest of the round's measured runs."""
    spread: int = 0
    """The highest less the lowest peak of the round's measured runs."""
    resident: int = 0
    """The resident bytes of the plan predicted highest: variables, constants,
    and what the device held when the step was traced."""

    @classmethod
    def from_peaks(cls, planned_for: int, predicted_peak: int, peaks: Sequence[int],
                   resident: int = 0) -> "CalibrationRound":
        """The round whose measured runs gave ``peaks``."""
        return cls(planned_for, predicted_peak, max(peaks), max(peaks) - min(peaks), resident)

    @property
    def lowest(self) -> bool:
        """The round measured the planner's lowest plan (:func:`is_lowest_plan`)."""
        return is_lowest_plan(self.planned_for, self.predicted_peak)

    def describe(self, budget: int) -> str:
        verdict = "fits" if self.measured_peak <= budget else "over"
        planned = (f"no plan predicted under {format_bytes(self.planned_for)}: the lowest plan" if self.lowest
                   else f"planned for {format_bytes(self.planned_for)}")
        return (f"{planned}, predicted {format_bytes(self.predicted_peak)}, "
                f"measured {format_bytes(self.measured_peak)} ({verdict})")


@dataclass
class Calibration:
    """The record of :func:`fit_to_budget` (also ``step.calibration`` on its result).

    Attributes
    ----------
    budget : int
        the budget in bytes the measured peak must stay under.
    rounds : list of CalibrationRound
        every measured round, first to last.
    margin : int
        bytes taken off the budget when the returned step was planned.
    plans : list of Plan
        the plans ``memsaving.gradients`` made when the returned step was
        traced (one per call; more if it is traced again for new shapes);
        their ``measured_peak`` is set.
    """

    budget: int
    rounds: List[CalibrationRound] = field(default_factory=list)
    margin: int = 0
    plans: List[Plan] = field(default_factory=list)

    chosen: Optional[int] = None
    """Index in ``rounds`` of the round whose step was returned, when it is
    not the last (:func:`fit_to_budget` fell back to an earlier round)."""

    held_per_trace: int = 0
    """Bytes the device held more after a failed :func:`fit_to_budget` than
    before it, per trace of the step (0 when nothing more, or not measured):
    a BudgetError's ``smallest_budget`` allows for more traces' worth."""

    @property
    def _final(self) -> Optional[CalibrationRound]:
        if not self.rounds:
            return None
        return self.rounds[-1 if self.chosen is None else self.chosen]

    @property
    def fits(self) -> bool:
        """True when the returned (by default the last) round fits the budget."""
        return self._final is not None and self._final.measured_peak <= self.budget

    @property
    def measured_peak(self) -> Optional[int]:
        return self._final.measured_peak if self._final else None

    @property
    def predicted_peak(self) -> Optional[int]:
        return self._final.predicted_peak if self._final else None

    def __str__(self) -> str:
        lines = [f"memsaving calibration for a budget of {format_bytes(self.budget)}:"]
        lines += [f"  round {n}: {r.describe(self.budget)}" for n, r in enumerate(self.rounds, 1)]
        return "\n".join(lines)


def next_margin(margin: int, measured: int, budget: int, predicted: int) -> int:
    """The margin for the next round: the measured excess, plus :data:`SLACK`, added on.

    At least enough to plan below ``predicted``, the predicted peak of the
    plan just measured: that plan fits any budget above it, so the planner
    would return it again and the round would measure the same plan twice.
    """
    return max(margin + (measured - budget) + int(math.ceil(SLACK * budget)), budget - predicted + 1)


def smallest_measured_budget(rounds: Sequence[CalibrationRound], held_per_trace: int = 0) -> Optional[int]:
    """A budget some measured plan fits: the lowest measured peak plus :data:`SLACK` of it
    (or, when larger, the spread of that round's runs), plus :data:`TRACES_AHEAD` times
    ``held_per_trace``.

    The lowest peak alone is one sample of a figure that moves from run to
    run; a budget equal to it is met about half the time when the same plan
    is measured again, and a plan whose runs moved by more than 2% can move
    that much again.  ``held_per_trace``: the bytes each trace of
    the step left on the device, which a calibration at this budget will
    trace again.  None when nothing was measured.
    """
    if not rounds:
        return None
    lowest = min(rounds, key=lambda r: r.measured_peak)
    room = room_needed(lowest.measured_peak, lowest.spread, SLACK)
    return lowest.measured_peak + room + TRACES_AHEAD * max(0, int(held_per_trace))


def calibration_error(what: str, budget: int, rounds: Sequence[CalibrationRound], reason: str,
                      calibration: Optional[Calibration] = None) -> BudgetError:
    """A BudgetError listing every round; ``.smallest_budget`` is :func:`smallest_measured_budget`.

    Used by :func:`fit_to_budget` and by ``memsaving.keras``' calibration.

    That budget (None when nothing was measured) is stored with the error.
    ``calibration``, when given, is attached as ``error.calibration``.
    """
    lines = [f"{what}: {reason}"]
    lines += [f"  round {n}: {r.describe(budget)}" for n, r in enumerate(rounds, 1)]
    held_per_trace = calibration.held_per_trace if calibration is not None else 0
    smallest = smallest_measured_budget(rounds, held_per_trace)
    if smallest is not None:
        best = min(range(len(rounds)), key=lambda n: rounds[n].measured_peak)
        held = (f", and {TRACES_AHEAD} x {format_bytes(held_per_trace)}: the device held that much more per "
                "trace of the step after calibration than before it (tensors kept by the model or by "
                "TensorFlow's caches), and a calibration traces the step again" if held_per_trace > 0 else "")
        lines.append(f"The smallest budget to ask for is {exact_bytes(smallest)}: the lowest "
                     f"peak measured, {format_bytes(rounds[best].measured_peak)} in round {best + 1}, plus "
                     f"{SLACK:.0%} for the run-to-run variation of a step's peak{held}. Raise the budget to at "
                     "least that, allow more rounds, or reduce the batch size.")
    else:
        lines.append("Raise the budget or reduce the batch size.")
    error = BudgetError.carrying("\n".join(lines), smallest)
    error.calibration = calibration
    return error


def fit_to_budget(
    step_fn: Callable[..., Any],
    *args: Any,
    budget: Union[int, float, str],
    max_rounds: int = 4,
    device: Optional[str] = None,
    restore_variables: bool = False,
    verbose: bool = False,
    **kwargs: Any,
) -> tf.types.experimental.PolymorphicFunction:
    """Trace ``step_fn`` so that its *measured* peak memory fits ``budget``.

    The planner inside ``memsaving.gradients(..., budget=B)`` meets ``B`` as
    predicted by its simulator; the allocator's real peak is usually higher.
    This function measures it and replans until it fits:

    1. trace ``tf.function(step_fn)`` with ``args`` / ``kwargs``, run it once
       (warm-up), then :data:`MEASURED_STEPS` times under
       :func:`memsaving.measure_peak`; the highest peak counts (a step's peak moves by a few tensors from one
       run to the next);
    2. if the measured peak is above ``budget`` less a 2% headroom (a step
       measured again later can read a little higher; when the measured
       runs differ by more than 2%, less that spread: :func:`room_needed`),
       add the excess (plus 2% of the budget, and at least enough to plan
       below the plan just measured) to a *margin*, and trace again: every
       ``memsaving.gradients(..., budget=B)`` in the step now plans for
       ``B - margin``, or, when no plan fits that as predicted, takes the
       planner's lowest plan (measured only if it is predicted below the
       last plan measured);
    3. stop when the measured peak fits with that room.  When the rounds
       run out, or the lowest plan measures over the budget (no budget gives
       a lower plan), return the lowest round that fits the budget itself,
       if any; else raise.

    A budget that no plan meets even as predicted is not refused outright:
    the first round measures the planner's lowest plan.  Predictions err
    both ways, so it may fit; when it does not, the ``BudgetError`` gives
    its measured peak (the highest of :data:`LOWEST_MEASURED_STEPS` runs), and its
    ``smallest_budget`` is a figure measured, not predicted.

    **Every round runs the step five times for real** (seven when it
    measures the lowest plan, which ends calibration): optimizer updates
    and other side effects happen (5 to ``5 * max_rounds + 2`` training
    steps on the data given).  Pass ``restore_variables=True`` to put every
    variable the step reads or writes (weights, optimizer slots and
    counters, random generator states) back to its value from before
    calibration; the copies are held in host memory, outside TensorFlow's
    allocator. Iterators and other non-variable state are not restored.

    The budget is compared with the allocator's whole peak during the step
    (:func:`memsaving.measure_peak`): weights, optimizer slots, inputs and
    anything else alive on the device count, as they do when the device runs
    out of memory.

    Parameters
    ----------
    step_fn
        the training step, a Python function (a ``tf.function`` is
        unwrapped). It must call ``memsaving.gradients(..., budget=...)``,
        normally with this same budget; the margin applies to every
        budgeted call in it.
    *args, **kwargs
        the arguments of one step (a representative batch).
        The names ``budget``, ``max_rounds``, ``device``,
        ``restore_variables`` and ``verbose`` are this function's own.
    budget
        bytes, or a string such as ``"512MiB"``.
    max_rounds : int
        how many plans to measure at most (each costs a trace and
        three steps, five for the lowest plan).
    device : str, optional
        where to measure (default: the first GPU, else the CPU).
    restore_variables : bool
        undo the calibration's training steps (see above).
    verbose : bool
        print one line per round.

    Returns
    -------
    tf.types.experimental.PolymorphicFunction
        The traced ``tf.function``, ready for the training loop. Retraces (new
        input shapes) plan with the same margin. ``.calibration`` holds a
        :class:`Calibration` (rounds, margin, plans); each plan's
        ``measured_peak`` is set, so ``plan.explain()`` shows both peaks.

    Raises
    ------
    TypeError
        ``step_fn`` is not callable.
    ValueError
        a bad budget or ``max_rounds``, or a step that makes no
        ``memsaving.gradients(..., budget=...)`` call.
    memsaving.BudgetError
        the measured peak is still above ``budget``
        after ``max_rounds`` rounds, or the planner's lowest plan measures
        above it; the message lists every round, and
        ``.smallest_budget`` is the lowest peak measured plus 2%, or plus
        the spread of that round's runs when larger (a budget that round's
        plan fits, with room for the peak's run-to-run variation), plus
        twice what each trace of the step left on the device, if anything
        (:func:`smallest_measured_budget`);
        ``.calibration`` holds the rounds.
    """
    target = _check_arguments(step_fn, budget, max_rounds)
    python_fn = getattr(step_fn, "python_function", step_fn)  # a tf.function would not retrace
    report = Calibration(budget=target)
    snapshot: Optional[List[tuple]] = None
    fallback: Optional[_Fitting] = None  # the lowest round that fits only without room
    gc.collect()
    in_use_at_start, traces = bytes_in_use(device), 0
    try:
        for round_number in range(1, max_rounds + 1):
            step, plans = _traced(python_fn, report.margin, or_lowest=True)
            concrete = step.get_concrete_function(*args, **kwargs)
            traces += 1
            _check_plans(plans, round_number)
            planned_for = planning_budget_for(target, report.margin)
            predicted, resident = predicted_figures(plans)
            if nothing_lower_to_try(report.rounds, planned_for, predicted, resident):
                break
            if restore_variables and snapshot is None:
                snapshot = [(v, np.array(v.numpy(), copy=True)) for v in concrete.variables]
            step(*args, **kwargs)  # warm-up: the first run of a graph allocates once-only buffers
            steps = LOWEST_MEASURED_STEPS if is_lowest_plan(planned_for, predicted) else MEASURED_STEPS
            peaks = [measure_peak(step, *args, device=device, **kwargs) for _ in range(steps)]
            current = CalibrationRound.from_peaks(planned_for, predicted, peaks, resident)
            measured, room = current.measured_peak, room_needed(target, current.spread)
            report.rounds.append(current)
            for plan in plans:
                plan.measured_peak = measured
            _say(verbose, f"memsaving.fit_to_budget: round {round_number}: {current.describe(target)}")
            if measured <= target - room:
                report.plans = plans
                step.calibration = report
                return step
            if measured <= target and (fallback is None or measured < report.rounds[fallback.index].measured_peak):
                fallback = _Fitting(len(report.rounds) - 1, step, plans, report.margin)
            if current.lowest:
                break  # no budget gives a lower plan than the planner's lowest
            # aim below the budget less the room
            report.margin = next_margin(report.margin, measured + room, target, current.predicted_peak)
            step = concrete = None
            gc.collect()  # this round's step, unless kept as the fallback: its constants must not count next
        # The last step too: an error's traceback keeps this frame, and what the step holds would
        # count in the plans of a fit_to_budget called again while the error is alive.
        step = concrete = None
        gc.collect()
        if fallback is not None:
            _say(verbose, f"memsaving.fit_to_budget: returning round {fallback.index + 1}, which fits the budget "
                          f"without the room a later run may need ({HEADROOM:.0%} of the budget, or the spread of its "
                          "measured runs)")
            report.chosen, report.plans, report.margin = fallback.index, fallback.plans, fallback.margin
            fallback.step.calibration = report
            return fallback.step
        report.held_per_trace = max(0, bytes_in_use(device) - in_use_at_start) // traces
        raise calibration_error("memsaving.fit_to_budget", target, report.rounds,
                                why_nothing_fits(target, report.rounds, max_rounds), report)
    finally:
        if snapshot is not None:
            for variable, value in snapshot:
                restore_variable(variable, value)


def why_nothing_fits(budget: int, rounds: Sequence[CalibrationRound], max_rounds: int) -> str:
    """Why a calibration found nothing that fits ``budget`` as measured, for its BudgetError
    (also used by ``memsaving.keras``; its own message says when its rounds ran out)."""
    if rounds and rounds[0].lowest:
        return (f"no plan fits the budget of {exact_bytes(budget)} even as predicted, and the lowest plan "
                "the planner finds measures above it:")
    if rounds and rounds[-1].lowest:
        return ("to leave room for the measured excess the planner must plan below its lowest plan, "
                "which measures above the budget. Measured so far:")
    if len(rounds) < max_rounds:
        return ("to leave room for the measured excess the planner must plan lower, and its lowest plan "
                "is no lower than the last one measured. Measured so far:")
    return (f"the step's measured peak stays above the budget of {exact_bytes(budget)} after "
            f"{max_rounds} round(s) (max_rounds={max_rounds}):")


@dataclass(frozen=True)
class _Fitting:
    """A measured round that fits the budget, and what to return it with."""

    index: int
    step: Any
    plans: List[Plan]
    margin: int


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


def planning_budget_for(budget: int, margin: int) -> int:
    """``budget - margin`` as :func:`planning_budget` computes it (at least one byte)."""
    return max(1, budget - margin) if margin else budget


def _check_arguments(step_fn, budget, max_rounds) -> int:
    if not callable(step_fn):
        raise TypeError(
            f"memsaving.fit_to_budget: step_fn must be the training step, a Python function that calls "
            f"memsaving.gradients(..., budget=...); got {type(step_fn).__name__}: {step_fn!r:.80}")
    if budget is None:
        raise ValueError("memsaving.fit_to_budget needs budget= (bytes, or a string such as '512MiB'): the "
                         "peak memory the step must fit, as measured")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, (int, np.integer)) or max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r}: give a positive int, how many plans to measure at most")
    return parse_bytes(budget)


def _traced(python_fn: Callable, margin: int, or_lowest: bool = False):
    """A new ``tf.function`` of ``python_fn`` that plans with ``margin`` (and
    ``or_lowest``, see :func:`budget_margin`) whenever it is traced.

    The margin is entered inside the traced function, so a retrace for new
    input shapes after calibration plans with it too.  Returns the function
    and the list its traces' plans are appended to.
    """
    plans: List[Plan] = []

    @functools.wraps(python_fn)
    def with_margin(*args, **kwargs):
        with budget_margin(margin, or_lowest) as record:
            try:
                return python_fn(*args, **kwargs)
            finally:
                plans.extend(record.plans)

    return tf.function(with_margin), plans


def _check_plans(plans: List[Plan], round_number: int) -> None:
    if any(plan.budget is not None for plan in plans):
        return
    if not plans and round_number > 1:
        raise ValueError(
            "memsaving.fit_to_budget: the step's memsaving.gradients call was not traced again in round "
            f"{round_number}, so it cannot be replanned: it is probably inside a tf.function of its own. "
            "Pass the plain Python function (no @tf.function inside the step around memsaving.gradients).")
    made = f"made {len(plans)} memsaving.gradients call(s), none with budget=" if plans else \
        "made no memsaving.gradients call"
    raise ValueError(
        f"memsaving.fit_to_budget: the step {made}. The step must call memsaving.gradients(..., budget=...) "
        "(with the budget passed here) so that it can be replanned for the measured peak.")


def _say(verbose: bool, line: str) -> None:
    logger.info(line)
    if verbose:
        print(line)
