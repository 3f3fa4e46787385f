"""Replace ``tf.gradients`` by memsaving's gradients, process-wide.

Code that already calls ``tf.gradients`` or ``tf.compat.v1.gradients``
(TF1-style graphs, ``tf.compat.v1.train`` optimizers, helpers in other
libraries) cannot be told to call :func:`memsaving.gradients` instead.
:func:`patch` swaps the function behind those module attributes, so such
code recomputes between checkpoints without being edited; :func:`unpatch`
puts back what was there, and TensorFlow's function wherever memsaving's
own functions were assigned by hand (the TF1 package's
``tf.__dict__["gradients"] = memsaving.gradients_memory``, which
:mod:`memsaving.tf.api_modules` makes effective on ``tensorflow.compat.v1``).

What is replaced, and why only that:

* ``tf.gradients`` and ``tf.compat.v1.gradients`` (and their aliases in the
  already-imported API modules, e.g. ``tf.compat.v2.gradients`` or the module
  bound by ``import tensorflow.compat.v1 as tf1``): the names user code calls;
* ``tensorflow.python.ops.gradients.gradients``: the name TensorFlow's own
  v1 optimizers call (``tf.compat.v1.train.Optimizer.minimize`` and
  ``compute_gradients`` in graph mode), the usual way TF1 code gets gradients.

TensorFlow's definitions in ``tensorflow.python.ops.gradients_impl`` are left
alone: TensorFlow's helpers (``tf.hessians``) call them by that module's
globals, and a module imported while they were patched would keep the
patched function after :func:`unpatch`.  memsaving itself always calls the
originals captured when it was imported, so patching never makes it call
itself.

The patch does not reach ``tf.GradientTape`` (TF2 eager code, Keras 3
``fit``): tapes never go through ``tf.gradients``.  Use
:func:`memsaving.keras.enable` for Keras ``fit``.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import tensorflow as tf

from memsaving.tf.api_modules import gradients_holders
from memsaving.tf.checkpoints import Checkpoints
from memsaving.options import ACCEPTED_KEYWORDS, SHARED_DEFAULTS, accepts_deprecated_keys, shared_options
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.swap_rewrite import SwapOptions
from memsaving.api import (
    DROP_IN_GRADIENTS,
    ORIGINAL_TF_COMPAT_V1_GRADIENTS,
    ORIGINAL_TF_GRADIENTS,
    check_checkpoints_argument,
    gradients as _memsaving_gradients,
)

# Arguments every tf.gradients call brings itself; a patch-wide value for
# them would silently override the caller's.
_PER_CALL = frozenset({"name", "gate_gradients", "aggregation_method", "stop_gradients",
                       "unconnected_gradients", "colocate_gradients_with_ops"})
_PATCH_OPTIONS = frozenset({"budget"}) | (ACCEPTED_KEYWORDS - _PER_CALL)

_lock = threading.RLock()
# (module, what its ``gradients`` was before patch()), in patching order
_saved: List[Tuple[ModuleType, Any]] = []
# arguments of the active patch() (for patched() to restore on exit), or None
_active: Optional[Dict[str, Any]] = None

_do_not_convert = tf.autograph.experimental.do_not_convert


def _make_gradients_v2(checkpoints: Checkpoints, options: Dict[str, Any]) -> Callable[..., list]:
    """memsaving's gradients with ``tf.gradients``' signature (TF2)."""

    def gradients(ys, xs, grad_ys=None, name=None, gate_gradients=False, aggregation_method=None,
                  stop_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        return _memsaving_gradients(
            ys, xs, grad_ys, checkpoints=checkpoints, name=name, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method, stop_gradients=stop_gradients,
            unconnected_gradients=unconnected_gradients, **options)

    gradients.__doc__ = (f"tf.gradients replaced by memsaving.patch(checkpoints={checkpoints!r}): "
                         "memsaving.gradients with tf.gradients' arguments.")
    return _do_not_convert(gradients)


def _make_gradients_v1(checkpoints: Checkpoints, options: Dict[str, Any]) -> Callable[..., list]:
    """memsaving's gradients with ``tf.compat.v1.gradients``' signature."""

    def gradients(ys, xs, grad_ys=None, name=None, colocate_gradients_with_ops=False, gate_gradients=False,
                  aggregation_method=None, stop_gradients=None,
                  unconnected_gradients=tf.UnconnectedGradients.NONE):
        return _memsaving_gradients(
            ys, xs, grad_ys, checkpoints=checkpoints, name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method, stop_gradients=stop_gradients,
            unconnected_gradients=unconnected_gradients, **options)

    gradients.__doc__ = (f"tf.compat.v1.gradients replaced by memsaving.patch(checkpoints={checkpoints!r}): "
                         "memsaving.gradients with tf.compat.v1.gradients' arguments.")
    return _do_not_convert(gradients)


def _tensorflows_own(is_v1: bool) -> Callable[..., list]:
    """TensorFlow's ``gradients`` of the v1 or the v2 API, as captured at import."""
    return ORIGINAL_TF_COMPAT_V1_GRADIENTS if is_v1 else ORIGINAL_TF_GRADIENTS


