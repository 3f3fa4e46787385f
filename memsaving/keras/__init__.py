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
a higher or lower plan until one uses the budget (see
:class:`memsaving.keras.calibration.KerasCalibrator`).

With ``offload_params=True`` the model's variables and the optimizer's
state live on a host device (``offload_device``): they are moved there
before the train function is built, every weight is copied to the
accelerator before its forward use and again before its backward use, and
the optimizer's update runs on the host (:mod:`memsaving.offload`).
``disable`` moves them back to the default device.

The subpackage has one job per module; this one only re-exports the public
names:

* :mod:`memsaving.keras.enabling`: ``enable``, ``disable``, ``is_enabled``,
  ``plan_of``, ``calibration_of``, and the methods swapped on the model
  (``fit``, ``train_on_batch``, ``make_train_function``; the variables
  placed on the host for offload);
* :mod:`memsaving.keras.train_step`: the train step, a copy of Keras' own
  with the tape replaced, and the line reporting its plan;
* :mod:`memsaving.keras.batch`: the batch the step will get, found from the
  data (``data_batch_size``);
* :mod:`memsaving.keras.calibration`: measuring the steps under a budget
  and surviving a step that runs out of memory;
* :mod:`memsaving.keras.settings`: the names of the attributes ``enable``
  keeps on the model.

Each imports only the ones below it in that list (``enabling`` the rest,
``train_step`` ``batch``), so there is no import cycle.
"""

from memsaving.keras.batch import data_batch_size
from memsaving.keras.enabling import calibration_of, disable, enable, is_enabled, plan_of

__all__ = ["enable", "disable", "is_enabled", "plan_of", "calibration_of", "data_batch_size"]
