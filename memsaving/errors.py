"""Exceptions raised by memsaving, each with a message that says what to do."""

import math
import re
from typing import Optional

IN_USE_SLACK = 0.005
"""The fraction of the lowest predicted peak a BudgetError adds to it
(plus :data:`IN_USE_SLACK_BYTES`) as its smallest feasible budget.  Every
prediction counts the bytes the device holds while planning, and those move
by a few small tensors (cached results, captured constants) from one trace to
the next: the budget passed back must still fit when the step is traced
again."""

IN_USE_SLACK_BYTES = 16 * 1024


def feasible_budget(lowest_peak: int) -> int:
    """The budget a BudgetError reports for a plan whose predicted peak is ``lowest_peak``."""
    return int(lowest_peak) + math.ceil(IN_USE_SLACK * lowest_peak) + IN_USE_SLACK_BYTES


class MemsavingError(Exception):
    """Base class of every error memsaving raises on purpose."""

    # AutoGraph re-raises errors from inside tf.function as a generic
    # StagingError unless the class is constructed like Exception; keeping
    # Exception's __init__ lets users catch memsaving's own types there.
    __init__ = Exception.__init__


class CheckpointError(MemsavingError, ValueError):
    """The checkpoints given or found cannot be used (none found, or not
    between ``xs`` and ``ys``)."""


class UnsupportedGraphError(MemsavingError, NotImplementedError):
    """The forward graph holds a construct the rewrite cannot handle safely."""


class PeakMemoryUnavailableError(MemsavingError, RuntimeError):
    """The allocator does not report peak memory in this process."""


class PlanWarning(UserWarning):
    """A plan that will run but works against the user: predicted above
    plain ``tf.gradients``' peak (``warnings.simplefilter("error",
    memsaving.PlanWarning)`` turns it into an error)."""


class BudgetError(MemsavingError, ValueError):
    """No plan fits the memory budget; the message gives the smallest feasible one."""

    @property
    def smallest_budget(self) -> Optional[int]:
        """The smallest feasible budget in bytes, read from the message (so it
        survives AutoGraph, which re-creates exceptions from their message)."""
        match = re.search(r"\((\d+) bytes\)", str(self))
        return int(match.group(1)) if match else None