def _targets() -> List[Tuple[ModuleType, bool]]:
    """Modules to patch, each with True when it holds the v1 function.

    ``tf`` and ``tf.compat.v1`` are always patched, whatever they hold (a
    user's own replacement is saved and restored like the original); the
    other modules only when they still hold TensorFlow's function, so
    unrelated ``gradients`` attributes are never touched.
    """
    always = {id(tf), id(tf.compat.v1)}
    originals = (ORIGINAL_TF_GRADIENTS, ORIGINAL_TF_COMPAT_V1_GRADIENTS)
    return [(module, is_v1) for module, is_v1 in gradients_holders()
            if id(module) in always or vars(module)["gradients"] in originals]


def _take_back_memsaving_functions() -> None:
    """Give TensorFlow's function back to every module holding one of memsaving's.

    A hand-made ``tf.__dict__["gradients"] = memsaving.gradients_memory``
    (before or after :func:`patch`) would otherwise be what :func:`unpatch`
    leaves behind.
    """
    for module, is_v1 in gradients_holders():
        if vars(module)["gradients"] in DROP_IN_GRADIENTS:
            setattr(module, "gradients", _tensorflows_own(is_v1))


def _check_options(checkpoints: Checkpoints, kwargs: Dict[str, Any]) -> None:
    """Fail at patch() time, not at the first tf.gradients call somewhere else."""
    check_checkpoints_argument(checkpoints)
    per_call = sorted(set(kwargs) & _PER_CALL)
    if per_call:
        raise TypeError(
            f"memsaving.patch: {per_call} are arguments of each tf.gradients call and are taken "
            "from the call; pass only memsaving options (budget, batch_size, swap...) to patch()"
        )
    unknown = sorted(set(kwargs) - _PATCH_OPTIONS)
    if unknown:
        raise TypeError(f"memsaving.patch got unexpected keyword argument(s) {unknown}; "
                        f"accepted: checkpoints, {', '.join(sorted(_PATCH_OPTIONS))}")


@accepts_deprecated_keys
def patch(
    checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"],
    *,
    budget: Optional[Union[int, str]] = SHARED_DEFAULTS["budget"],
    swap: Any = SHARED_DEFAULTS["swap"],
    split: Any = SHARED_DEFAULTS["split"],
    batch_size: Optional[int] = SHARED_DEFAULTS["batch_size"],
    profile: Optional[bool] = SHARED_DEFAULTS["profile"],
    planning_time: Optional[float] = SHARED_DEFAULTS["planning_time"],
    multilevel: bool = SHARED_DEFAULTS["multilevel"],
    follow_order: Optional[bool] = SHARED_DEFAULTS["follow_order"],
    keep_x_gradients: bool = SHARED_DEFAULTS["keep_x_gradients"],
    offload_params: bool = SHARED_DEFAULTS["offload_params"],
    swap_options: Optional[SwapOptions] = SHARED_DEFAULTS["swap_options"],
    offload_options: Optional[OffloadOptions] = SHARED_DEFAULTS["offload_options"],
    flops_per_second: Optional[float] = SHARED_DEFAULTS["flops_per_second"],
    bandwidth: Optional[float] = SHARED_DEFAULTS["bandwidth"],
) -> None:
    """Make ``tf.gradients`` and ``tf.compat.v1.gradients`` call memsaving.

    Every later call of ``tf.gradients(...)`` / ``tf.compat.v1.gradients(...)``
    (inside a ``tf.function`` or a ``tf.compat.v1`` graph) builds its backward
    pass with :func:`memsaving.gradients` and these options, so code that
    cannot be edited (TF1-style training loops, ``tf.compat.v1.train``
    optimizers, library helpers) saves memory too.  The replacements keep
    TensorFlow's full signature (``grad_ys``, ``name``, ``gate_gradients``,
    ``aggregation_method``, ``stop_gradients``, ``unconnected_gradients`` and,
    for v1, ``colocate_gradients_with_ops``); their ops are created under the
    name scope ``memsaving_gradients`` unless the caller passes ``name``.

    Not affected: ``tf.GradientTape`` (TF2 eager code, Keras 3 ``fit``), which
    never calls ``tf.gradients`` (use :func:`memsaving.keras.enable` for
    ``fit``); functions imported by name before patching (``from tensorflow
    import gradients``); API modules first imported after patching (a first
    ``import tensorflow.compat.v1 as tf1`` after ``patch()`` gets
    TensorFlow's function: patch after the imports).

    Calling ``patch`` again replaces the options; the originals saved by the
    first call are kept, so one :func:`unpatch` restores them.

    Parameters
    ----------
    checkpoints
        as for :func:`memsaving.gradients`.  ``"memory"``
        (default) suits a process-wide patch: a graph without a cut is
        differentiated without recomputation.  ``"speed"`` and
        ``"collection"`` raise ``CheckpointError`` in calls whose graph has
        no MatMul/Conv or no marked tensor, and every mode raises
        ``UnsupportedGraphError`` on TF1 control flow, exactly as
        :func:`memsaving.gradients` does.
    budget, swap, split, batch_size, profile, planning_time, multilevel, follow_order, keep_x_gradients, offload_params, swap_options, offload_options, flops_per_second, bandwidth
        memsaving options applied to every call, as for
        :func:`memsaving.gradients` (the same names and defaults on every
        entry point).  Per-call arguments (``name``, ``stop_gradients``...)
        come from each ``tf.gradients`` call.

    Raises
    ------
    TypeError
        an unknown option, or a per-call tf.gradients argument.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> memsaving.patch(checkpoints="memory")
    >>> tf.gradients.__doc__.startswith("tf.gradients replaced by memsaving.patch")
    True
    >>> memsaving.unpatch()
    """
    global _active
    kwargs = shared_options(locals(), leave_out=("checkpoints",))
    _check_options(checkpoints, kwargs)
    with _lock:
        unpatch()
        v2 = _make_gradients_v2(checkpoints, dict(kwargs))
        v1 = _make_gradients_v1(checkpoints, dict(kwargs))
        for module, is_v1 in _targets():
            _saved.append((module, vars(module)["gradients"]))
            setattr(module, "gradients", v1 if is_v1 else v2)
        _active = {"checkpoints": checkpoints, **kwargs}


