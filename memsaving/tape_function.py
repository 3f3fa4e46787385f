"""``memsaving.function``: ``tf.function`` whose gradients recompute between checkpoints.

Most TensorFlow 2 training code computes its gradients with
``tf.GradientTape`` inside a ``tf.function``.  :func:`function` traces the
same Python function, and while it traces, every ``tape.gradient(...)`` and
every ``tf.gradients(...)`` in it is built by :func:`memsaving.gradients`
with the function's options: the loop switches by changing one decorator.

A tape differentiates only what it recorded; ``tf.gradients`` differentiates
everything between its sources and targets.  The ops the tape did not record
(created before it was entered, or under ``tape.stop_recording()``) are
handed to :func:`memsaving.gradients` as ``stop_gradients``
(:mod:`memsaving.tf.tape_recording`), so the gradients are the tape's.
What cannot be rewritten this way is left to TensorFlow, and
:meth:`MemsavingFunction.explain` says which call and why: eager calls,
tapes recorded by an enclosing tape (higher-order gradients), ``jacobian``,
composite tensors (ragged, sparse), and tensor sources the tape was not
told to watch.

With ``budget=``, the first call calibrates the step against the device's
memory as :func:`memsaving.fit_to_budget` does (every step predicted under
the budget by more than the error known so far; see
:mod:`memsaving.calibration`), and later calls run the calibrated step.

The tape's methods are replaced only while this module traces a function,
and put back when the last trace ends; outside a trace they are
TensorFlow's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple, Union

import tensorflow as tf
from tensorflow.python import pywrap_tfe  # pylint: disable=no-name-in-module
from tensorflow.python.eager import backprop  # pylint: disable=no-name-in-module

from memsaving.api import check_checkpoints_argument, gradients_and_plan
from memsaving.fit_budget import WatchedStep, calibrate_step
from memsaving.options import SHARED_DEFAULTS, accepts_deprecated_keys, shared_options
from memsaving.patching import patched
from memsaving.planners.budget import parse_bytes
from memsaving.planners.planning import Plan
from memsaving.tf.checkpoints import Checkpoints
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.swap_rewrite import SwapOptions
from memsaving.tf.tape_recording import TapeRecord, unrecorded_boundary

_GradientTape = backprop.GradientTape


@dataclass(frozen=True)
class GradientSettings:
    """The memsaving options one :func:`function` applies to its gradient calls:
    ``checkpoints``, ``budget`` and the others of
    :data:`memsaving.options.SHARED_DEFAULTS` (in ``others``, unset ones left out)."""

    checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"]
    budget: Optional[Union[int, str]] = SHARED_DEFAULTS["budget"]
    others: Tuple[Tuple[str, Any], ...] = ()

    def keywords(self) -> Dict[str, Any]:
        """The options besides ``checkpoints`` as keywords of :func:`memsaving.gradients`."""
        return dict(self.others, **({} if self.budget is None else {"budget": self.budget}))


@dataclass
class GradientCall:
    """One gradient call met while tracing: rewritten (with its plan) or left to TensorFlow (with why)."""

    where: str
    plan: Optional[Plan] = None
    left_to_tensorflow: str = ""

    def describe(self) -> str:
        if self.plan is None:
            return f"{self.where}: computed by TensorFlow ({self.left_to_tensorflow})"
        return f"{self.where}: rewritten by memsaving\n" + _indent(self.plan.table())


@dataclass
class _Trace:
    """What one trace of a :func:`function` sees: its settings, the tapes it
    watched being recorded, and the gradient calls it made."""

    settings: GradientSettings
    tapes: "weakref.WeakKeyDictionary[Any, TapeRecord]" = field(default_factory=weakref.WeakKeyDictionary)
    calls: List[GradientCall] = field(default_factory=list)


_TRACING: contextvars.ContextVar[Optional[_Trace]] = contextvars.ContextVar("memsaving_function_trace",
                                                                           default=None)


# ----------------------------------------------------------------------------- the tape's methods while tracing


def _push_tape(tape: Any) -> None:
    _TAPE_METHODS["_push_tape"](tape)
    trace = _TRACING.get()
    if trace is not None and not tf.executing_eagerly():
        record = trace.tapes.get(tape)
        if record is None:
            record = trace.tapes[tape] = TapeRecord(tf.compat.v1.get_default_graph())
        record.start()


def _pop_tape(tape: Any) -> None:
    _TAPE_METHODS["_pop_tape"](tape)
    trace = _TRACING.get()
    record = trace.tapes.get(tape) if trace is not None else None
    if record is not None:
        record.stop()


def _watch(tape: Any, tensor: Any) -> None:
    _TAPE_METHODS["watch"](tape, tensor)
    trace = _TRACING.get()
    record = trace.tapes.get(tape) if trace is not None else None
    if record is not None:
        record.watch(tf.nest.flatten(tensor))


def _jacobian(tape: Any, *args: Any, **kwargs: Any) -> Any:
    trace = _TRACING.get()
    if trace is not None:
        trace.calls.append(GradientCall("tape.jacobian", left_to_tensorflow="jacobians are not rewritten"))
    return _TAPE_METHODS["jacobian"](tape, *args, **kwargs)


def _gradient(tape: Any, target: Any, sources: Any, output_gradients: Any = None,
              unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE) -> Any:
    """``GradientTape.gradient`` while a :func:`function` traces: memsaving's
    gradients where the tape's can be reproduced exactly, TensorFlow's otherwise."""
    trace = _TRACING.get()
    record = trace.tapes.get(tape) if trace is not None else None
    why = _why_not_rewritten(tape, record, target, sources)
    if why:
        if trace is not None:
            trace.calls.append(GradientCall("tape.gradient", left_to_tensorflow=why))
        return _TAPE_METHODS["gradient"](tape, target, sources, output_gradients, unconnected_gradients)
    assert trace is not None and record is not None
    if tape._tape is None:  # pylint: disable=protected-access  # TensorFlow's own check, same words
        raise RuntimeError("A non-persistent GradientTape can only be used to compute one set of gradients "
                           "(or jacobians)")
    if tape._recording and not tape._persistent:  # pylint: disable=protected-access
        tape._pop_tape()  # pylint: disable=protected-access  # as TensorFlow does: stop recording first
    if _another_tape_records(tape, trace):
        trace.calls.append(GradientCall("tape.gradient", left_to_tensorflow="an enclosing tape records this "
                                        "gradient (higher-order gradients)"))
        return _TAPE_METHODS["gradient"](tape, target, sources, output_gradients, unconnected_gradients)
    flat_sources = tf.nest.flatten(sources)
    watched = {id(v) for v in tape.watched_variables()}
    connected = [s for s in flat_sources if id(_variable_of(s)) in watched or record.is_watched(s)]
    ys = tf.nest.flatten(target)
    xs_graph = [s.handle if hasattr(s, "handle") else s for s in connected]
    stops = unrecorded_boundary([tf.convert_to_tensor(y) for y in ys], xs_graph, record.recorded_op_names())
    grads: List[Any] = []
    if connected:
        grads, plan = gradients_and_plan(
            ys, connected, None if output_gradients is None else tf.nest.flatten(output_gradients),
            checkpoints=trace.settings.checkpoints, stop_gradients=stops,
            unconnected_gradients=unconnected_gradients, **trace.settings.keywords())
        trace.calls.append(GradientCall("tape.gradient", plan=plan))
    if not tape._persistent:  # pylint: disable=protected-access
        tape._watched_variables = tape._tape.watched_variables()  # pylint: disable=protected-access
        tape._tape = None  # pylint: disable=protected-access  # used up, as TensorFlow marks it
    by_source = dict(zip(map(id, connected), grads))
    flat = [by_source[id(s)] if id(s) in by_source else _unconnected(s, unconnected_gradients)
            for s in flat_sources]
    return tf.nest.pack_sequence_as(sources, flat)


_TAPE_REPLACEMENTS: Dict[str, Callable[..., Any]] = {
    "_push_tape": _push_tape, "_pop_tape": _pop_tape, "watch": _watch, "gradient": _gradient,
    "jacobian": _jacobian,
}
_TAPE_METHODS: Dict[str, Callable[..., Any]] = {name: getattr(_GradientTape, name) for name in _TAPE_REPLACEMENTS}
"""TensorFlow's own methods, captured at import."""

