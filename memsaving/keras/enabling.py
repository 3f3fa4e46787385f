"""Turning memsaving on and off for a Keras model.

One job: :func:`enable`, :func:`disable`, :func:`is_enabled`,
:func:`plan_of` and :func:`calibration_of`, the settings ``enable`` keeps on
the model (:mod:`memsaving.keras.settings`), and the methods it swaps in:
the train step (:mod:`memsaving.keras.train_step`), ``fit`` and
``train_on_batch`` (to find the batch from their arguments,
:mod:`memsaving.keras.batch`, and to measure their steps under a budget,
:mod:`memsaving.keras.calibration`), and ``make_train_function`` (to move
the variables to the host first with ``offload_params``).

Kept apart because this is the only module that changes the model: the
others read what it set.  It imports them, none imports it.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any, Optional, Union

import keras

from memsaving.planners.budget import parse_bytes
from memsaving.fit_budget import Calibration
from memsaving.tf.measure import default_device
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.placement import place_optimizer, place_variables, same_device
from memsaving.planners.planning import Plan
from memsaving.options import SHARED_DEFAULTS, accepts_deprecated_keys, option_keywords, parse_options
from memsaving.tf.checkpoints import Checkpoints
from memsaving.tf.swap_rewrite import SwapOptions
from memsaving.keras.batch import data_batch_size, note_data_batch, num_rows
from memsaving.keras.calibration import KerasCalibrator, add_calibration_callback, surviving_out_of_memory
from memsaving.keras.settings import PLAN_ATTRIBUTE, SETTINGS_ATTRIBUTE
from memsaving.keras.train_step import train_step

logger = logging.getLogger("memsaving")


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
        calibrator = KerasCalibrator(parse_bytes(budget), calibration_rounds)  # a bad budget fails here
    previous = getattr(model, SETTINGS_ATTRIBUTE, None)
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
    object.__setattr__(model, SETTINGS_ATTRIBUTE, settings)
    if model.jit_compile:
        logger.warning("memsaving.keras.enable: turning off jit_compile (XLA would ignore the recomputation)")
        model.jit_compile = False
    object.__setattr__(model, "train_step", types.MethodType(train_step, model))
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
    settings = model.__dict__.pop(SETTINGS_ATTRIBUTE, None)
    for name in ("train_step", "fit", "train_on_batch", "make_train_function", PLAN_ATTRIBUTE):
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
    return SETTINGS_ATTRIBUTE in model.__dict__


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
    return model.__dict__.get(PLAN_ATTRIBUTE)


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
    settings = model.__dict__.get(SETTINGS_ATTRIBUTE)
    calibrator = settings and settings.get("calibrator")
    return calibrator.report if calibrator else None


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
        note_data_batch(self, batch, source, exact=True)
        add_calibration_callback(self, bound)
        return surviving_out_of_memory(self, lambda: original(*bound.args, **bound.kwargs))
    logger.warning("memsaving.keras: %s.fit has an unexpected signature; the plan's batch size is not "
                   "read from its arguments (pass enable(batch_size=N))", type(self).__name__)
    return original(self, *args, **kwargs)


def _place(model: keras.Model, device: str) -> None:
    """Move the model's variables, and its optimizer's, to ``device``
    (:mod:`memsaving.tf.placement`).  Variables not created yet (an
    unbuilt model) are moved when the train function is made."""
    moved = place_variables(model.variables, device)
    if getattr(model, "optimizer", None) is not None:
        moved += place_optimizer(model.optimizer, device)
    if moved:
        logger.info("memsaving.keras: %d variables of %s moved to %s", moved, model.name, device)


def _make_train_function(self: keras.Model, force: bool = False):
    """Keras' ``make_train_function``, with the variables moved to the host first when offloading:
    the model and its optimizer are built by then, and the function not traced yet."""
    offload = self.__dict__[SETTINGS_ATTRIBUTE].get("offload")
    if offload is not None:
        _place(self, offload.device)
    return type(self).make_train_function(self, force=force)


def _train_on_batch(self: keras.Model, x, *args, **kwargs):
    """``train_on_batch`` that records how many rows the step gets (and measures it while calibrating)."""
    rows = num_rows(x)
    note_data_batch(self, rows, f"train_on_batch, {rows} rows", exact=False)
    calibrator = self.__dict__[SETTINGS_ATTRIBUTE]["calibrator"]
    if calibrator is None:
        return type(self).train_on_batch(self, x, *args, **kwargs)
    def one_step():
        measuring = calibrator.begin_step(self)
        result = type(self).train_on_batch(self, x, *args, **kwargs)
        if measuring:
            calibrator.end_step(self)
        return result

    return surviving_out_of_memory(self, one_step, after_calibration=False)
