"""Keras 3 (TensorFlow backend): train with memsaving in one line.

``memsaving.keras.enable(model)`` replaces the model's train step by one
that computes the loss exactly as Keras does, but its gradients with
:func:`memsaving.gradients` (recomputing between checkpoints) instead of a
GradientTape.  ``fit``, ``train_on_batch``, optimizers, losses, metrics and
loss scaling work unchanged.  ``disable(model)`` restores Keras' own step.

The first time the step is traced, the plan's predicted peak is logged (and
printed with ``verbose=True``); :func:`plan_of` returns the plan.
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import Optional, Union

import keras
import tensorflow as tf

from memsaving.gradients import gradients_and_plan
from memsaving.planning import Plan

logger = logging.getLogger("memsaving")

_SETTINGS = "_memsaving_settings"
_PLAN = "_memsaving_plan"


def enable(
    model: keras.Model,
    checkpoints="memory",
    budget: Optional[Union[int, str]] = None,
    swap=False,
    batch_size: Optional[int] = None,
    verbose: bool = True,
) -> keras.Model:
    """Make ``model.fit`` / ``train_on_batch`` compute gradients with memsaving.

    Args:
      model: a compiled or uncompiled Keras model (Sequential, functional or
        subclassed) on the TensorFlow backend.
      checkpoints, budget: as for :func:`memsaving.gradients`.
      swap: host swapping, as for :func:`memsaving.gradients` (``True``,
        ``"auto"`` with ``budget``, or ``False``).
      batch_size: the batch size used to size tensors when the traced batch
        dimension is unknown (default: the batch of the first traced call).
      verbose: print the plan's predicted peak when the step is traced.

    XLA (``jit_compile=True``) schedules the whole step itself and would
    ignore the recomputation order, so it is turned off for this model
    (``disable`` restores it).  Returns ``model``.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"memsaving.keras needs the TensorFlow backend of Keras, not {keras.backend.backend()!r}: "
            "set KERAS_BACKEND=tensorflow before importing keras."
        )
    if swap == "auto" and budget is None:
        raise ValueError("memsaving.keras.enable(swap='auto') needs budget= (e.g. budget='2GiB')")
    previous = getattr(model, _SETTINGS, None)
    settings = {
        "checkpoints": checkpoints,
        "budget": budget,
        "swap": swap,
        "batch_size": batch_size,
        "verbose": verbose,
        "jit_compile": previous["jit_compile"] if previous else model.jit_compile,
    }
    object.__setattr__(model, _SETTINGS, settings)
    if model.jit_compile:
        logger.warning("memsaving.keras.enable: turning off jit_compile (XLA would ignore the recomputation)")
        model.jit_compile = False
    object.__setattr__(model, "train_step", types.MethodType(_train_step, model))
    model.train_function = None  # rebuilt by the next fit / train_on_batch
    return model


def disable(model: keras.Model) -> keras.Model:
    """Undo :func:`enable`: Keras' own train step (and jit_compile setting)."""
    settings = model.__dict__.pop(_SETTINGS, None)
    model.__dict__.pop("train_step", None)
    model.__dict__.pop(_PLAN, None)
    if settings is not None and settings["jit_compile"] is not None:
        model.jit_compile = settings["jit_compile"]
    model.train_function = None
    return model


def is_enabled(model: keras.Model) -> bool:
    """True when ``model`` trains through memsaving."""
    return _SETTINGS in model.__dict__


def plan_of(model: keras.Model) -> Optional[Plan]:
    """The plan of the last traced train step (None before the first step)."""
    return model.__dict__.get(_PLAN)


def _static_batch(x) -> Optional[int]:
    first = next((t for t in tf.nest.flatten(x) if t is not None and hasattr(t, "shape")), None)
    if first is None or not len(first.shape):
        return None
    return first.shape[0]


def _train_step(self: keras.Model, data):
    """Keras' TensorFlow train step with the tape replaced by memsaving."""
    from keras.src import tree  # pylint: disable=import-outside-toplevel
    from keras.src.losses import loss as loss_module  # pylint: disable=import-outside-toplevel

    settings = self.__dict__[_SETTINGS]
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
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
        batch = _static_batch(x)
        if batch is not None and settings["batch_size"] is None:
            settings["batch_size"] = batch
        grads, plan = gradients_and_plan(
            loss, weights, checkpoints=settings["checkpoints"], budget=settings["budget"],
            batch_size=batch or settings["batch_size"], swap=settings["swap"] or None,
        )
        _report(self, plan, settings)
        self.optimizer.apply_gradients(zip(grads, weights))
    else:
        warnings.warn("The model does not have any trainable weights.")
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _report(model: keras.Model, plan: Plan, settings: dict) -> None:
    first = _PLAN not in model.__dict__
    object.__setattr__(model, _PLAN, plan)
    mib = 2 ** 20
    line = (f"memsaving: {model.name}: {plan.mode} plan, {len(plan.checkpoints)} checkpoints, predicted peak "
            f"{plan.predicted_peak / mib:.1f} MiB (plain {plan.plain_peak / mib:.1f} MiB), "
            f"compute {plan.predicted_compute:.2f}x")
    logger.info(line)
    if first and settings["verbose"]:
        print(line)