_lock = threading.Lock()
_traces_running = [0]


@contextlib.contextmanager
def _tape_methods_replaced() -> Iterator[None]:
    """The tape's methods replaced while at least one trace runs."""
    with _lock:
        if _traces_running[0] == 0:
            for name, method in _TAPE_REPLACEMENTS.items():
                setattr(_GradientTape, name, method)
        _traces_running[0] += 1
    try:
        yield
    finally:
        with _lock:
            _traces_running[0] -= 1
            if _traces_running[0] == 0:
                for name, method in _TAPE_METHODS.items():
                    setattr(_GradientTape, name, method)


def _why_not_rewritten(tape: Any, record: Optional[TapeRecord], target: Any, sources: Any) -> str:
    """Why this ``tape.gradient`` call is left to TensorFlow ('' when it is rewritten)."""
    if tf.executing_eagerly():
        return "called eagerly"
    if record is None:
        return "the tape was entered before the function started tracing"
    if record.graph is not tf.compat.v1.get_default_graph():
        return "the tape recorded another graph"
    if target is None:
        return "no target"  # TensorFlow raises its own TypeError
    flat = tf.nest.flatten(target) + tf.nest.flatten(sources)
    if any(isinstance(t, tf.Variable) for t in tf.nest.flatten(target)):
        return "a variable as target"  # TensorFlow raises its own ValueError
    if any(isinstance(t, tf.__internal__.CompositeTensor) and _variable_of(t) is None for t in flat):
        return "composite tensors (ragged, sparse) among targets or sources"
    for source in tf.nest.flatten(sources):
        if _variable_of(source) is None and not record.is_watched(source):
            return "a tensor source the tape was not told to watch"
    return ""