def unpatch() -> None:
    """Give ``tf.gradients`` and its aliases TensorFlow's own functions back.

    What ``gradients`` was in every module :func:`patch` changed comes back
    (the very objects: a user's own replacement too), except memsaving's
    functions: wherever a module holds ``memsaving.gradients``,
    ``gradients_memory``, ``gradients_speed`` or ``gradients_collection``
    (the TF1 package's ``tf.__dict__["gradients"] = ...``, before or after
    :func:`patch`), TensorFlow's function is put back instead.  Does nothing
    when neither was done.

    Examples
    --------
    >>> import memsaving
    >>> memsaving.patch()
    >>> memsaving.unpatch()
    >>> memsaving.unpatch()  # a second call does nothing
    """
    global _active
    with _lock:
        while _saved:
            module, previous = _saved.pop()
            setattr(module, "gradients", previous)
        _take_back_memsaving_functions()
        _active = None


@contextlib.contextmanager
@accepts_deprecated_keys
def patched(
    checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"],
    *,
    budget: Optional[Union[int, str]] = SHARED_DEFAULTS["budget"],
    swap: Any = SHARED_DEFAULTS["swap"],
    split: Any = SHARED_DEFAULTS["split"],
    batch_size: Optional[int] = SHARED_DEFAULTS["batch_size"],
    profile: Optional[bool] = SHARED_DEFAULTS["profile"],
    planning_time: Optional[float] = SHARED_DEFAULTS["planning_time"],
    multilevel: bool = SHARED_DEFAULTS["multilevel"],
    follow_order: Optional[bool] = SHARED_DEFAULTS["follow_order"],
    keep_x_gradients: bool = SHARED_DEFAULTS["keep_x_gradients"],
    offload_params: bool = SHARED_DEFAULTS["offload_params"],
    swap_options: Optional[SwapOptions] = SHARED_DEFAULTS["swap_options"],
    offload_options: Optional[OffloadOptions] = SHARED_DEFAULTS["offload_options"],
    flops_per_second: Optional[float] = SHARED_DEFAULTS["flops_per_second"],
    bandwidth: Optional[float] = SHARED_DEFAULTS["bandwidth"],
) -> Iterator[None]:
    """``with memsaving.patched(...):`` :func:`patch` for the block only.

    On exit (also on an exception) the state before the block comes back:
    the originals, or the options of an enclosing patch.

    Parameters
    ----------
    checkpoints, budget, swap, split, batch_size, profile, planning_time, multilevel, follow_order, \
keep_x_gradients, offload_params, swap_options, offload_options, flops_per_second, bandwidth
        as for :func:`patch` (the options every entry point shares,
        :data:`memsaving.options.SHARED_DEFAULTS`).

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> with memsaving.patched(checkpoints="memory"):
    ...     inside = tf.gradients.__doc__.startswith("tf.gradients replaced")
    >>> inside, tf.gradients.__doc__.startswith("tf.gradients replaced")
    (True, False)
    """
    options = shared_options(locals(), leave_out=("checkpoints",))
    with _lock:
        previous = dict(_active) if _active is not None else None
    patch(checkpoints, **options)
    try:
        yield
    finally:
        unpatch()
        if previous is not None:
            patch(**previous)
