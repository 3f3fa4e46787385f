"""Exceptions raised by memsaving, each with a message that says what to do."""

import math
from typing import TYPE_CHECKING, Optional, cast

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
    if TYPE_CHECKING:  # the same signature, for mypy (which makes isinstance() of the assigned one Any)
        def __init__(self, *args: object) -> None: ...
    else:
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
    """No plan fits the memory budget; the message gives the smallest feasible one.

    Make one with :meth:`carrying`, which stores that budget with the error
    as :attr:`smallest_budget`: a message is for people, and a figure read
    back from one is only as exact as it was printed.

    Examples
    --------
    >>> error = BudgetError.carrying("no plan fits the budget of 100 bytes", 4096)
    >>> error.smallest_budget, str(error)
    (4096, 'no plan fits the budget of 100 bytes')
    """

    _smallest_budget: Optional[int] = None

    @classmethod
    def carrying(cls, message: str, smallest_budget: Optional[int]) -> "BudgetError":
        """A BudgetError saying ``message`` whose :attr:`smallest_budget` is ``smallest_budget`` (bytes)."""
        error = cls(message)
        error._smallest_budget = None if smallest_budget is None else int(smallest_budget)
        return error

    def again(self) -> "BudgetError":
        """A new error with this one's message and smallest budget, to raise
        once more (raising this one again would add to its traceback)."""
        return type(self).carrying(str(self), self.smallest_budget)

    @property
    def smallest_budget(self) -> Optional[int]:
        """The smallest feasible budget in bytes, None when the error names none.

        AutoGraph re-raises an error from inside a ``tf.function`` as a new
        one made from its message alone, raised while handling the original
        and given the original's ``ag_error_metadata``: such a copy reads the
        figure from the original, its ``__context__``."""
        error = self
        while error._smallest_budget is None and _autograph_copy(error):
            error = cast(BudgetError, error.__context__)  # _autograph_copy checked it is one
        return error._smallest_budget


def _autograph_copy(error: BudgetError) -> bool:
    """Whether ``error`` is AutoGraph's copy of the BudgetError it was raised while handling."""
    original = error.__context__
    metadata = getattr(error, "ag_error_metadata", None)
    return (isinstance(original, BudgetError) and metadata is not None
            and getattr(original, "ag_error_metadata", None) is metadata)
