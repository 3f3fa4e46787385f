"""One rule for keeping a budget as *measured*, approached from below.

A budget is the memory a device has: a step that goes over it is an
out-of-memory error there, not a figure a little too high.  So a step runs
only when its plan is predicted under the budget by more than the model's
known error, and a calibration (``memsaving.fit_to_budget``, and
``memsaving.keras.enable(model, budget=...)`` during ``fit``) climbs towards
the budget from below:

1. the first plan is made for a budget that leaves room for the known error
   (:func:`safe_target`): a step whose memory is off by that much still fits.
   When no plan leaves that room, the lowest plan may still be measured once
   as a probe where running out of memory raises (:meth:`Calibrator.may_probe`);
2. its step is measured, and the ratio of its measured to its predicted
   step memory (:attr:`CalibrationRound.ratio`) replaces the prior error;
3. the next plan is made for the budget that ratio allows, and measured in
   turn (once: :data:`MAX_CLIMBS`), unless the measured plan uses the
   budget already (:data:`USED_ENOUGH`), the next plan would not be higher,
   or the rounds run out.  A plan measured over the budget (or failing
   with an out-of-memory error) sends the next plan lower, and the best
   plan measured under it is kept.
4. a caller that goes on measuring its steps after calibration
   (``memsaving.keras``, ``fit_to_budget``'s step) judges each by :meth:`Calibrator.steady_step`: the
   chosen plan's peak can creep up later, as the allocator's chunks move,
   and a step that leaves less than its room under the budget (or runs
   out of memory) sends the next plan lower.

Step memory is a step's peak above its resident bytes (the memory in use
before it: weights, optimizer slots, inputs): that is the part a plan
changes, and the part whose prediction errs.

:class:`Calibrator` holds the rule; its callers trace, run and measure.
Nothing here touches TensorFlow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import List, Optional, Sequence

from memsaving.planners.known_error import HEADROOM, KNOWN_ERROR, admissible, safe_target

USED_ENOUGH = 0.90
"""A measured plan at or above this fraction of the budget uses it: the
calibration stops climbing (another round would cost a trace and several
steps to recompute a little less)."""

MIN_STEP_UP = 0.02
"""A next plan is worth measuring only when its target is above the last
measured plan's prediction by at least this fraction of the budget."""

CLIMB_HEADROOM = 2 * HEADROOM
"""Fraction of the step's room a climb leaves free: the plans a calibration
steps up to are made for the budget less this much (as the measured ratio
predicts), twice what a measured round must leave.  A round is measured over
a few steps, and under a hard limit the allocator's free memory goes on
splitting after them: keras.applications' EfficientNetB0, calibrated to
plans measured within 10% of its step's room under the budget, ran out of
memory at its 12th and 20th steps with 5.3-7.1 MiB of a 103 MiB cap free,
where the plan ``budget=`` alone chose (measured 88-90 MiB) trained."""

MAX_CLIMBS = 1
"""How many times a calibration steps up after a round that fits (none after
a round that did not fit: the plans after it are lower).  The first
round is planned with room for the known error; the climb after it plans
for the budget less :data:`CLIMB_HEADROOM` by the ratio that round
measured.  A second climb only corrects for a ratio measured on another
plan, and costs a full round (a trace, a plan and several steps): on a
residual conv net under a 22 MiB budget, rounds 3 and 4 raised the chosen
plan's peak from 16.8 to 17.5 MiB (3% of the budget) for 20 s of the
calibration's 40 s (170 plain steps)."""

SLACK = 0.02
"""Fraction of the budget a plan measured over it is undercut by when the
next plan is made (beside what its measured ratio asks for)."""


STEADY_CALLS = 10
"""Steps in a row whose peak stays at or under the highest seen since the
last calibration, after which the allocator's layout is taken as settled
(:class:`PeakRise`): ``fit_to_budget``'s step stops copying the variables
before each call, and both callers stop holding the room while measuring
(:meth:`Calibrator.room_to_hold`)."""


