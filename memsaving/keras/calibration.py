"""Holding ``enable(model, budget=...)`` as measured while Keras trains.

One job: measure the steps ``fit`` and ``train_on_batch`` run and send the
next trace to a higher or lower plan until one uses the budget
(:class:`KerasCalibrator`), and keep training through a step that runs out
of memory (:func:`surviving_out_of_memory`).  The rule that decides each
round is framework-free and shared with :func:`memsaving.fit_to_budget`:
it is :mod:`memsaving.calibration` (``Calibrator``); this module is the
Keras side of it: a callback around each step of ``fit``
(:func:`add_calibration_callback`), the allocator's peak read around it,
the variables put back when a step fails, and lines printed with
``verbose``.  The module keeps the name ``calibration`` because it is what
:func:`memsaving.keras.calibration_of` reports on; its class is named
``KerasCalibrator`` so it is not mistaken for
``memsaving.calibration.Calibrator``, which it drives.

The allocator is read through this module's globals ``peak_bytes``,
``reset_peak``, ``bytes_in_use`` and ``out_of_memory_raises`` (from
:mod:`memsaving.tf.measure`), looked up at call time, so tests can replace
them here.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from memsaving.planners.budget import format_bytes
from memsaving.errors import BudgetError, PeakMemoryUnavailableError
from memsaving.calibration import CalibrationRound, Calibrator, Next, PeakRise
from memsaving.fit_budget import (MEASURED_STEPS, Calibration, calibration_error, held_room, planned_target,
                                  PlanningTarget, predicted_figures, recomputes_nothing, refusal, restore_values,
                                  snapshot_values)
from memsaving.tf.measure import bytes_in_use, default_device, out_of_memory_raises, peak_bytes, reset_peak
from memsaving.planners.planning import Plan
from memsaving.keras.settings import SETTINGS_ATTRIBUTE

logger = logging.getLogger("memsaving")


def surviving_out_of_memory(model: keras.Model, run: Callable[[], Any], after_calibration: bool = True) -> Any:
    """``run()`` (``fit``), run again on a lower plan when a step runs out of
    memory, with the model's, the optimizer's and the metrics' variables put
    back as they were when it began.

    A device raises ``ResourceExhaustedError`` when a step needs more than
    it has: during calibration that is one more measurement (the plan is
    over the budget), not the end of training; after it (the allocator's
    chunks moved since the plan was measured) the chosen plan is judged
    again and the next one made lower
    (:meth:`memsaving.calibration.Calibrator.steady_step`).  Steps before
    the failed one are undone with it, so ``fit`` starts again from its
    first step: a step stopped by the error may have updated some variables
    already.  The values are copied to host memory when ``fit`` begins (once
    per ``fit`` call; ``after_calibration`` False: only while calibrating,
    for ``train_on_batch``, which would copy them at every step).  When no
    plan may run (``BudgetError``), the steps run are undone too: the error
    leaves the model as ``fit`` found it."""
    calibrator = model.__dict__[SETTINGS_ATTRIBUTE]["calibrator"]
    if calibrator is None or calibrator.off or (calibrator.final and not after_calibration):
        return run()
    calibrator.snapshot = _VariableSnapshot(model)
    while True:
        try:
            return run()
        except BudgetError:
            # no plan may run: fit ends with the model as it began, not with the rounds' steps applied
            calibrator.snapshot.restore()
            raise
        except tf.errors.ResourceExhaustedError:
            if calibrator.off:
                raise
            when = "after" if calibrator.final else "during"
            calibrator.snapshot.restore()
            calibrator.out_of_memory(model)  # raises when nothing lower may run
            _say(f"memsaving: {model.name}: a step ran out of memory {when} calibration; the variables are back "
                 "as fit began, and fit runs again on a lower plan", model.__dict__[SETTINGS_ATTRIBUTE])


class _VariableSnapshot:
    """The values of the variables a training step changes, to put back when
    ``fit`` runs again after an out-of-memory step.

    Keras builds an optimizer (its step counter and slots) inside the first
    traced step when no distribution strategy is set, after any callback
    could record it: a built model's optimizer is built here first, as
    Keras' own ``compile_from_config`` does (with a strategy, ``fit``
    builds it in the strategy's scope before it begins).  Variables first seen later
    (:meth:`add_missing`, when ``fit`` begins) are recorded with the values
    they had then, before any step ran."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.values: Dict[int, Tuple[tf.Variable, np.ndarray]] = {}
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not getattr(optimizer, "built", True) and model.built \
                and getattr(model, "_distribute_strategy", None) is None:
            optimizer.build(model.trainable_variables)
        self.add_missing()

    def add_missing(self) -> None:
        """Record the variables not recorded yet."""
        missing = [v for v in _state_variables(self.model) if id(v) not in self.values]
        for variable, value in snapshot_values(missing):
            self.values[id(variable)] = (variable, value)

    def restore(self) -> None:
        restore_values(self.values.values())


