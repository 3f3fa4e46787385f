"""Exceptions raised by memsaving, each with a message that says what to do."""

import re
from typing import Optional


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


class BudgetError(MemsavingError, ValueError):
    """No plan fits the memory budget; the message gives the smallest feasible one."""

    @property
    def smallest_budget(self) -> Optional[int]:
        """The smallest feasible budget in bytes, read from the message (so it
        survives AutoGraph, which re-creates exceptions from their message)."""
        match = re.search(r"\((\d+) bytes\)", str(self))
        return int(match.group(1)) if match else None
