"""Keras 3 (TensorFlow backend): train with memsaving in one line.

``memsaving.keras.enable(model)`` replaces the model's train step by one
that computes the loss exactly as Keras does, but its gradients with
:func:`memsaving.gradients` (recomputing between checkpoints) instead of a
GradientTape.  ``fit``, ``train_on_batch``, optimizers, losses, metrics and
loss scaling work unchanged.  ``disable(model)`` restores Keras' own step.

When the step is traced, the plan's predicted peak is logged (and printed
with ``verbose=True``, once per batch size); :func:`plan_of` returns the plan.

Under ``fit``, Keras usually traces the step with an unknown (None) batch
dimension (a dataset's spec, or arrays whose last batch is partial), so the
planner cannot read the batch from the graph, and sizing it as 1 would make
a budget plan that runs out of memory at the real batch.  ``enable``
therefore also wraps the model's ``fit`` and ``train_on_batch`` (only to look
at their arguments) and sizes the plan for the batch the data will have (see
:func:`data_batch_size`); the plan records it as ``plan.batch_size``, and
where it came from as ``plan.batch_source``.

With a ``budget``, the budget is made to hold as *measured*, approached
from below with the rule :func:`memsaving.fit_to_budget` follows
(:mod:`memsaving.calibration`): the first plan leaves room for the model's
known error, the first steps each newly traced train function runs are
measured on the allocator, and the step is traced (and planned) again for
a higher or lower plan until one uses the budget (see :class:`_Calibrator`).

With ``offload_params=True`` the model's variables and the optimizer's
state live on a host device (``offload_device``): they are moved there
before the train function is built, every weight is copied to the
accelerator before its forward use and again before its backward use, and
the optimizer's update runs on the host (:mod:`memsaving.offload`).
``disable`` moves them back to the default device.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
import types
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from memsaving.planners.budget import format_bytes, parse_bytes
from memsaving.errors import BudgetError, PeakMemoryUnavailableError
from memsaving.calibration import CalibrationRound, Calibrator, Next, PeakRise
from memsaving.fit_budget import (MEASURED_STEPS, Calibration, calibration_error, held_room, planned_target,
                                  planning_target, predicted_figures, recomputes_nothing, refusal, restore_values,
                                  snapshot_values)
from memsaving.api import gradients_and_plan
from memsaving.offload import offload_step, step_model
from memsaving.tf.forward import ops_made_in
from memsaving.tf.measure import bytes_in_use, default_device, out_of_memory_raises, peak_bytes, reset_peak
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.placement import bytes_of, place_optimizer, place_variables, same_device
from memsaving.planners.planning import Plan
from memsaving.options import SHARED_DEFAULTS, accepts_deprecated_keys, option_keywords, parse_options
from memsaving.tf.checkpoints import Checkpoints
from memsaving.tf.swap_rewrite import SwapOptions

logger = logging.getLogger("memsaving")

_SETTINGS = "_memsaving_settings"
_PLAN = "_memsaving_plan"


@accepts_deprecated_keys
def enable(
    model: keras.Model,
    *,
    verbose: bool = True,
    calibration_rounds: int = 4,
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
) -> keras.Model:
    """Make ``model.fit`` / ``train_on_batch`` compute gradients with memsaving.

    Parameters
    ----------
    model : keras.Model
        a compiled or uncompiled Keras model (Sequential, functional or
        subclassed) on the TensorFlow backend.
    checkpoints, budget
        as for :func:`memsaving.gradients`.
    swap
        host swapping, as for :func:`memsaving.gradients` (``True``,
        ``"auto"`` with ``budget``, or ``False``).
    batch_size : int, optional
        the batch size the plan is made for when the traced batch
        dimension is unknown, as it usually is under ``fit``.  Default: found from
        the data given to ``fit`` / ``train_on_batch`` (their ``batch_size``,
        Keras' default 32, a dataset's batch, a generator's or PyDataset's
        first batch, the rows given to ``train_on_batch``).  When given, it
        always wins over what is found.  Every unknown dimension, including
        unknown non-batch ones such as a variable sequence length, is sized
        with it.
    verbose : bool
        print the plan's predicted peak when the step is traced, and
        one line per calibration round.
    calibration_rounds : int
        with ``budget``, how many plans are measured at most
        (0: plan as predicted, never measure).  No step runs whose plan is
        predicted over the budget, or under it by less than the known error
        (the model's, then the one measured): such a budget is refused with
        ``memsaving.BudgetError`` before the first step, except that where
        running out of memory raises (a GPU), the lowest plan the model's
        prior error forbids is measured once as a probe when it is
        predicted under the budget less the headroom (kept if it fits,
        else refused with its steps undone).  The first plan
        leaves room for that error; the first three steps each traced train
        function runs are measured with the allocator (the highest peak
        counts; the whole device: weights, optimizer slots and data count),
        and the step is traced again, once, for a higher plan (the error
        measured allows it), or for a lower one (over the budget, less 2%)
        until one fits.  Those steps are real training steps.  A
        step that runs out of memory while calibrating puts the variables
        back as they were when ``fit`` began, and ``fit`` starts again on a
        lower plan.  The error lists every round; its ``smallest_budget`` is
        the lowest peak measured plus room for its variation.
        :func:`calibration_of` returns the rounds; calling ``enable`` again
        starts a new calibration.
    planning_time : float or None
        the seconds of simulation each plan may spend, as for
        :func:`memsaving.gradients` (default 30; None: no limit).
    offload_params : bool
        keep the model's variables and the optimizer's state on
        the host device (``offload_options.device``, default ``"/CPU:0"``)
        and copy each weight to the accelerator right
        before its forward use and again before its backward use; the
        optimizer's update runs there too (:mod:`memsaving.offload`).  The
        plan's ``offload`` field holds the predicted device peak and step
        time.  Training is unchanged, to the bit.
    offload_options : memsaving.tf.offload.OffloadOptions, optional
        the host device and when weights are copied; the accelerator is the
        first GPU (the CPU on a machine without one).  ``offload_device=``
        of earlier versions still works, with a ``DeprecationWarning``.
    profile, follow_order, keep_x_gradients, swap_options, flops_per_second, bandwidth
        as for :func:`memsaving.gradients` (the same options, names and
        defaults on every entry point).
    split : None or "auto"
        ``"auto"``: split the operations that hold the most into pieces
        of rows when the budget cannot fit otherwise (without a budget,
        when that lowers the predicted peak), as for
        :func:`memsaving.gradients` (``split=``); not with
        ``offload_params`` yet.
    multilevel : bool
        allow multi-level plans under a budget, as for
        :func:`memsaving.gradients` (off by default: their peaks err more).

    Notes
    -----
    XLA (``jit_compile=True``) schedules the whole step itself and would
    ignore the recomputation order, so it is turned off for this model
    (``disable`` restores it).  Returns ``model``.

    Examples
    --------
    One line before ``fit``; the training is the same, with less memory:

    >>> import keras
    >>> import numpy as np
    >>> import memsaving.keras
    >>> model = keras.Sequential([keras.Input((16,))]
    ...                          + [keras.layers.Dense(16, activation="tanh") for _ in range(8)]
    ...                          + [keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> model = memsaving.keras.enable(model, checkpoints="memory", verbose=False)
    >>> history = model.fit(np.ones((32, 16)), np.zeros((32, 1)), batch_size=8, epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2

    ``memsaving.keras.disable(model)`` restores plain gradients.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"memsaving.keras needs the TensorFlow backend of Keras, not {keras.backend.backend()!r}: "
            "set KERAS_BACKEND=tensorflow before importing keras."
        )
    if swap == "auto" and budget is None:
        raise ValueError("memsaving.keras.enable(swap='auto') needs budget= (e.g. budget='2GiB')")
    if isinstance(calibration_rounds, bool) or not isinstance(calibration_rounds, int) or calibration_rounds < 0:
        raise ValueError(f"calibration_rounds={calibration_rounds!r}: give an int >= 0, how many measured "
                         "plans may be above the budget in a row (0 turns measuring off)")
    if split is not None and split != "auto":
        raise ValueError(f"memsaving.keras.enable(split={split!r}): give split='auto' (the planner splits what a "
                         "budget cannot fit otherwise) or leave it out; name ops to split with "
                         "memsaving.gradients(..., split={op: pieces}) in a custom training step")
    options = option_keywords(profile=profile, follow_order=follow_order, keep_x_gradients=keep_x_gradients,
                              swap_options=swap_options, flops_per_second=flops_per_second, bandwidth=bandwidth)
    # bad values fail here, not at the first step
    parse_options({"planning_time": planning_time, "split": split, "swap": swap or None, "multilevel": multilevel,
                   "offload_params": offload_params or None, "offload_options": offload_options, **options})
    offload = (offload_options or OffloadOptions()) if offload_params else None
    if offload is not None and same_device(offload.device, default_device()):
        logger.warning("memsaving.keras.enable: the offload device %s is the accelerator itself; the weights are "
                       "copied but no memory is saved", offload.device)
    calibrator = None
    if budget is not None and calibration_rounds:
        calibrator = _Calibrator(parse_bytes(budget), calibration_rounds)  # a bad budget fails here
    previous = getattr(model, _SETTINGS, None)
    settings = {
        "checkpoints": checkpoints,
        "budget": budget,
        "swap": swap,
        "batch_size": batch_size,
        "verbose": verbose,
        "planning_time": planning_time,
        "split": split,
        "multilevel": multilevel,
        "options": options,
        "calibrator": calibrator,
        "offload": offload,
        "jit_compile": previous["jit_compile"] if previous else model.jit_compile,
    }
    object.__setattr__(model, _SETTINGS, settings)
    if model.jit_compile:
        logger.warning("memsaving.keras.enable: turning off jit_compile (XLA would ignore the recomputation)")
        model.jit_compile = False
    object.__setattr__(model, "train_step", types.MethodType(_train_step, model))
    object.__setattr__(model, "fit", types.MethodType(_fit, model))
    object.__setattr__(model, "train_on_batch", types.MethodType(_train_on_batch, model))
    object.__setattr__(model, "make_train_function", types.MethodType(_make_train_function, model))
    if previous is not None and previous.get("offload") is not None and offload is None:
        _place(model, "/" + default_device())  # offloaded by an earlier enable()
    if offload is not None:
        _place(model, offload.device)
    model.train_function = None  # rebuilt by the next fit / train_on_batch
    return model


def disable(model: keras.Model) -> keras.Model:
    """Undo :func:`enable`: Keras' own train step, fit, train_on_batch and jit_compile setting.

    Parameters
    ----------
    model : keras.Model
        a model given to :func:`enable` (or not).

    Examples
    --------
    >>> import keras, numpy as np, memsaving.keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = memsaving.keras.enable(model, verbose=False)
    >>> memsaving.keras.is_enabled(memsaving.keras.disable(model))
    False
    """
    settings = model.__dict__.pop(_SETTINGS, None)
    for name in ("train_step", "fit", "train_on_batch", "make_train_function", _PLAN):
        model.__dict__.pop(name, None)
    if settings is not None and settings.get("offload") is not None:
        _place(model, "/" + default_device())
    if settings is not None and settings["jit_compile"] is not None:
        model.jit_compile = settings["jit_compile"]
    model.train_function = None
    return model


def is_enabled(model: keras.Model) -> bool:
    """True when ``model`` trains through memsaving.

    Parameters
    ----------
    model : keras.Model
        a model given to :func:`enable` (or not).

    Examples
    --------
    >>> import keras, numpy as np, memsaving.keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = memsaving.keras.enable(model, verbose=False)
    >>> memsaving.keras.is_enabled(model)
    True
    """
    return _SETTINGS in model.__dict__


def plan_of(model: keras.Model) -> Optional[Plan]:
    """The plan of the last traced train step (None before the first step).

    ``plan.batch_size`` is the batch the plan was sized for and
    ``plan.batch_source`` says where that number came from (``"fit(batch_size=8)"``,
    ``"traced input shape"``, ...).

    Parameters
    ----------
    model : keras.Model
        a model given to :func:`enable` (or not).

    Examples
    --------
    >>> import keras, numpy as np, memsaving.keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = memsaving.keras.enable(model, verbose=False)
    >>> _ = model.fit(np.ones((8, 4)), np.zeros((8, 1)), batch_size=4, verbose=0)
    >>> memsaving.keras.plan_of(model).batch_size
    4
    """
    return model.__dict__.get(_PLAN)


def calibration_of(model: keras.Model) -> Optional[Calibration]:
    """The measured calibration rounds of ``enable(model, budget=...)`` (None without a budget).

    ``.rounds`` lists, per measured plan, the budget it was planned for, its
    predicted and its measured peak; ``.chosen`` is the round whose plan
    runs once calibration is over; ``.fits`` says whether it fits.

    Parameters
    ----------
    model : keras.Model
        a model given to :func:`enable` (or not).

    Examples
    --------
    >>> import keras, numpy as np, memsaving.keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = memsaving.keras.enable(model, verbose=False)
    >>> memsaving.keras.calibration_of(model) is None  # no budget, no calibration
    True
    """
    settings = model.__dict__.get(_SETTINGS)
    calibrator = settings and settings.get("calibrator")
    return calibrator.report if calibrator else None


def _first_leaf(data: Any) -> Any:
    """The first array-like leaf (something with a non-empty shape) of ``data``."""
    for leaf in keras.tree.flatten(data):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return leaf
    return None


def _leading_dim(data: Any) -> Optional[int]:
    """The first dimension of ``data``'s first array, None when unknown."""
    leaf = _first_leaf(data)
    if leaf is None:
        return None
    dim = leaf.shape[0]
    return None if dim is None else int(dim)


def _static_batch(x) -> Optional[int]:
    first = next((t for t in tf.nest.flatten(x) if t is not None and hasattr(t, "shape")), None)
    if first is None or not len(first.shape):
        return None
    return first.shape[0]


def _num_rows(x: Any) -> Optional[int]:
    """Samples in array-like training data (numpy/tensors, nested, or a list of strings)."""
    rows = _leading_dim(x)
    if rows is not None:
        return rows
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (str, bytes, int, float)) for v in x):
        return len(x)  # e.g. raw text for a keras_hub task
    return None


_UNCHANGED_BATCH = ("_MapDataset", "_ParallelMapDataset")
"""tf.data transformations, besides the structure-preserving ones, that keep
the batch of their input (a map sees whole batches after ``batch``)."""


def _dataset_batch_from_structure(dataset: tf.data.Dataset) -> Optional[int]:
    """The ``batch_size`` of the last ``batch``/``padded_batch`` in ``dataset``'s pipeline.

    tf.data has no public accessor for it, so this walks the pipeline
    through the private ``_input_dataset`` / ``_batch_size`` attributes
    (stable since TF 2.0), but only through transformations that keep the
    batch (prefetch, shuffle, repeat, cache, take, map, ...): anything else
    (unbatch, rebatch, flat_map, group_by_window, zip, sources) gives None.
    Reading the first element instead would advance a shuffle's seed and
    change the order of training data compared with plain Keras.

    Raises AttributeError / TypeError when TensorFlow's internals differ.
    """
    node = dataset
    for _ in range(1000):
        size = getattr(node, "_batch_size", None)
        if size is not None and type(node).__name__.endswith("BatchDataset"):
            value = tf.get_static_value(size)
            return None if value is None else int(value)
        bases = {c.__name__ for c in type(node).__mro__}
        if "UnaryUnchangedStructureDataset" not in bases and type(node).__name__ not in _UNCHANGED_BATCH:
            return None
        node = node._input_dataset  # pylint: disable=protected-access
    return None


def _dataset_batch(dataset: tf.data.Dataset) -> Tuple[Optional[int], str]:
    """The batch of a tf.data dataset: static shape, pipeline, or first element."""
    spec = _first_leaf(dataset.element_spec)
    if spec is not None and spec.shape[0] is not None:
        return int(spec.shape[0]), "dataset element_spec"
    try:
        size = _dataset_batch_from_structure(dataset)
    except (AttributeError, TypeError, ValueError) as error:
        logger.warning("memsaving.keras: could not read the batch size from the tf.data pipeline (%s); "
                       "reading its first batch instead. Pass enable(batch_size=N) to skip this.", error)
        size = None
    if size is not None:
        return size, "dataset batch()"
    logger.info("memsaving.keras: the dataset's batch size is not in its element_spec; reading its first "
                "batch to find it (this advances an unseeded shuffle; pass enable(batch_size=N) to skip it)")
    for element in dataset.take(1):
        return _leading_dim(element), "dataset's first batch"
    return None, "empty dataset"


def _replay(first: Any, rest) -> Any:
    """A generator yielding ``first`` then the rest of ``rest`` (so peeking loses nothing)."""
    yield first
    yield from rest


def data_batch_size(
    x: Any,
    y: Any = None,
    batch_size: Optional[int] = None,
    steps_per_epoch: Optional[int] = None,
    validation_split: float = 0.0,
) -> Tuple[Optional[int], str, Any]:
    """The batch ``fit(x, y, batch_size=...)`` will feed the train step.

    Keras traces its step with an unknown batch dimension, so memsaving has
    to know from the data how large a batch is: numpy arrays / tensors are
    cut into ``batch_size`` rows (Keras' default 32, or
    ``ceil(n / steps_per_epoch)``), never more than the training rows; a
    tf.data dataset gives its batch in its element_spec or its ``batch()``
    (else its first element is read); a generator or PyDataset, its first
    batch (the generator is re-wrapped so nothing is lost).

    Returns ``(batch, source, x)``: the batch (None when not found), a short
    description of where it came from, and ``x`` to pass on (a generator is
    replaced by one that replays the peeked batch).
    """
    if isinstance(x, tf.data.Dataset):
        batch, source = _dataset_batch(x)
        return batch, source, x
    if isinstance(x, keras.utils.PyDataset):
        return _leading_dim(x[0]), "PyDataset's first batch", x
    if isinstance(x, types.GeneratorType):
        try:
            first = next(x)
        except StopIteration:
            return None, "empty generator", (item for item in ())  # Keras reports the empty generator
        return _leading_dim(first), "generator's first batch", _replay(first, x)
    rows = _num_rows(x)
    if rows is None and y is not None:
        rows = _num_rows(y)
    if rows is not None and validation_split:
        rows = int(math.floor(rows * (1.0 - validation_split)))
    if batch_size:
        source = f"fit(batch_size={batch_size})"
    elif steps_per_epoch and rows:
        batch_size, source = int(math.ceil(rows / steps_per_epoch)), f"{rows} rows / steps_per_epoch"
    elif rows is not None:
        batch_size, source = 32, "fit's default batch_size 32"
    else:
        size = getattr(x, "batch_size", None)  # torch DataLoader, a custom keras DataAdapter
        if isinstance(size, int) and size > 0:
            return size, f"{type(x).__name__}.batch_size", x
        return None, "unknown", x
    if rows is not None and rows < batch_size:
        return rows, f"{rows} training rows ({source})", x
    return batch_size, source, x


def _per_replica(model: keras.Model, batch: Optional[int]) -> Optional[int]:
    """The batch one replica's step sees (Keras splits a global batch across replicas)."""
    replicas = getattr(getattr(model, "distribute_strategy", None), "num_replicas_in_sync", 1) or 1
    return None if batch is None else int(math.ceil(batch / replicas))


def _note_data_batch(model: keras.Model, batch: Optional[int], source: str, exact: bool) -> None:
    """Record the batch the next trace of an unknown-batch step is sized for.

    When a step was already traced with an unknown batch for another size,
    ``train_function`` is dropped so Keras traces (and memsaving plans)
    again: for ``fit`` (``exact``) whenever the size differs, for
    ``train_on_batch`` only when the new batch is larger (a plan for a larger
    batch is safe for smaller ones, and alternating sizes would otherwise
    retrace each call); an unknown-batch trace there is sized for the largest
    batch seen.
    """
    settings = model.__dict__[_SETTINGS]
    if settings["batch_size"] is not None:
        return  # the user's batch_size wins
    batch = _per_replica(model, batch)
    previous = settings.get("data_batch")
    if not exact and previous is not None and (batch is None or previous[0] > batch):
        batch, source = previous
    settings["data_batch"] = None if batch is None else (batch, source)
    traced = settings.get("unknown_trace")
    if traced is None or batch is None:
        return
    traced_batch, traced_function = traced
    if traced_function is not model.train_function:
        settings["unknown_trace"] = None  # Keras rebuilt the function since
    elif batch > traced_batch or (exact and batch != traced_batch):
        logger.info("memsaving.keras: replanning %s for batch %d (planned for %d)", model.name, batch, traced_batch)
        settings["unknown_trace"] = None
        model.train_function = None


def _fit(self: keras.Model, *args, **kwargs):
    """``fit`` that first finds the batch the train step will see (see :func:`data_batch_size`)."""
    original = type(self).fit
    try:
        bound = inspect.signature(original).bind(self, *args, **kwargs)
    except TypeError:
        bound = None
    if bound is not None and "x" in bound.signature.parameters:
        arguments = bound.arguments
        given = dict(arguments)  # a subclass's fit(x, ..., **kwargs) passes the rest on by keyword
        for name, parameter in bound.signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                given.update(arguments.get(name, {}))
        batch, source, x = data_batch_size(
            given.get("x"), given.get("y"), batch_size=given.get("batch_size"),
            steps_per_epoch=given.get("steps_per_epoch"),
            validation_split=given.get("validation_split") or 0.0,
        )
        if "x" in arguments:
            arguments["x"] = x
        _note_data_batch(self, batch, source, exact=True)
        _add_calibration_callback(self, bound)
        return _surviving_out_of_memory(self, lambda: original(*bound.args, **bound.kwargs))
    logger.warning("memsaving.keras: %s.fit has an unexpected signature; the plan's batch size is not "
                   "read from its arguments (pass enable(batch_size=N))", type(self).__name__)
    return original(self, *args, **kwargs)


def _surviving_out_of_memory(model: keras.Model, run: Callable[[], Any], after_calibration: bool = True) -> Any:
    """``run()`` (``fit``), run again on a lower plan when a step runs out of
    memory, with the model's, the optimizer's and the metrics' variables put
    back as they were when it began.

    A device raises ``ResourceExhaustedError`` when a step needs more than
    it has: during calibration that is one more measurement (the plan is
    over the budget), not the end of training; after it (the allocator's
    chunks moved since the plan was measured) the chosen plan is judged
    again and the next one made lower
    (:meth:`memsaving.calibration.Calibrator.steady_step`).  Steps before
    the failed one are undone with it, so ``fit`` starts again from its
    first step: a step stopped by the error may have updated some variables
    already.  The values are copied to host memory when ``fit`` begins (once
    per ``fit`` call; ``after_calibration`` False: only while calibrating,
    for ``train_on_batch``, which would copy them at every step).  When no
    plan may run (``BudgetError``), the steps run are undone too: the error
    leaves the model as ``fit`` found it."""
    calibrator = model.__dict__[_SETTINGS]["calibrator"]
    if calibrator is None or calibrator.off or (calibrator.final and not after_calibration):
        return run()
    calibrator.snapshot = _VariableSnapshot(model)
    while True:
        try:
            return run()
        except BudgetError:
            # no plan may run: fit ends with the model as it began, not with the rounds' steps applied
            calibrator.snapshot.restore()
            raise
        except tf.errors.ResourceExhaustedError:
            if calibrator.off:
                raise
            when = "after" if calibrator.final else "during"
            calibrator.snapshot.restore()
            calibrator.out_of_memory(model)  # raises when nothing lower may run
            _say(f"memsaving: {model.name}: a step ran out of memory {when} calibration; the variables are back "
                 "as fit began, and fit runs again on a lower plan", model.__dict__[_SETTINGS])


class _VariableSnapshot:
    """The values of the variables a training step changes, to put back when
    ``fit`` runs again after an out-of-memory step.

    Keras builds an optimizer (its step counter and slots) inside the first
    traced step when no distribution strategy is set, after any callback
    could record it: a built model's optimizer is built here first, as
    Keras' own ``compile_from_config`` does (with a strategy, ``fit``
    builds it in the strategy's scope before it begins).  Variables first seen later
    (:meth:`add_missing`, when ``fit`` begins) are recorded with the values
    they had then, before any step ran."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.values: Dict[int, Tuple[tf.Variable, np.ndarray]] = {}
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not getattr(optimizer, "built", True) and model.built \
                and getattr(model, "_distribute_strategy", None) is None:
            optimizer.build(model.trainable_variables)
        self.add_missing()

    def add_missing(self) -> None:
        """Record the variables not recorded yet."""
        missing = [v for v in _state_variables(self.model) if id(v) not in self.values]
        for variable, value in snapshot_values(missing):
            self.values[id(variable)] = (variable, value)

    def restore(self) -> None:
        restore_values(self.values.values())


def _state_variables(model: keras.Model) -> List[tf.Variable]:
    """The variables a training step changes: the model's, its optimizer's and its metrics'."""
    found = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        found += list(optimizer.variables)
    found += list(getattr(model, "metrics_variables", []))
    unique = {id(v): v for v in found}
    return [getattr(v, "value", v) if not isinstance(v, tf.Variable) else v for v in unique.values()]


def _place(model: keras.Model, device: str) -> None:
    """Move the model's variables, and its optimizer's, to ``device``
    (:mod:`memsaving.tf.placement`).  Variables not created yet (an
    unbuilt model) are moved when the train function is made."""
    moved = place_variables(model.variables, device)
    if getattr(model, "optimizer", None) is not None:
        moved += place_optimizer(model.optimizer, device)
    if moved:
        logger.info("memsaving.keras: %d variables of %s moved to %s", moved, model.name, device)


def _build_on(model: keras.Model, x: Any, device: str) -> None:
    """Build a model not built yet with its variables on ``device``.

    Keras builds such a model (a subclassed one, without a distribution
    strategy) at its first call, inside the traced train step, so its
    variables would be made on the accelerator.  A symbolic call under
    ``tf.device(device)`` makes them first: Keras creates them when the
    call's stateless scope ends, lifted out of the trace with the device of
    the scope around it, and the forward ops of the symbolic call are
    thrown away."""
    symbolic = keras.tree.map_structure(
        lambda t: None if t is None else keras.KerasTensor(t.shape, dtype=t.dtype.name), x)
    with tf.device(device):
        model(symbolic)


def _make_train_function(self: keras.Model, force: bool = False):
    """Keras' ``make_train_function``, with the variables moved to the host first when offloading:
    the model and its optimizer are built by then, and the function not traced yet."""
    offload = self.__dict__[_SETTINGS].get("offload")
    if offload is not None:
        _place(self, offload.device)
    return type(self).make_train_function(self, force=force)


def _train_on_batch(self: keras.Model, x, *args, **kwargs):
    """``train_on_batch`` that records how many rows the step gets (and measures it while calibrating)."""
    rows = _num_rows(x)
    _note_data_batch(self, rows, f"train_on_batch, {rows} rows", exact=False)
    calibrator = self.__dict__[_SETTINGS]["calibrator"]
    if calibrator is None:
        return type(self).train_on_batch(self, x, *args, **kwargs)
    def one_step():
        measuring = calibrator.begin_step(self)
        result = type(self).train_on_batch(self, x, *args, **kwargs)
        if measuring:
            calibrator.end_step(self)
        return result

    return _surviving_out_of_memory(self, one_step, after_calibration=False)


class _Calibrator:
    """Makes ``enable(model, budget=B)`` hold as measured, from the first step
    (the rule of :mod:`memsaving.calibration`, shared with
    :func:`memsaving.fit_to_budget`).

    At trace time the planner plans for the calibration's target, which
    leaves room for the model's known error before anything was measured
    (:meth:`planning`); a trace whose plan may not run under that rule is
    refused with ``BudgetError`` before its first step (:meth:`admit`).  The
    first :data:`MEASURED_STEPS` steps of a new train function are measured
    (:meth:`begin_step` resets the allocator's peak, :meth:`end_step` reads
    it); the round then decides: climb to a higher plan, go lower, keep the
    best plan measured, or raise.  A new plan means a new train function,
    traced at the next step.  After calibration every step is still
    measured: one whose peak crept into the room the budget keeps free
    sends the next trace lower (:meth:`_steady`).  Where running out of
    memory raises, each measured step runs with the room its plan must
    leave held on the device, during calibration and until the chosen
    plan's peak is steady (:meth:`_hold_room`); after that the step may use
    the room, and only a peak over the budget sends the next trace lower.
    A step that runs out of memory, during calibration or after it, ends ``fit`` with
    ``ResourceExhaustedError``; ``_fit`` then restores the variables as
    they were when ``fit`` began, and runs ``fit`` again on a lower plan
    (:meth:`out_of_memory`).
    """

    def __init__(self, budget: int, max_rounds: int):
        self.device = default_device()
        self.engine = Calibrator(budget=budget, max_rounds=max_rounds, probes=out_of_memory_raises(self.device))
        self.report = Calibration(budget=budget, rounds=self.engine.rounds)
        self.plans: List[Plan] = []  # plans traced since the last measured step
        self.measured_function: Any = None  # the last train function judged
        self.pending: Optional[Tuple[List[Plan], List[int]]] = None  # (plans, measured peaks) of the trace being measured
        self.final = False  # the plan is chosen: its steps are only watched (_steady)
        self.off = False
        self.snapshot: Optional[_VariableSnapshot] = None  # the variables as the running fit began
        self.readmitted = False  # the trace being made plans a measured round's plan again
        self.probing = False  # the trace being measured plans what only a probe may run
        self.rise = PeakRise()  # the chosen plan's steps: whether their peak still rises
        self.room: Optional[contextlib.ExitStack] = None  # the room held during the step measured (held_room)
        self.held = 0  # the bytes it holds
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def planning(self):
        """Enter around the planner's call in a trace: plan for the target."""
        if self.engine.target is None:
            self.engine.first_target(resident=bytes_in_use(self.device) - self.held)
        with planning_target(self.engine.target, or_lowest=True, held=self.held):
            yield

    def back_to_best(self, plan: Plan) -> bool:
        """Whether a plan traced for the calibration's target may not run while
        a measured round fits: the trace plans that round's plan again
        (:meth:`planning_best`), as ``fit_to_budget`` keeps its best measured
        step.  Before, ``fit`` raised a ``BudgetError`` here though a plan had
        measured under the budget (a round that climbed measured inside the
        room, and the error it showed left no lower plan that may run)."""
        return not self.off and self.engine.best is not None and \
            not self.engine.may_run(plan.device_peak, plan.resident_bytes)

    @contextlib.contextmanager
    def planning_best(self, model: keras.Model):
        """Enter around the planner's call to plan the best measured round's plan
        again; calibration ends with it (it was measured: no rule is checked)."""
        engine = self.engine
        best = engine.rounds[engine.best]
        engine.target = best.asked_for if best.asked_for is not None else best.planned_for
        self.final, self.readmitted = True, True
        self.rise = PeakRise()
        self.report.chosen = engine.best
        _say(f"memsaving: {model.name}: the next plan may not run under the error measured; back to the plan "
             f"of round {engine.best + 1}", model.__dict__[_SETTINGS])
        with planning_target(engine.target, or_lowest=True, held=self.held):
            yield

    def admit(self, model: keras.Model, plan: Plan) -> None:
        """Note a plan made while tracing, and refuse one that may not run
        (predicted over the budget, or under it by less than the known
        error; a measured round's plan planned again is not checked).  The
        allocator's peak restarts: what planning allocated (profiling ops)
        is not the step's."""
        readmitted, self.readmitted = self.readmitted, False
        if not readmitted and not self.engine.may_run(plan.device_peak, plan.resident_bytes):
            if not self.engine.may_probe(plan.device_peak, plan.resident_bytes):
                raise refusal(f"memsaving.keras ({model.name})", self.engine.budget, plan.device_peak,
                              plan.resident_bytes, self.engine.ratio, self.engine.rounds)
            self.probing = True  # measured once (Calibrator.may_probe); a failure undoes its steps
        self.plans.append(plan)
        if not self.off:
            try:
                reset_peak(self.device)
            except PeakMemoryUnavailableError:
                pass  # begin_step says so once, with what to do

    def begin_step(self, model: keras.Model) -> bool:
        """Before a step: reset the allocator's peak if the step runs a train function not judged yet
        (or one traced again since)."""
        judged = model.train_function is not None and model.train_function is self.measured_function
        if self.off or (judged and not self.plans and self.pending is None and not self.final):
            return False
        try:
            reset_peak(self.device)
        except PeakMemoryUnavailableError as error:
            self.off = True
            warnings.warn(f"memsaving.keras: the budget cannot be checked against measured peaks: {error}",
                          stacklevel=3)
            return False
        self._hold_room()
        return True

    def _hold_room(self) -> None:
        """Hold the room the step must leave while it runs (where running out
        of memory raises: rounds, and the chosen plan's steps until their
        peak is steady), as ``fit_to_budget`` does (:func:`memsaving.fit_budget.held_room`)."""
        self.release_room()
        if self.final:
            nbytes = 0 if self.rise.steady() else self.engine.steady_room_to_hold()
        else:
            nbytes = self.engine.room_to_hold(bytes_in_use(self.device))
        if nbytes > 0:
            self.room = contextlib.ExitStack()
            self.held = self.room.enter_context(held_room(nbytes, self.device))

    def release_room(self) -> None:
        """Free the room held for the step measured, if any."""
        if self.room is not None:
            self.room.close()
        self.room, self.held = None, 0

    def end_step(self, model: keras.Model) -> None:
        """After a measured step: record a round once :data:`MEASURED_STEPS` steps of
        a new trace are measured (or at once when one is already over the budget)."""
        measured = peak_bytes(self.device) - self.held
        self.release_room()
        if self.plans:  # this step traced: a new round starts (an unfinished one is dropped)
            self.pending = (self.plans, [measured])
            self.plans = []
        elif self.pending is not None:
            self.pending[1].append(measured)
        elif self.final and self.engine.best is not None:
            settled = self.rise.steady()
            self.rise.add(measured)
            self._steady(model, measured, settled=settled)
            return
        else:
            self.measured_function = model.train_function  # nothing memsaving planned was traced
            return
        plans, peaks = self.pending
        if self.final:
            self.pending = None
            self.measured_function = model.train_function
            return
        if max(peaks) <= self.engine.budget and len(peaks) < MEASURED_STEPS:
            return  # measure the next step of this train function too
        self.pending = None
        self.measured_function = model.train_function
        predicted, resident = predicted_figures(plans)
        self._judge(model, plans, CalibrationRound.from_peaks(planned_target(plans, self.engine.target), predicted,
                                                              peaks, resident, first_run=True))

    def out_of_memory(self, model: keras.Model) -> None:
        """A step ran out of memory: of the train function being measured, or of the chosen plan."""
        self.release_room()
        if self.final and self.engine.best is not None and not self.plans and self.pending is None:
            self._steady(model, self.engine.budget, out_of_memory=True)
            return
        plans = self.pending[0] if self.pending is not None else self.plans
        self.pending, self.plans = None, []
        if not plans:
            raise  # pylint: disable=misplaced-bare-raise
        predicted, resident = predicted_figures(plans)
        self._judge(model, plans, CalibrationRound(planned_target(plans, self.engine.target), predicted,
                                                   self.engine.budget, 0, resident, out_of_memory=True))

    def _steady(self, model: keras.Model, measured: int, out_of_memory: bool = False, settled: bool = False) -> None:
        """A step of the chosen plan after calibration, measured at ``measured``
        (:meth:`memsaving.calibration.Calibrator.steady_step`): a step whose
        peak crept into the room the budget must keep free, or that ran out
        of memory, sends the next trace lower."""
        engine, settings = self.engine, model.__dict__[_SETTINGS]
        decision = engine.steady_step(measured, out_of_memory, settled)
        if decision is Next.DONE:
            return
        self.report.chosen = None
        line = f"memsaving: {model.name}: {engine.describe_steady(measured, out_of_memory)}"
        if decision is Next.FAIL:
            _say(line, settings)
            raise calibration_error(f"memsaving.keras ({model.name})", engine.budget, engine)
        self.final = False
        _say(f"{line}; planning for {format_bytes(engine.target)} next", settings)
        model.make_train_function(force=True)  # the next step traces, and plans, again

    def _judge(self, model: keras.Model, plans: List[Plan], current: CalibrationRound) -> None:
        engine, report = self.engine, self.report
        current = replace(current, highest=recomputes_nothing(plans), asked_for=engine.target, probe=self.probing)
        self.probing = False
        decision = engine.record(current)
        for plan in plans:
            plan.measured_peak = current.measured_peak
        settings = model.__dict__[_SETTINGS]
        line = (f"memsaving: {model.name}: calibration round {len(engine.rounds)}: "
                f"{engine.rounds[-1].describe(engine.budget)}")
        if decision is Next.FAIL:
            _say(line, settings)
            raise calibration_error(f"memsaving.keras ({model.name})", engine.budget, engine)
        if decision is Next.RETRACE:
            _say(f"{line}; planning for {format_bytes(engine.target)} next", settings)
            model.make_train_function(force=True)  # the next step traces, and plans, again
            return
        report.chosen = engine.best
        report.seconds = time.perf_counter() - self.start
        self.final = True
        self.rise = PeakRise()
        if engine.best == len(engine.rounds) - 1:
            report.plans = plans
            _say(f"{line}; calibrated", settings)
            return
        best = engine.rounds[engine.best]
        engine.target = best.planned_for
        _say(f"{line}; back to the plan of round {engine.best + 1}", settings)
        model.make_train_function(force=True)


class _CalibrationCallback(keras.callbacks.Callback):
    """Brackets each step of ``fit`` for :class:`_Calibrator` (only the train function call is inside)."""

    def __init__(self, calibrator: _Calibrator):
        super().__init__()
        self.calibrator = calibrator
        self.measuring = False

    def on_train_begin(self, logs=None):
        if self.calibrator.snapshot is not None:
            self.calibrator.snapshot.add_missing()  # the optimizer fit built, before its first step

    def on_train_batch_begin(self, batch, logs=None):
        self.measuring = self.calibrator.begin_step(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.measuring:
            self.calibrator.end_step(self.model)

    def on_train_end(self, logs=None):
        self.calibrator.release_room()  # a step that failed (not out of memory) left it held


def _add_calibration_callback(model: keras.Model, bound: inspect.BoundArguments) -> None:
    """Add the calibration callback to ``fit``'s ``callbacks`` argument."""
    calibrator = model.__dict__[_SETTINGS]["calibrator"]
    if calibrator is None:
        return
    parameters = bound.signature.parameters
    arguments = bound.arguments
    if "callbacks" in parameters:
        holder = arguments
    else:
        extra = next((n for n, p in parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        if extra is None:
            logger.warning("memsaving.keras: %s.fit takes no callbacks, so its steps are not measured against "
                           "the budget", type(model).__name__)
            return
        holder = arguments.setdefault(extra, {})
    given = holder.get("callbacks")
    callback = _CalibrationCallback(calibrator)
    if isinstance(given, keras.callbacks.CallbackList):
        given.append(callback)
    else:
        holder["callbacks"] = list(given or []) + [callback]


def _say(line: str, settings: Dict[str, Any]) -> None:
    logger.info(line)
    if settings["verbose"]:
        print(line)


def _plan_batch(model: keras.Model, x: Any, settings: Dict[str, Any]) -> Tuple[int, int, str]:
    """``(size for unknown dims, batch the plan is for, where it came from)`` at trace time."""
    static = _static_batch(x)
    _warn_unknown_dims(model, x, settings)
    explicit = settings["batch_size"]
    if static is not None:
        return explicit or static, static, "traced input shape"
    if explicit is not None:
        return explicit, explicit, f"enable(batch_size={explicit})"
    found = settings.get("data_batch")
    if found is not None:
        settings["unknown_trace"] = (found[0], model.train_function)
        return found[0], found[0], found[1]
    warnings.warn(
        f"memsaving.keras: the batch dimension of {model.name}'s train step is unknown and the batch was not "
        "found from fit / train_on_batch, so the plan is sized for a batch of 1 and can run out of memory at "
        "larger batches: pass memsaving.keras.enable(model, batch_size=N).", stacklevel=3)
    return 1, 1, "unknown (sized as 1)"


def _warn_unknown_dims(model: keras.Model, x: Any, settings: Dict[str, Any]) -> None:
    """Warn once per model when an input has an unknown dimension besides the batch.

    The planner gives every unknown dimension the same size (the batch
    size), so a variable sequence length is sized as the batch and the
    predicted peak can be far off.
    """
    if settings.get("warned_dims"):
        return
    for t in tf.nest.flatten(x):
        shape = getattr(t, "shape", None)
        if not isinstance(shape, tf.TensorShape):
            continue
        if shape.rank is not None and None not in shape.as_list()[1:]:
            continue
        settings["warned_dims"] = True
        warnings.warn(
            f"memsaving.keras: {model.name}'s input {getattr(t, 'name', '')!r} has shape {shape}: unknown "
            "dimensions besides the batch (e.g. a variable sequence length) are sized as the batch size "
            "when planning, so the predicted peak can be far off. Give the inputs fixed shapes "
            "(keras.Input(shape=(length, ...)), batches padded to a fixed length), or pass "
            "memsaving.keras.enable(model, batch_size=N) to choose the size used for every unknown "
            "dimension.", stacklevel=4)
        return


def _train_step(self: keras.Model, data):
    """Keras' TensorFlow train step with the tape replaced by memsaving."""
    from keras.src import tree  # pylint: disable=import-outside-toplevel
    from keras.src.losses import loss as loss_module  # pylint: disable=import-outside-toplevel

    settings = self.__dict__[_SETTINGS]
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    offload = settings.get("offload")
    if offload is not None and not self.built:
        _build_on(self, x, offload.device)
    if self._call_has_training_arg:  # pylint: disable=protected-access
        y_pred = self(x, training=True)
    else:
        y_pred = self(x)
    loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)  # pylint: disable=protected-access
    self._loss_tracker.update_state(  # pylint: disable=protected-access
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
    )
    if self.optimizer is not None:
        loss = self.optimizer.scale_loss(loss)
    if self.trainable_weights:
        weights = self.trainable_weights
        unknown_size, batch, source = _plan_batch(self, x, settings)
        calibrator = settings["calibrator"]
        graph = tf.compat.v1.get_default_graph()
        def planned(planning):
            with planning, ops_made_in(graph) as made:
                grads, plan = gradients_and_plan(
                    loss, weights, checkpoints=settings["checkpoints"], budget=settings["budget"],
                    batch_size=unknown_size, swap=settings["swap"] or None,
                    planning_time=settings["planning_time"], split=settings["split"],
                    multilevel=settings.get("multilevel", False), **settings.get("options", {}),
                )
            return grads, plan, made

        grads, plan, made = planned(calibrator.planning() if calibrator else contextlib.nullcontext())
        if calibrator and calibrator.back_to_best(plan):
            # the plan for the calibration's target may not run, and a measured plan fits: the step
            # plans that one again (the gradients planned first are left unused, and pruned)
            grads, plan, made = planned(calibrator.planning_best(self))
        plan.batch_size = batch
        plan.batch_source = source
        if calibrator:
            calibrator.admit(self, plan)
        with tf.device(offload.device) if offload is not None else contextlib.nullcontext():
            self.optimizer.apply_gradients(zip(grads, weights))
        if offload is not None:  # after the update: the optimizer's slots exist (a first step builds them)
            offload_step(made, [g for g in grads if g is not None] + [loss], offload,
                         model=step_model([loss], weights, unknown_size), plan=plan,
                         slot_bytes=bytes_of(self.optimizer.variables), graph=graph)
        _report(self, plan, settings)
    else:
        warnings.warn("The model does not have any trainable weights.")
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _report(model: keras.Model, plan: Plan, settings: dict) -> None:
    """Log every plan; print the first, and any later one made for another batch."""
    previous = model.__dict__.get(_PLAN)
    new_batch = previous is None or getattr(previous, "batch_size", None) != plan.batch_size
    object.__setattr__(model, _PLAN, plan)
    mib = 2 ** 20
    line = (f"memsaving: {model.name}: {plan.mode} plan for batch {plan.batch_size} ({plan.batch_source}), "
            f"{len(plan.checkpoints)} checkpoints, predicted peak "
            f"{plan.predicted_peak / mib:.1f} MiB (plain {plan.plain_peak / mib:.1f} MiB), "
            f"compute {plan.predicted_compute:.2f}x")
    if plan.offload is not None:
        line += (f"; parameters on the host: device peak {plan.offload.peak_bytes / mib:.1f} MiB predicted, "
                 f"step {plan.offload.step_seconds * 1e3:.2f} ms under the cost model")
    logger.info(line)
    if new_batch and settings["verbose"]:
        print(line)
