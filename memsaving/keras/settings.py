"""Where :func:`memsaving.keras.enable` keeps its state on a Keras model.

One job: name the two attributes the subpackage stores on a model it
enables.  ``enable`` writes the settings, the train step, the batch
finding and the calibration read them, and the train step records the plan
it made; every module of :mod:`memsaving.keras` needs the names, so they
live here, below all of them, and no module has to import the one that
writes them (:mod:`memsaving.keras.enabling` imports the others).

The attributes are set with ``object.__setattr__`` so Keras does not track
them; their names start with ``_memsaving`` so they never clash with a
model's own attributes.

``model.__dict__[SETTINGS_ATTRIBUTE]`` is a dict: the options of ``enable``
(``checkpoints``, ``budget``, ``swap``, ``batch_size``, ``verbose``,
``planning_time``, ``split``, ``multilevel``, ``options``), its
``calibrator`` (a :class:`memsaving.keras.calibration.KerasCalibrator`, or
None), ``offload`` (the offload options, or None) and the ``jit_compile``
setting ``disable`` restores; later ``data_batch``, ``unknown_trace`` and
``warned_dims`` (:mod:`memsaving.keras.batch`).
"""

SETTINGS_ATTRIBUTE = "_memsaving_settings"
"""The model attribute holding ``enable``'s settings (its presence means enabled)."""

PLAN_ATTRIBUTE = "_memsaving_plan"
"""The model attribute holding the plan of the last traced train step."""
