"""Measuring the peak memory of a computation with TensorFlow's allocator."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import tensorflow as tf

from memsaving.errors import PeakMemoryUnavailableError


def default_device() -> str:
    """Where peaks are measured by default: the first GPU, else the CPU."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def out_of_memory_raises(device: Optional[str] = None) -> bool:
    """Whether a step that needs more than ``device``'s memory limit fails
    with ``ResourceExhaustedError`` (which a calibration survives: it puts
    the variables back), rather than not failing or ending the process.

    A GPU's allocator has a hard limit and raises.  The CPU's has one only
    under ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, and there oneDNN's kernels end
    the process on an allocation failure (a residual conv net's and a
    depthwise net's plain steps under their caps: a segmentation fault)
    where TensorFlow's own (Eigen) kernels raise.  Whether oneDNN runs is
    TensorFlow's choice when it starts (:func:`onednn_enabled`): on by
    default on x86 CPUs with AVX-512, off on others and under
    ``TF_ENABLE_ONEDNN_OPTS=0``.

    Examples
    --------
    >>> import os
    >>> out_of_memory_raises("CPU:0") == (bool(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB"))
    ...                                   and not onednn_enabled())
    True
    """
    device = device or default_device()
    if "GPU" in device.upper():
        return True
    return bool(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")) and not onednn_enabled()


def onednn_enabled() -> bool:
    """Whether TensorFlow runs oneDNN's CPU kernels in this process.

    TensorFlow decides when it starts, from ``TF_ENABLE_ONEDNN_OPTS`` and,
    when that is unset, from the CPU (on by default where it has AVX-512
    instructions): their work buffers and their failures under a memory
    cap differ from Eigen's.

    Examples
    --------
    >>> isinstance(onednn_enabled(), bool)
    True
    """
    try:
        from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False


def measure_peak(fn: Callable[..., Any], *args, device: Optional[str] = None, **kwargs) -> int:
    """Run ``fn(*args, **kwargs)`` and return the allocator's peak bytes during it.

    The allocator statistics of ``device`` (default: the first GPU, else the
    CPU) are reset first, so the figure is the peak of this call alone.
    Outputs are fetched (``.numpy()``) inside the measurement, so work that
    runs asynchronously is included.

    On CPU the allocator reports memory only when ``TF_CPU_ALLOCATOR_USE_BFC``
    is ``true`` before TensorFlow starts; ``import memsaving`` sets it when it
    is imported before TensorFlow.

    Parameters
    ----------
    fn
        what to measure: a Python function or a ``tf.function`` (a first
        call traces it, and the tracing is measured too).
    *args, **kwargs
        the arguments ``fn`` is called with.
    device : str, optional
        whose allocator to read, such as ``"GPU:0"`` or ``"CPU:0"``
        (default: the first GPU, else the CPU).

    Returns
    -------
    int
        The allocator's peak bytes in use during the call, counting
        everything it held (variables, earlier results) as well:
        :func:`measure_peak_increase` leaves that out.

    Raises
    ------
    PeakMemoryUnavailableError
        the device's allocator keeps no statistics.

    Examples
    --------
    >>> import tensorflow as tf
    >>> import memsaving
    >>> @tf.function
    ... def step(x):
    ...     return tf.reduce_sum(tf.tanh(x @ tf.transpose(x)))
    >>> x = tf.ones([512, 64])
    >>> _ = step(x)  # trace first, so that the figure is the step's alone
    >>> memsaving.measure_peak(step, x) >= 512 * 512 * 4  # the 1 MiB product was held
    True
    """
    device = device or default_device()
    reset_peak(device)
    result = fn(*args, **kwargs)
    tf.nest.map_structure(
        lambda t: t.numpy() if hasattr(t, "numpy") else t,
        result,
    )
    return peak_bytes(device)


def peak_bytes(device: Optional[str] = None) -> int:
    """The device allocator's peak bytes in use since its statistics were
    last reset (:func:`reset_peak`)."""
    return int(tf.config.experimental.get_memory_info(device or default_device())["peak"])


def bytes_in_use(device: Optional[str] = None) -> int:
    """Bytes the device's allocator holds now, or 0 when it keeps no statistics.

    The allocator counts whole chunks, so this includes the rounding and
    fragmentation of what is held, and everything held (other models,
    tensors the caller keeps), which the step's measured peak includes too.
    """
    try:
        return int(tf.config.experimental.get_memory_info(device or default_device())["current"])
    except (ValueError, RuntimeError, tf.errors.OpError):
        return 0


def reset_peak(device: str) -> None:
    """Reset the device's allocator statistics, or explain why there are none."""
    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        raise PeakMemoryUnavailableError(_advice(device, err)) from err


def _advice(device: str, err: Exception) -> str:
    if device.upper().startswith("CPU"):
        state = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
        return (
            f"the CPU allocator keeps no memory statistics ({err}). Set the environment "
            "variable TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts: run "
            "`export TF_CPU_ALLOCATOR_USE_BFC=true` in the shell, or `import memsaving` "
            "before `import tensorflow` (it sets the variable). "
            f"Currently TF_CPU_ALLOCATOR_USE_BFC={state!r}."
        )
    return f"device {device} keeps no memory statistics ({err})."



def measure_peak_increase(fn: Callable[..., Any], *args, device: Optional[str] = None, **kwargs) -> int:
    """Like :func:`measure_peak`, minus the bytes already in use before the call.

    The allocator's peak includes everything allocated earlier, such as model
    variables and results still alive; this is the memory the call itself
    needed (activations, gradients, temporaries).

    Parameters
    ----------
    fn
        what to measure: a Python function or a ``tf.function``.
    *args, **kwargs
        the arguments ``fn`` is called with.
    device : str, optional
        whose allocator to read (default: the first GPU, else the CPU).

    Returns
    -------
    int
        The peak bytes during the call less the bytes in use just before it.

    Raises
    ------
    PeakMemoryUnavailableError
        the device's allocator keeps no statistics.

    Examples
    --------
    A variable held before the call counts in :func:`measure_peak`'s
    figure, not in this one:

    >>> import tensorflow as tf
    >>> import memsaving
    >>> held = tf.Variable(tf.zeros([1024, 1024]))  # 4 MiB
    >>> @tf.function
    ... def step(x):
    ...     return tf.reduce_sum(tf.tanh(x @ tf.transpose(x)))
    >>> x = tf.ones([512, 64])
    >>> _ = step(x)
    >>> increase = memsaving.measure_peak_increase(step, x)
    >>> increase >= 512 * 512 * 4, increase < 4 * 1024 * 1024
    (True, True)
    >>> memsaving.measure_peak(step, x) >= 4 * 1024 * 1024
    True
    """
    device = device or default_device()
    reset_peak(device)  # raises when the allocator keeps no statistics
    before = bytes_in_use(device)
    return measure_peak(fn, *args, device=device, **kwargs) - before