def _another_tape_records(tape: Any, trace: _Trace) -> bool:
    """A tape other than ``tape`` is recording: it would record these gradients (higher order)."""
    if any(other is not tape and record.recording for other, record in trace.tapes.items()):
        return True
    return not tape._recording and not pywrap_tfe.TFE_Py_TapeSetIsEmpty()  # pylint: disable=protected-access


def _variable_of(source: Any) -> Any:
    """The variable behind a source (a Keras variable wraps a tf.Variable), else None."""
    if isinstance(source, tf.Variable):
        return source
    value = getattr(source, "value", None)
    return value if isinstance(value, tf.Variable) else None


def _unconnected(source: Any, unconnected_gradients: tf.UnconnectedGradients) -> Any:
    """What the tape gives a source it did not watch."""
    if unconnected_gradients == tf.UnconnectedGradients.ZERO:
        return tf.zeros_like(source)
    return None


# ----------------------------------------------------------------------------- the public function


class MemsavingFunction:
    """A traced step whose gradients memsaving builds (what :func:`function` returns).

    Called like the ``tf.function`` it wraps; other attributes
    (``get_concrete_function``, ``python_function``, ...) are the
    ``tf.function``'s.  With a budget, the first call calibrates
    (:func:`memsaving.fit_to_budget`) and :attr:`calibration` holds the
    record.  Made by :func:`function`, not constructed directly.

    Parameters
    ----------
    python_function
        the user's step.
    settings
        the memsaving options its gradient calls get.
    tf_function_options
        the keywords of ``tf.function``.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> step = memsaving.function(lambda x: x * 2.0)
    >>> isinstance(step, memsaving.MemsavingFunction), float(step(tf.constant(1.0)))
    (True, 2.0)
    """

    def __init__(self, python_function: Callable[..., Any], settings: GradientSettings,
                 tf_function_options: Dict[str, Any]) -> None:
        self._python_function = python_function
        self._settings = settings
        self._options = tf_function_options
        self._calls: List[GradientCall] = []
        functools.update_wrapper(self, python_function)
        self._traced = tf.function(self._tracing_body, **tf_function_options)
        self._fitted: Optional[WatchedStep] = None

    def _tracing_body(self, *args: Any, **kwargs: Any) -> Any:
        """The user's function, traced with the tape's methods and ``tf.gradients`` rewritten."""
        trace = _Trace(self._settings)
        token = _TRACING.set(trace)
        try:
            with _tape_methods_replaced(), patched(self._settings.checkpoints, **self._settings.keywords()):
                return self._python_function(*args, **kwargs)
        finally:
            _TRACING.reset(token)
            self._calls.extend(trace.calls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._settings.budget is None:
            return self._traced(*args, **kwargs)
        if self._fitted is None:
            # the calibration's own steps are undone, so that this call is the first step that counts
            name = getattr(self._python_function, "__name__", "step")
            self._fitted = calibrate_step(self._tracing_body, args, kwargs, budget=self._settings.budget,
                                          restore_variables=True, caller=f"memsaving.function ({name})")
        return self._fitted(*args, **kwargs)

    @property
    def plans(self) -> List[Plan]:
        """The plans of the gradient calls memsaving rewrote in the traces so far
        (those left to TensorFlow have none), in the order they were met.

        Examples
        --------
        >>> import tensorflow as tf, memsaving
        >>> w = tf.Variable(tf.ones([4, 4]))
        >>> @memsaving.function(checkpoints="memory")
        ... def step(x):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_sum(tf.tanh(x @ w))
        ...     return tape.gradient(loss, w)
        >>> _ = step(tf.ones([2, 4]))
        >>> [plan.mode for plan in step.plans]
        ['memory']
        """
        return [call.plan for call in self._calls if call.plan is not None]

    @property
    def calibration(self) -> Any:
        """The budget's calibration record (:class:`memsaving.fit_budget.Calibration`), after the first call."""
        return None if self._fitted is None else self._fitted.calibration

    def explain(self, file: Optional[TextIO] = None) -> str:
        """Print (to ``file``, default stdout) and return each gradient call met
        while tracing: its plan, or why TensorFlow computed it.

        Examples
        --------
        >>> import io, tensorflow as tf, memsaving
        >>> w = tf.Variable(tf.ones([4, 4]))
        >>> @memsaving.function(checkpoints="memory")
        ... def step(x):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_sum(tf.tanh(x @ w))
        ...     return tape.gradient(loss, w)
        >>> _ = step(tf.ones([2, 4]))
        >>> print(step.explain(file=io.StringIO()).splitlines()[0])
        tape.gradient: rewritten by memsaving
        """
        if not self._calls:
            text = "No gradient call traced yet: call the function first.\n"
        else:
            text = "\n".join(call.describe() for call in self._calls) + "\n"
        (file if file is not None else sys.stdout).write(text)
        return text

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._traced, name)