def _state_variables(model: keras.Model) -> List[tf.Variable]:
    """The variables a training step changes: the model's, its optimizer's and its metrics'."""
    found = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        found += list(optimizer.variables)
    found += list(getattr(model, "metrics_variables", []))
    unique = {id(v): v for v in found}
    return [getattr(v, "value", v) if not isinstance(v, tf.Variable) else v for v in unique.values()]


class KerasCalibrator:
    """Makes ``enable(model, budget=B)`` hold as measured, from the first step
    (the rule of :mod:`memsaving.calibration`, shared with
    :func:`memsaving.fit_to_budget`).

    At trace time the planner plans for the calibration's target, which
    leaves room for the model's known error before anything was measured
    (:meth:`planning`); a trace whose plan may not run under that rule is
    refused with ``BudgetError`` before its first step (:meth:`admit`).  The
    first :data:`MEASURED_STEPS` steps of a new train function are measured
    (:meth:`begin_step` resets the allocator's peak, :meth:`end_step` reads
    it); the round then decides: climb to a higher plan, go lower, keep the
    best plan measured, or raise.  A new plan means a new train function,
    traced at the next step.  After calibration every step is still
    measured: one whose peak crept into the room the budget keeps free
    sends the next trace lower (:meth:`_steady`).  Where running out of
    memory raises, each measured step runs with the room its plan must
    leave held on the device, during calibration and until the chosen
    plan's peak is steady (:meth:`_hold_room`); after that the step may use
    the room, and only a peak over the budget sends the next trace lower.
    A step that runs out of memory, during calibration or after it, ends ``fit`` with
    ``ResourceExhaustedError``; ``_fit`` then restores the variables as
    they were when ``fit`` began, and runs ``fit`` again on a lower plan
    (:meth:`out_of_memory`).
    """

    def __init__(self, budget: int, max_rounds: int):
        self.device = default_device()
        self.engine = Calibrator(budget=budget, max_rounds=max_rounds, probes=out_of_memory_raises(self.device))
        self.report = Calibration(budget=budget, rounds=self.engine.rounds)
        self.plans: List[Plan] = []  # plans traced since the last measured step
        self.measured_function: Any = None  # the last train function judged
        self.pending: Optional[Tuple[List[Plan], List[int]]] = None  # (plans, measured peaks) of the trace being measured
        self.final = False  # the plan is chosen: its steps are only watched (_steady)
        self.off = False
        self.snapshot: Optional[_VariableSnapshot] = None  # the variables as the running fit began
        self.readmitted = False  # the trace being made plans a measured round's plan again
        self.probing = False  # the trace being measured plans what only a probe may run
        self.rise = PeakRise()  # the chosen plan's steps: whether their peak still rises
        self.room: Optional[contextlib.ExitStack] = None  # the room held during the step measured (held_room)
        self.held = 0  # the bytes it holds
        self.start = time.perf_counter()

    def planning(self) -> PlanningTarget:
        """The record the train step hands its gradient call in a trace: plan
        for the calibration's target."""
        if self.engine.target is None:
            self.engine.first_target(resident=bytes_in_use(self.device) - self.held)
        return PlanningTarget(self.engine.target, or_lowest=True, held=self.held)

    def back_to_best(self, plan: Plan) -> bool:
        """Whether a plan traced for the calibration's target may not run while
        a measured round fits: the trace plans that round's plan again
        (:meth:`planning_best`), as ``fit_to_budget`` keeps its best measured
        step.  Before, ``fit`` raised a ``BudgetError`` here though a plan had
        measured under the budget (a round that climbed measured inside the
        room, and the error it showed left no lower plan that may run)."""
        return not self.off and self.engine.best is not None and \
            not self.engine.may_run(plan.device_peak, plan.resident_bytes)

    def planning_best(self, model: keras.Model) -> PlanningTarget:
        """The record that plans the best measured round's plan again;
        calibration ends with it (it was measured: no rule is checked)."""
        engine = self.engine
        best = engine.rounds[engine.best]
        engine.target = best.asked_for if best.asked_for is not None else best.planned_for
        self.final, self.readmitted = True, True
        self.rise = PeakRise()
        self.report.chosen = engine.best
        _say(f"memsaving: {model.name}: the next plan may not run under the error measured; back to the plan "
             f"of round {engine.best + 1}", model.__dict__[SETTINGS_ATTRIBUTE])
        return PlanningTarget(engine.target, or_lowest=True, held=self.held)

    def admit(self, model: keras.Model, plan: Plan) -> None:
        """Note a plan made while tracing, and refuse one that may not run
        (predicted over the budget, or under it by less than the known
        error; a measured round's plan planned again is not checked).  The
        allocator's peak restarts: what planning allocated (profiling ops)
        is not the step's."""
        readmitted, self.readmitted = self.readmitted, False
        if not readmitted and not self.engine.may_run(plan.device_peak, plan.resident_bytes):
            if not self.engine.may_probe(plan.device_peak, plan.resident_bytes):
                raise refusal(f"memsaving.keras ({model.name})", self.engine.budget, plan.device_peak,
                              plan.resident_bytes, self.engine.ratio, self.engine.rounds)
            self.probing = True  # measured once (Calibrator.may_probe); a failure undoes its steps
        self.plans.append(plan)
        if self.final:  # the chosen round's plan, traced again (back to it, or for another batch): the one that runs
            self.report.plans = [plan]
        if not self.off:
            try:
                reset_peak(self.device)
            except PeakMemoryUnavailableError:
                pass  # begin_step says so once, with what to do

    def begin_step(self, model: keras.Model) -> bool:
        """Before a step: reset the allocator's peak if the step runs a train function not judged yet
        (or one traced again since)."""
        judged = model.train_function is not None and model.train_function is self.measured_function
        if self.off or (judged and not self.plans and self.pending is None and not self.final):
            return False
        try:
            reset_peak(self.device)
        except PeakMemoryUnavailableError as error:
            self.off = True
            warnings.warn(f"memsaving.keras: the budget cannot be checked against measured peaks: {error}",
                          stacklevel=3)
            return False
        self._hold_room()
        return True

    def _hold_room(self) -> None:
        """Hold the room the step must leave while it runs (where running out
        of memory raises: rounds, and the chosen plan's steps until their
        peak is steady), as ``fit_to_budget`` does (:func:`memsaving.fit_budget.held_room`)."""
        self.release_room()
        if self.final:
            nbytes = 0 if self.rise.steady() else self.engine.steady_room_to_hold()
        else:
            nbytes = self.engine.room_to_hold(bytes_in_use(self.device))
        if nbytes > 0:
            self.room = contextlib.ExitStack()
            self.held = self.room.enter_context(held_room(nbytes, self.device))

    def release_room(self) -> None:
        """Free the room held for the step measured, if any."""
        if self.room is not None:
            self.room.close()
        self.room, self.held = None, 0

    def end_step(self, model: keras.Model) -> None:
        """After a measured step: record a round once :data:`MEASURED_STEPS` steps of
        a new trace are measured (or at once when one is already over the budget)."""
        measured = peak_bytes(self.device) - self.held
        self.release_room()
        if self.plans:  # this step traced: a new round starts (an unfinished one is dropped)
            self.pending = (self.plans, [measured])
            self.plans = []
        elif self.pending is not None:
            self.pending[1].append(measured)
        elif self.final and self.engine.best is not None:
            settled = self.rise.steady()
            self.rise.add(measured)
            self._steady(model, measured, settled=settled)
            return
        else:
            self.measured_function = model.train_function  # nothing memsaving planned was traced
            return
        plans, peaks = self.pending
        if self.final:
            self.pending = None
            self.measured_function = model.train_function
            return
        if max(peaks) <= self.engine.budget and len(peaks) < MEASURED_STEPS:
            return  # measure the next step of this train function too
        self.pending = None
        self.measured_function = model.train_function
        predicted, resident = predicted_figures(plans)
        self._judge(model, plans, CalibrationRound.from_peaks(planned_target(plans, self.engine.target), predicted,
                                                              peaks, resident, first_run=True))

    def out_of_memory(self, model: keras.Model) -> None:
        """A step ran out of memory: of the train function being measured, or of the chosen plan."""
        self.release_room()
        if self.final and self.engine.best is not None and not self.plans and self.pending is None:
            self._steady(model, self.engine.budget, out_of_memory=True)
            return
        plans = self.pending[0] if self.pending is not None else self.plans
        self.pending, self.plans = None, []
        if not plans:
            raise  # pylint: disable=misplaced-bare-raise
        predicted, resident = predicted_figures(plans)
        self._judge(model, plans, CalibrationRound(planned_target(plans, self.engine.target), predicted,
                                                   self.engine.budget, 0, resident, out_of_memory=True))

    def _steady(self, model: keras.Model, measured: int, out_of_memory: bool = False, settled: bool = False) -> None:
        """A step of the chosen plan after calibration, measured at ``measured``
        (:meth:`memsaving.calibration.Calibrator.steady_step`): a step whose
        peak crept into the room the budget must keep free, or that ran out
        of memory, sends the next trace lower."""
        engine, settings = self.engine, model.__dict__[SETTINGS_ATTRIBUTE]
        decision = engine.steady_step(measured, out_of_memory, settled)
        if decision is Next.DONE:
            return
        self.report.chosen = None
        line = f"memsaving: {model.name}: {engine.describe_steady(measured, out_of_memory)}"
        if decision is Next.FAIL:
            _say(line, settings)
            raise calibration_error(f"memsaving.keras ({model.name})", engine.budget, engine)
        self.final = False
        _say(f"{line}; planning for {format_bytes(engine.target)} next", settings)
        model.make_train_function(force=True)  # the next step traces, and plans, again

    def _judge(self, model: keras.Model, plans: List[Plan], current: CalibrationRound) -> None:
        engine, report = self.engine, self.report
        current = replace(current, highest=recomputes_nothing(plans), asked_for=engine.target, probe=self.probing)
        self.probing = False
        decision = engine.record(current)
        settings = model.__dict__[SETTINGS_ATTRIBUTE]
        line = (f"memsaving: {model.name}: calibration round {len(engine.rounds)}: "
                f"{engine.rounds[-1].describe(engine.budget)}")
        if decision is Next.FAIL:
            _say(line, settings)
            raise calibration_error(f"memsaving.keras ({model.name})", engine.budget, engine)
        if decision is Next.RETRACE:
            _say(f"{line}; planning for {format_bytes(engine.target)} next", settings)
            model.make_train_function(force=True)  # the next step traces, and plans, again
            return
        report.chosen = engine.best
        report.seconds = time.perf_counter() - self.start
        self.final = True
        self.rise = PeakRise()
        if engine.best == len(engine.rounds) - 1:
            report.plans = plans
            _say(f"{line}; calibrated", settings)
            return
        best = engine.rounds[engine.best]
        engine.target = best.planned_for
        _say(f"{line}; back to the plan of round {engine.best + 1}", settings)
        model.make_train_function(force=True)


