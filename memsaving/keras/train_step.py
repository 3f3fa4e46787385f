"""The train step ``enable`` puts on a Keras model.

One job: Keras' own TensorFlow train step (:func:`train_step`, a copy of
it) with the ``GradientTape`` replaced by
:func:`memsaving.gradients_and_plan`, and the plan it makes reported
(``_report``).  The loss, metrics, loss scaling and the optimizer's update
are Keras', unchanged; the step plans for the batch
:func:`memsaving.keras.batch.plan_batch` gives, lets the calibrator
(:mod:`memsaving.keras.calibration`) choose the target and admit the plan,
and, with ``offload_params``, builds an unbuilt model with its variables on
the host and copies the weights to the accelerator (:mod:`memsaving.offload`).

Kept apart because it is the code that follows Keras' internals
(``keras.src``, ``_compute_loss``, ``_loss_tracker``): a new Keras release
changes this module and no other.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from memsaving.api import gradients_and_plan
from memsaving.offload import offload_step, step_model
from memsaving.tf.forward import ops_made_in
from memsaving.tf.placement import bytes_of
from memsaving.planners.planning import Plan
from memsaving.keras.batch import plan_batch
from memsaving.keras.settings import PLAN_ATTRIBUTE, SETTINGS_ATTRIBUTE

logger = logging.getLogger("memsaving")


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


def train_step(self: keras.Model, data):
    """Keras' TensorFlow train step with the tape replaced by memsaving."""
    from keras.src import tree  # pylint: disable=import-outside-toplevel
    from keras.src.losses import loss as loss_module  # pylint: disable=import-outside-toplevel

    settings = self.__dict__[SETTINGS_ATTRIBUTE]
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
        unknown_size, batch, source = plan_batch(self, x, settings)
        calibrator = settings["calibrator"]
        graph = tf.compat.v1.get_default_graph()
        def planned(planning):
            with ops_made_in(graph) as made:
                grads, plan = gradients_and_plan(
                    loss, weights, checkpoints=settings["checkpoints"], budget=settings["budget"],
                    batch_size=unknown_size, swap=settings["swap"] or None,
                    planning_time=settings["planning_time"], split=settings["split"],
                    multilevel=settings.get("multilevel", False), planning=planning,
                    **settings.get("options", {}),
                )
            return grads, plan, made

        grads, plan, made = planned(calibrator.planning() if calibrator else None)
        if calibrator and calibrator.back_to_best(plan):
            # the plan for the calibration's target may not run, and a measured plan fits: the step
            # plans that one again (the gradients planned first are left unused, and pruned)
            grads, plan, made = planned(calibrator.planning_best(self))
        plan = replace(plan, batch_size=batch, batch_source=source)  # the data's batch, and where it was read
        if calibrator:
            calibrator.admit(self, plan)
        with tf.device(offload.device) if offload is not None else contextlib.nullcontext():
            self.optimizer.apply_gradients(zip(grads, weights))
        if offload is not None:  # after the update: the optimizer's slots exist (a first step builds them)
            offloaded = offload_step(made, [g for g in grads if g is not None] + [loss], offload,
                                     model=step_model([loss], weights, unknown_size), plan=plan,
                                     slot_bytes=bytes_of(self.optimizer.variables), graph=graph)
            plan = replace(plan, offload=offloaded.prediction)
        _report(self, plan, settings)
    else:
        warnings.warn("The model does not have any trainable weights.")
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _report(model: keras.Model, plan: Plan, settings: dict) -> None:
    """Log every plan; print the first, and any later one made for another batch."""
    previous = model.__dict__.get(PLAN_ATTRIBUTE)
    new_batch = previous is None or getattr(previous, "batch_size", None) != plan.batch_size
    object.__setattr__(model, PLAN_ATTRIBUTE, plan)
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
