"""Exceptions raised by memsaving, each with a message that says what to do."""


class MemsavingError(Exception):
    """Base class of every error memsaving raises on purpose."""


class CheckpointError(MemsavingError, ValueError):
    """The checkpoints given or found cannot be used (none found, or not
    between ``xs`` and ``ys``)."""


class UnsupportedGraphError(MemsavingError, NotImplementedError):
    """The forward graph holds a construct the rewrite cannot handle safely."""


class PeakMemoryUnavailableError(MemsavingError, RuntimeError):
    """The allocator does not report peak memory in this process."""
