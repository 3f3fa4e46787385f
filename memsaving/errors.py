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
    """Base class of every error memsaving raises on purpose.

    Each subclass is also the built-in exception it stands for (a
    :class:`CheckpointError` is a ``ValueError``...), so code that catches
    those keeps working; catch ``MemsavingError`` for all of memsaving's own.

    Examples
    --------
    >>> import memsaving
    >>> sorted(cls.__name__ for cls in memsaving.MemsavingError.__subclasses__())
    ['BudgetError', 'CheckpointError', 'PeakMemoryUnavailableError', 'UnsupportedGraphError']
    >>> try:
    ...     raise memsaving.BudgetError.carrying("no plan fits the budget of 100 bytes", 4096)
    ... except memsaving.MemsavingError as error:
    ...     print(type(error).__name__, error.smallest_budget)
    BudgetError 4096
    """

    # AutoGraph re-raises errors from inside tf.function as a generic
    # StagingError unless the class is constructed like Exception; keeping
    # Exception's __init__ lets users catch memsaving's own types there.
    if TYPE_CHECKING:  # the same signature, for mypy (which makes isinstance() of the assigned one Any)
        def __init__(self, *args: object) -> None: ...
    else:
        __init__ = Exception.__init__


class CheckpointError(MemsavingError, ValueError):
    """The checkpoints given or found cannot be used (none found, or not
    between ``xs`` and ``ys``).

    Examples
    --------
    ``checkpoints="speed"`` keeps the outputs of MatMul, Conv and Einsum ops;
    a graph without any has nothing to keep.  The error is raised while the
    step is traced, so it can be caught there:

    >>> import tensorflow as tf
    >>> import memsaving
    >>> @tf.function
    ... def step(x):
    ...     loss = tf.reduce_sum(tf.tanh(x) ** 2)
    ...     try:
    ...         return memsaving.gradients(loss, [x], checkpoints="speed")
    ...     except memsaving.CheckpointError as error:
    ...         print(error)
    ...         return memsaving.gradients(loss, [x], checkpoints="memory")
    >>> step(tf.ones([2, 4]))[0].shape
    checkpoints='speed' found no MatMul/Conv/Einsum op between xs and ys; use checkpoints='memory' or ...
    TensorShape([2, 4])
    """


class UnsupportedGraphError(MemsavingError, NotImplementedError):
    """The forward graph holds a construct the rewrite cannot handle safely.

    TF1-style control flow (``Switch``/``Merge``/``Enter`` ops) is one: the
    message says what to change.  Where the graph cannot be changed, plain
    ``tf.gradients`` still differentiates it.

    Examples
    --------
    >>> import tensorflow as tf
    >>> import memsaving
    >>> def gradients_or_plain(loss, xs):
    ...     try:
    ...         return memsaving.gradients(loss, xs, checkpoints="memory")
    ...     except memsaving.UnsupportedGraphError:
    ...         return tf.gradients(loss, xs)
    >>> @tf.function
    ... def step(x):
    ...     return gradients_or_plain(tf.reduce_sum(tf.tanh(x) ** 2), [x])
    >>> step(tf.zeros([2, 3]))[0].shape
    TensorShape([2, 3])
    """


class PeakMemoryUnavailableError(MemsavingError, RuntimeError):
    """The allocator does not report peak memory in this process.

    :func:`memsaving.measure_peak` raises it for a device whose allocator
    keeps no statistics: on CPU, when ``TF_CPU_ALLOCATOR_USE_BFC`` was not
    ``true`` before TensorFlow started (``import memsaving`` before
    ``import tensorflow`` sets it).

    Examples
    --------
    >>> import tensorflow as tf
    >>> import memsaving
    >>> def peak_or_none(fn):
    ...     try:
    ...         return memsaving.measure_peak(fn)
    ...     except memsaving.PeakMemoryUnavailableError:
    ...         return None
    >>> peak = peak_or_none(lambda: tf.ones([256, 256]))
    >>> peak is None or peak >= 256 * 256 * 4
    True
    """


class PlanWarning(UserWarning):
    """A plan that will run but works against the user: predicted above
    plain ``tf.gradients``' peak (``warnings.simplefilter("error",
    memsaving.PlanWarning)`` turns it into an error).

    Examples
    --------
    ``checkpoints="speed"`` keeps the MatMul outputs, four times as wide as
    the means that read them, which plain backprop frees as soon as the mean
    has read them (a mean's gradient reads no value).  The warning is given
    while the step is traced:

    >>> import warnings
    >>> import tensorflow as tf
    >>> import memsaving
    >>> weights = [tf.Variable(tf.fill([16, 64], 0.01)) for _ in range(4)]
    >>> @tf.function
    ... def step(x):
    ...     h = x
    ...     for w in weights:
    ...         h = tf.reduce_mean(tf.reshape(h @ w, [-1, 4, 16]), axis=1)
    ...     return memsaving.gradients(tf.reduce_sum(h * h), weights, checkpoints="speed")
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always", memsaving.PlanWarning)
    ...     _ = step(tf.ones([256, 16]))
    >>> for warning in seen:
    ...     if issubclass(warning.category, memsaving.PlanWarning):
    ...         print(warning.message)
    memsaving: this plan (mode 'speed') is predicted to peak at ... MiB, above plain tf.gradients' ... MiB ...
    """


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