class _CalibrationCallback(keras.callbacks.Callback):
    """Brackets each step of ``fit`` for :class:`KerasCalibrator` (only the train function call is inside)."""

    def __init__(self, calibrator: KerasCalibrator):
        super().__init__()
        self.calibrator = calibrator
        self.measuring = False

    def on_train_begin(self, logs=None):
        if self.calibrator.snapshot is not None:
            self.calibrator.snapshot.add_missing()  # the optimizer fit built, before its first step

    def on_train_batch_begin(self, batch, logs=None):
        self.measuring = self.calibrator.begin_step(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.measuring:
            self.calibrator.end_step(self.model)

    def on_train_end(self, logs=None):
        self.calibrator.release_room()  # a step that failed (not out of memory) left it held


def add_calibration_callback(model: keras.Model, bound: inspect.BoundArguments) -> None:
    """Add the calibration callback to ``fit``'s ``callbacks`` argument."""
    calibrator = model.__dict__[SETTINGS_ATTRIBUTE]["calibrator"]
    if calibrator is None:
        return
    parameters = bound.signature.parameters
    arguments = bound.arguments
    if "callbacks" in parameters:
        holder = arguments
    else:
        extra = next((n for n, p in parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        if extra is None:
            logger.warning("memsaving.keras: %s.fit takes no callbacks, so its steps are not measured against "
                           "the budget", type(model).__name__)
            return
        holder = arguments.setdefault(extra, {})
    given = holder.get("callbacks")
    callback = _CalibrationCallback(calibrator)
    if isinstance(given, keras.callbacks.CallbackList):
        given.append(callback)
    else:
        holder["callbacks"] = list(given or []) + [callback]


def _say(line: str, settings: Dict[str, Any]) -> None:
    logger.info(line)
    if settings["verbose"]:
        print(line)
