"""How much simulation one plan may spend: the ``planning_time`` option.

Planning is almost all simulation (each plan a search considers is replayed
action by action), so its time is counted here in replayed actions and
converted to seconds at a fixed rate, :data:`REPLAYED_ACTIONS_PER_SECOND`.
Counting work rather than reading a clock keeps plans reproducible: the same
graph and arguments give the same plan on any machine and under any load,
which ``plan`` followed by ``gradients``, and the calibrations that trace a
step again, rely on.  The seconds are those of the machine the rate was
measured on; a slower machine takes longer for the same plan.

A planner asks :func:`used_up` before each new simulation it would start,
and when the allowance is spent it keeps the best plan found so far; the
allowance remembers that it stopped a search, and the plan says so.

Examples
--------
>>> with planning_allowance(seconds=1.0) as allowance:
...     charge(REPLAYED_ACTIONS_PER_SECOND // 2)
...     half_way = used_up()
...     charge(REPLAYED_ACTIONS_PER_SECOND)
...     spent = used_up()
>>> half_way, spent, allowance.stopped
(False, True, True)
>>> used_up()  # outside any allowance: no limit
False
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from memsaving.model.progress import Progress

REPLAYED_ACTIONS_PER_SECOND = 200_000
"""Actions one CPU core of this project's machine replays per second,
building each plan's actions included: whole budget searches on the graph
models of Keras ResNet50, 48-block transformer and 1,600-layer MLP training
steps, 2026-11-25.  Measured again whenever replays get faster: a stale,
lower rate stops planning well before the ``planning_time`` asked for."""

DEFAULT_PLANNING_SECONDS = 30.0
"""``planning_time`` when none is given."""


@dataclass
class Allowance:
    """The simulation one planning call may still spend.

    Attributes
    ----------
    seconds
        the limit (None: none).
    spent_actions
        actions replayed so far.
    stopped
        a search stopped early because the allowance was spent.
    """

    seconds: Optional[float]
    spent_actions: int = 0
    stopped: bool = False
    progress: Progress = field(default_factory=lambda: Progress(delay=2.0), repr=False)

    @property
    def spent_seconds(self) -> float:
        """The work so far, in seconds at :data:`REPLAYED_ACTIONS_PER_SECOND`."""
        return self.spent_actions / REPLAYED_ACTIONS_PER_SECOND

    def exhausted(self) -> bool:
        """Whether the work so far has reached the limit."""
        return self.seconds is not None and self.spent_seconds >= self.seconds


_current: contextvars.ContextVar[Optional[Allowance]] = contextvars.ContextVar("memsaving_allowance", default=None)


@contextmanager
def planning_allowance(seconds: Optional[float] = DEFAULT_PLANNING_SECONDS) -> Iterator[Allowance]:
    """Count the simulations run inside the ``with`` block against ``seconds``
    (None: count them, with no limit), showing progress on stderr when the
    planning takes more than two seconds."""
    allowance = Allowance(seconds)
    token = _current.set(allowance)
    try:
        yield allowance
    finally:
        _current.reset(token)
        if allowance.stopped:
            allowance.progress.close(f"memsaving: planning stopped at planning_time={seconds:g} s, with the best "
                                     "plan found so far,")
        else:
            allowance.progress.close("memsaving: planned")


def charge(actions: int) -> None:
    """Count ``actions`` replayed against the current allowance, if any."""
    allowance = _current.get()
    if allowance is None:
        return
    allowance.spent_actions += actions
    limit = "" if allowance.seconds is None else f" of {allowance.seconds:g}"
    allowance.progress.update(f"memsaving: planning, {allowance.spent_seconds:.0f}{limit} s of simulation")


def stopped() -> bool:
    """Whether a search under the current allowance stopped early."""
    allowance = _current.get()
    return allowance is not None and allowance.stopped


def used_up() -> bool:
    """Whether the current allowance is spent: a search asks before each new
    simulation, and stops (recording that it did) when it is."""
    allowance = _current.get()
    if allowance is None or not allowance.exhausted():
        return False
    allowance.stopped = True
    return True