@accepts_deprecated_keys
def function(
    func: Optional[Callable[..., Any]] = None,
    *,
    checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"],
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
    input_signature: Optional[Sequence[Any]] = None,
    autograph: bool = True,
    jit_compile: Optional[bool] = None,
    reduce_retracing: bool = False,
    experimental_implements: Optional[str] = None,
    experimental_autograph_options: Any = None,
    experimental_attributes: Optional[Dict[str, Any]] = None,
    experimental_follow_type_hints: Optional[bool] = None,
) -> Any:
    """A drop-in for ``tf.function`` whose ``tape.gradient`` and ``tf.gradients`` calls recompute between checkpoints.

    Replace ``@tf.function`` by ``@memsaving.function(...)`` on a training
    step: while the step is traced, each ``tf.GradientTape.gradient`` and
    ``tf.gradients`` in it is built by :func:`memsaving.gradients` with
    these options, giving the same gradients with lower peak memory.
    Persistent tapes, several tapes, ``watch``, ``stop_recording`` and
    unconnected sources behave as under ``tf.function``.  Calls that cannot
    be rewritten exactly (higher-order gradients through nested tapes,
    ``jacobian``, ragged or sparse sources, unwatched tensor sources, eager
    calls) are computed by TensorFlow as before; :meth:`MemsavingFunction.explain`
    lists every call and says which.

    Parameters
    ----------
    func
        the Python function (or a ``tf.function``, unwrapped); omitted when
        used as ``@memsaving.function(...)``.
    checkpoints
        as for :func:`memsaving.gradients`; ``"memory"`` by default.
    budget
        bytes, or a string such as ``"2GiB"``: the first call calibrates the
        step so that its measured peak stays under the budget, approached
        from below (:func:`memsaving.fit_to_budget`, whose rules apply:
        the first call runs the step for real while it measures).
    swap, split, batch_size, profile, planning_time, multilevel, follow_order, keep_x_gradients, offload_params, swap_options, offload_options, flops_per_second, bandwidth
        as for :func:`memsaving.gradients` (the same options, names and
        defaults on every entry point).
    input_signature, autograph, reduce_retracing, experimental_implements, experimental_autograph_options, experimental_attributes, experimental_follow_type_hints
        as for ``tf.function``.
    jit_compile
        ``True`` is refused: XLA schedules the step itself and ignores the
        planned recomputation.

    Returns
    -------
    MemsavingFunction
        or, when ``func`` is omitted, a decorator that makes one.

    Raises
    ------
    ValueError
        ``jit_compile=True``, a bad budget.
    memsaving.CheckpointError
        a bad ``checkpoints`` value.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> w = tf.Variable(tf.fill([8, 8], 0.1))
    >>> @memsaving.function(checkpoints="memory")
    ... def train_step(x):
    ...     with tf.GradientTape() as tape:
    ...         h = x
    ...         for _ in range(6):
    ...             h = tf.tanh(h @ w)
    ...         loss = tf.reduce_sum(h * h)
    ...     w.assign_sub(0.01 * tape.gradient(loss, w))
    ...     return loss
    >>> float(train_step(tf.ones([4, 8]))) > 0
    True
    """
    if jit_compile:
        raise ValueError("memsaving.function(jit_compile=True): XLA compiles the step with its own schedule and "
                         "ignores the recomputation memsaving plans; leave jit_compile unset (or False)")
    check_checkpoints_argument(checkpoints)
    if budget is not None:
        parse_bytes(budget)  # a bad budget fails here, not at the first call
    others = shared_options(locals(), leave_out=("checkpoints", "budget"))
    settings = GradientSettings(checkpoints=checkpoints, budget=budget, others=tuple(others.items()))
    options: Dict[str, Any] = dict(input_signature=input_signature, autograph=autograph, jit_compile=jit_compile,
                                   reduce_retracing=reduce_retracing, experimental_implements=experimental_implements,
                                   experimental_autograph_options=experimental_autograph_options,
                                   experimental_attributes=experimental_attributes,
                                   experimental_follow_type_hints=experimental_follow_type_hints)

    def make(python_function: Callable[..., Any]) -> MemsavingFunction:
        if not callable(python_function):
            raise TypeError(f"memsaving.function expects a Python function, got {type(python_function).__name__}")
        return MemsavingFunction(getattr(python_function, "python_function", python_function), settings, options)

    return make if func is None else make(func)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