@dataclass
class PeakRise:
    """Whether the steps after a calibration still reach new peaks: the
    highest peak since the calibration and how many steps in a row stayed at
    or under it (:data:`STEADY_CALLS`).

    Examples
    --------
    >>> rise = PeakRise()
    >>> for peak in [100, 120] + [110] * STEADY_CALLS:
    ...     rise.add(peak)
    >>> rise.steady(), rise.highest
    (True, 120)
    """

    highest: int = -1
    calls_under: int = 0

    def add(self, measured: int) -> None:
        if measured > self.highest:
            self.highest, self.calls_under = measured, 0
        else:
            self.calls_under += 1

    def steady(self) -> bool:
        return self.calls_under >= STEADY_CALLS


def room_needed(figure: int, spread: int, fraction: float = HEADROOM) -> int:
    """Room for a step's run-to-run variation beside ``figure`` (bytes):
    ``fraction`` of it, or ``spread`` (the highest less the lowest peak of
    its measured runs) when that is larger.

    Examples
    --------
    >>> room_needed(1000, 5), room_needed(1000, 120)
    (100, 120)
    """
    return max(int(math.ceil(fraction * figure)), int(spread))


@dataclass(frozen=True)
class CalibrationRound:
    """One measured trace of the step (bytes)."""

    planned_for: int
    """The budget the planner planned for."""
    predicted_peak: int
    """The largest predicted peak among the step's plans."""
    measured_peak: int
    """The allocator's peak during the step (everything on the device), the
    highest of the round's runs; the budget when the step ran out of memory."""
    spread: int = 0
    """The highest less the lowest peak of the round's measured runs (its
    runs after the first when the first is a graph's first run)."""
    resident: int = 0
    """The resident bytes of the plan predicted highest."""
    out_of_memory: bool = False
    """A run failed with an out-of-memory error (the device's limit is the budget)."""
    highest: bool = False
    """The plan recomputes nothing: no plan for more memory differs from it."""
    asked_for: Optional[int] = None
    """The target the calibration asked the planner for (None: ``planned_for``).
    The planner may plan for less, so that a plan's allocator chunks fit
    (``planned_for`` is then lower), and its plan is then still under this."""
    probe: bool = False
    """A plan the known error forbade, measured because nothing was measured
    yet and the device raises when a step runs out of memory
    (:meth:`Calibrator.may_probe`)."""
    steady: bool = False
    """Measured from a training step after calibration ended
    (:meth:`Calibrator.steady_step`), not from a round the calibration ran:
    it does not count against :attr:`Calibrator.max_rounds`."""

    @classmethod
    def from_peaks(cls, planned_for: int, predicted_peak: int, peaks: Sequence[int],
                   resident: int = 0, first_run: bool = False) -> "CalibrationRound":
        """The round whose measured runs gave ``peaks``.

        ``first_run``: ``peaks[0]`` is the graph's first run, which also
        allocates buffers kept for later runs (kernel caches, folded
        constants).  It counts in the measured peak (the device must hold it
        too) but not in the spread, which is the variation a later run of
        the same step may show.

        Examples
        --------
        >>> CalibrationRound.from_peaks(900, 800, [850, 820, 822], first_run=True).spread
        2
        """
        repeated = peaks[1:] if first_run and len(peaks) > 1 else peaks
        return cls(planned_for, predicted_peak, max(peaks), max(repeated) - min(repeated), resident)

    @property
    def lowest(self) -> bool:
        """The planner had no plan for the target asked for and gave its lowest
        plan, which no lower target changes.

        Judged against :attr:`asked_for`: a plan the planner made for a target
        it lowered so that its chunks fit is predicted above that lowered
        target but under the one asked for, and is no lowest plan (taken for
        one, a MobileNetV3Small's calibration gave up on a budget memory mode
        trains under).

        Examples
        --------
        >>> CalibrationRound(800, 900, 850).lowest
        True
        >>> CalibrationRound(800, 900, 850, asked_for=950).lowest
        False
        """
        return self.predicted_peak > (self.planned_for if self.asked_for is None else self.asked_for)

    @property
    def ratio(self) -> float:
        """Measured step memory over predicted step memory (a lower bound when
        the step ran out of memory)."""
        predicted = max(self.predicted_peak - self.resident, 1)
        return max(self.measured_peak - self.resident, 0) / predicted

    def room(self, budget: int) -> int:
        """The room under ``budget`` the round's peak must leave: the headroom
        of the step's room (the budget less what was in use before the step),
        or the round's spread when that is more."""
        return room_needed(budget - self.resident, self.spread)

    def fits(self, budget: int) -> bool:
        """Measured under ``budget`` less :meth:`room`."""
        return not self.out_of_memory and self.measured_peak <= budget - self.room(budget)

    def describe(self, budget: int) -> str:
        if self.out_of_memory:
            verdict = "out of memory"
        elif self.fits(budget):
            verdict = "fits"
        elif self.measured_peak <= budget:
            verdict = f"under the budget by less than the {_mib(self.room(budget))} of room it needs"
        else:
            verdict = "over"
        planned = (f"no plan predicted under {_mib(self.planned_for)}: the lowest plan" if self.lowest
                   else f"planned for {_mib(self.planned_for)}")
        if self.probe:
            planned += ", measured as a probe (the known error allowed no plan)"
        measured = "ran out of memory" if self.out_of_memory else f"measured {_mib(self.measured_peak)}"
        return f"{planned}, predicted {_mib(self.predicted_peak)}, {measured} ({verdict})"


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


class Next(str, Enum):
    """What a calibration does after a round."""

    RETRACE = "retrace"
    """Trace the step again for :attr:`Calibrator.target` and measure it."""
    DONE = "done"
    """Keep the round :attr:`Calibrator.best` names."""
    FAIL = "fail"
    """Nothing measured fits: raise (:attr:`Calibrator.reason` says why)."""


@dataclass
class Calibrator:
    """The climb towards a measured budget (see the module docstring).

    Examples
    --------
    A step whose memory measures 0.9x its prediction: the first plan leaves
    room for the known error, the second is made for the budget less the
    climb's headroom (:data:`CLIMB_HEADROOM` of the room) as predicted, and
    uses it.

    >>> c = Calibrator(budget=1000, max_rounds=4)
    >>> c.first_target(resident=200)
    753
    >>> c.record(CalibrationRound(753, 740, 686, resident=200))
    <Next.RETRACE: 'retrace'>
    >>> c.target
    840
    >>> c.record(CalibrationRound(840, 835, 905, resident=200))
    <Next.DONE: 'done'>
    >>> c.best
    1
    """

    budget: int
    max_rounds: int = 4
    ratio: float = 1 + KNOWN_ERROR
    """The step memory's measured / predicted ratio assumed for the next plan."""
    rounds: List[CalibrationRound] = field(default_factory=list)
    target: Optional[int] = None
    """The budget the next trace plans for."""
    best: Optional[int] = None
    """Index in ``rounds`` of the best round that fits (the highest measured peak)."""
    reason: str = ""
    climbs: int = 0
    """How many times a round that fits was followed by a higher plan (:data:`MAX_CLIMBS`)."""
    probes: bool = False
    """Running out of memory raises on the device measured (the caller says:
    ``memsaving.tf.measure.out_of_memory_raises``), so :meth:`may_probe` may allow a probe."""

    def first_target(self, resident: int) -> int:
        """The target of the first trace: room for the known error."""
        self.target = safe_target(self.budget, resident, self.ratio, HEADROOM)
        return self.target

    def may_run(self, predicted: int, resident: int) -> bool:
        """Whether a plan traced for :attr:`target` may run: predicted under the
        budget by more than the error known so far."""
        return admissible(predicted, resident, self.budget, self.ratio, HEADROOM)

    def calibration_rounds(self) -> int:
        """How many rounds the calibration ran (steady rounds not counted)."""
        return sum(1 for r in self.rounds if not r.steady)

    def may_probe(self, predicted: int, resident: int) -> bool:
        """Whether a plan :meth:`may_run` refuses may still be measured once, as
        a probe: nothing was measured yet (the refusal comes from the prior,
        :data:`KNOWN_ERROR`, not from this model), and the plan is predicted
        under the budget less the headroom as it stands.  The caller probes
        only on a device where running out of memory raises, and puts the
        variables back when the probe fails, so a budget no plan meets is
        still refused with no step counted (:attr:`probes`).  Before, a residual conv net was
        refused a budget its memory-mode plan measured 13% under (the
        prior asked for room the model's real error, 1.06x, did not need).

        Examples
        --------
        >>> c = Calibrator(budget=1000, probes=True)
        >>> c.may_run(850, 200), c.may_probe(850, 200), c.may_probe(950, 200)
        (False, True, False)
        >>> Calibrator(budget=1000).may_probe(850, 200)
        False
        """
        return self.probes and not self.rounds and admissible(predicted, resident, self.budget, 1.0, HEADROOM)

    def room_to_hold(self, resident: int) -> int:
        """Bytes a round of a plan with ``resident`` bytes in use before its
        step should hold on the device while it is measured: the room it must
        leave (:func:`room_needed`), where running out of memory raises
        (:attr:`probes`), else 0.  Held, the room makes the device's limit
        the judge: a step that runs left it free, whatever the allocator's
        peak reads (which counts chunks handed whole, up to twice a request),
        and one that did not runs out of memory and is undone.

        Examples
        --------
        >>> Calibrator(budget=1000, probes=True).room_to_hold(200), Calibrator(budget=1000).room_to_hold(200)
        (80, 0)
        """
        if not self.probes:
            return 0
        return room_needed(self.budget - resident, self.widest_spread())

    def steady_room_to_hold(self) -> int:
        """:meth:`room_to_hold` for the steps after calibration: the chosen round's room (0 without one)."""
        if not self.probes or self.best is None:
            return 0
        return self.rounds[self.best].room(self.budget)

    def widest_spread(self) -> int:
        """The widest run-to-run spread of the rounds so far (bytes)."""
        return max((r.spread for r in self.rounds), default=0)

    def record(self, current: CalibrationRound) -> Next:
        """Add a measured round and decide what comes next.

        The round is kept with the widest spread seen so far when its own is
        narrower: the variation comes from the step and the allocator (where
        earlier steps left their buffers), not from one plan, and a plan whose
        few measured runs happened to agree moves as much later (a residual
        conv net's plan measured 12.5-15.0 MiB over eight runs, 12.5 in three).
        """
        if current.spread < self.widest_spread():
            current = replace(current, spread=self.widest_spread())
        self.rounds.append(current)
        budget = self.budget
        ratio = current.ratio
        if current.fits(budget):
            if self.best is None or current.measured_peak >= self.rounds[self.best].measured_peak:
                self.best = len(self.rounds) - 1
            # never below 1 when climbing: a plan predicted over the budget could meet the
            # device's limit itself were its own ratio higher than this one's
            self.ratio = max(ratio, 1.0)
            if current.measured_peak >= USED_ENOUGH * budget or self.calibration_rounds() >= self.max_rounds \
                    or self.climbs >= MAX_CLIMBS:
                return Next.DONE
            target = safe_target(budget, current.resident, self.ratio, CLIMB_HEADROOM)
            # a plan whose step memory an earlier round had: the planner gave it again for more memory
            step_memory = current.predicted_peak - current.resident
            seen_before = any(r.predicted_peak - r.resident == step_memory for r in self.rounds[:-1])
            # a target no higher than this round's gives no higher plan; and the lowest plan, which the
            # first target was under, is kept: a higher plan would run on the ratio measured for this one,
            # and plans differ (a MobileNetV3Small's lowest plan measured 1.04x its prediction; the plan
            # a climb gave next ran out of memory under a cap 4% above its prediction)
            if current.lowest or current.highest or seen_before or target <= current.planned_for \
                    or target < current.predicted_peak + MIN_STEP_UP * budget:
                return Next.DONE
            self.target = target
            self.climbs += 1
            return Next.RETRACE
        self.ratio = max(self.ratio, ratio)
        # no climb after a round that did not fit: the next plans are lower, and a climb from one of them
        # would go back towards the plan that did not fit (in Keras, 6 steps of fit ran out while a climb
        # after an over-round was still to be measured, and no plan was chosen)
        self.climbs = MAX_CLIMBS
        if current.lowest:
            return self._give_up("the planner's lowest plan measures over the budget")
        if self.calibration_rounds() >= self.max_rounds:
            return self._give_up(f"the measured peak stays over the budget after {self.max_rounds} round(s)")
        lower = current.predicted_peak - (current.measured_peak - budget) - int(math.ceil(SLACK * budget))
        self.target = min(safe_target(budget, current.resident, self.ratio, HEADROOM), lower)
        return Next.RETRACE

    def steady_step(self, measured_peak: int, out_of_memory: bool = False, settled: bool = False) -> Next:
        """Judge a training step of the chosen plan after calibration ended.

        A round is measured over a few steps; under a hard limit the
        allocator's chunks go on moving after them, and the same plan's peak
        creeps up (keras.applications' EfficientNetB0: 83.7, 86.5, 88.6 MiB
        over its three measured steps, 90.5 MiB by step 16, and in another
        process out of memory at step 20 under a 98 MiB cap).  So a caller
        that can (``memsaving.keras``) goes on measuring its steps:

        * a step still under the budget less the chosen round's room:
          :attr:`Next.DONE`, nothing changes;
        * a ``settled`` step (its peak steady before it, :class:`PeakRise`)
          where running out of memory raises (:attr:`probes`): only a peak
          over the budget itself counts.  The room was held while the plan
          was measured and until it settled; from then on it is the step's
          to use (near a device's limit the allocator hands chunks whole,
          and the peak read grows into it), and running out would raise;
        * otherwise (or when it ran out of memory) the plan is judged again
          as a round of its own, its creep counted as spread (the room every
          later round must leave), the chosen round is dropped and the next
          plan is made lower, as for a round measured over:
          :attr:`Next.RETRACE`;
        * when the plan is the planner's lowest: :attr:`Next.FAIL` if the
          step ran out of memory (:attr:`reason` says why), else
          :attr:`Next.DONE` (nothing lower exists; the step still ran).

        Steady rounds (marked :attr:`CalibrationRound.steady`) do not count
        against ``max_rounds``: each one sends the plan lower, so they end at
        the lowest plan.

        Examples
        --------
        >>> c = Calibrator(budget=1000, max_rounds=2)
        >>> c.rounds, c.best = [CalibrationRound(850, 830, 880, resident=200, asked_for=900)], 0
        >>> c.steady_step(890)
        <Next.DONE: 'done'>
        >>> c.steady_step(960)
        <Next.RETRACE: 'retrace'>
        >>> c.target < 830, c.best, c.rounds[-1].spread
        (True, None, 80)

        Where running out of memory raises, a settled step may use the room:

        >>> c = Calibrator(budget=1000, probes=True)
        >>> c.rounds, c.best = [CalibrationRound(850, 830, 880, resident=200, asked_for=900)], 0
        >>> c.steady_step(960, settled=True), c.steady_step(960)
        (<Next.DONE: 'done'>, <Next.RETRACE: 'retrace'>)
        """
        if self.best is None:
            raise ValueError("steady_step: no plan was chosen yet")
        budget = self.budget
        chosen = self.rounds[self.best]
        allowed = budget if settled and self.probes else budget - chosen.room(budget)
        if not out_of_memory and measured_peak <= allowed:
            return Next.DONE
        measured = budget if out_of_memory else measured_peak
        current = replace(chosen, measured_peak=measured, out_of_memory=out_of_memory, steady=True,
                          spread=max(chosen.spread, self.widest_spread(), measured - chosen.measured_peak))
        if current.lowest and not out_of_memory:
            self.rounds[self.best] = replace(chosen, spread=current.spread)
            return Next.DONE
        self.rounds.append(current)
        self.best = None
        self.ratio = max(self.ratio, current.ratio)
        if current.lowest:
            self.reason = "the planner's lowest plan ran out of memory after calibration"
            return Next.FAIL
        excess = measured - (budget - current.room(budget))
        lower = current.predicted_peak - excess - int(math.ceil(SLACK * budget))
        self.target = min(safe_target(budget, current.resident, self.ratio, HEADROOM), lower)
        return Next.RETRACE

    def describe_steady(self, measured_peak: int, out_of_memory: bool = False) -> str:
        """What a step after calibration that :meth:`steady_step` did not
        pass measured, in words (after it recorded the step's round).

        Examples
        --------
        >>> c = Calibrator(budget=1000 * 2 ** 20)
        >>> c.rounds = [CalibrationRound(850, 830, 880, resident=200 * 2 ** 20)]
        >>> c.describe_steady(960 * 2 ** 20)
        'a step after calibration measured 960.0 MiB, within the 80.0 MiB of room the budget of 1000.0 MiB keeps free'
        """
        if out_of_memory:
            return "a step after calibration ran out of memory"
        room = self.rounds[-1].room(self.budget)
        return (f"a step after calibration measured {_mib(measured_peak)}, within the {_mib(room)} of room "
                f"the budget of {_mib(self.budget)} keeps free")

    def _give_up(self, reason: str) -> Next:
        if self.best is not None:
            return Next.DONE
        self.reason = reason
        return Next.FAIL

    def smallest_measured_budget(self) -> Optional[int]:
        """A budget some measured round fits: its peak plus the room its
        spread needs (None when nothing ran without running out of memory).

        A plan predicted no higher that ran out of memory under the budget
        (a probe that fit, then a later step of it that did not) says the
        budget itself is too small: the figure is then what such a round,
        its peak taken as the budget, needs (:meth:`lowest_ran_out`).
        Before, the figure named the fitting round's peak alone, a budget
        below the one just run out of.

        Examples
        --------
        >>> c = Calibrator(budget=1000)
        >>> fit = CalibrationRound(900, 950, 800, resident=500)
        >>> c.rounds = [fit]
        >>> c.smallest_measured_budget()
        834
        >>> c.rounds.append(replace(fit, measured_peak=1000, out_of_memory=True, steady=True))
        >>> c.smallest_measured_budget(), c.lowest_ran_out()
        (1056, True)
        """
        lowest = self._lowest_measured()
        if lowest is None:
            return None
        return max(_fitting_budget(r) for r in [lowest] + self._ran_out_no_higher(lowest))

    def lowest_ran_out(self) -> bool:
        """Whether a round no higher than the lowest measured one ran out of
        memory: :meth:`smallest_measured_budget` is then above the budget."""
        lowest = self._lowest_measured()
        return lowest is not None and bool(self._ran_out_no_higher(lowest))

    def _lowest_measured(self) -> Optional[CalibrationRound]:
        """The round of lowest peak among those that did not run out of memory."""
        measured = [r for r in self.rounds if not r.out_of_memory]
        return min(measured, key=lambda r: r.measured_peak) if measured else None

    def _ran_out_no_higher(self, lowest: CalibrationRound) -> List[CalibrationRound]:
        """The rounds that ran out of memory with a plan predicted no higher than ``lowest``'s."""
        return [r for r in self.rounds if r.out_of_memory and r.predicted_peak <= lowest.predicted_peak]


def _fitting_budget(measured: CalibrationRound) -> int:
    """The budget under which ``measured``'s peak leaves the room it needs:
    the headroom of the step's room, or its spread when that is more (a
    round that ran out of memory counts at its lower bound, the budget)."""
    step = measured.measured_peak - measured.resident
    return max(measured.resident + int(math.ceil(step / (1 - HEADROOM))), measured.measured_peak + measured.spread)
