"""memsaving: train TensorFlow 2 models that do not fit in accelerator memory.

The package rewrites the backward pass so that activations between chosen
checkpoint tensors are recomputed when the backward pass needs them instead of
being kept alive from the forward pass (gradient checkpointing).

``import memsaving`` sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` when TensorFlow has
not been imported yet, because the CPU allocator only reports peak memory
(used by :func:`measure_peak`) when that variable is set before TensorFlow
starts.

The public names load their modules on first use, so that the planning side
(``memsaving.model``, ``sim``, ``candidates``, ``planners``, ``references``)
imports without TensorFlow.  README, "Architecture", draws the layers.
"""

import importlib as _importlib
import os as _os
import sys as _sys

if "tensorflow" not in _sys.modules:
    _os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from memsaving.errors import (  # noqa: E402
    BudgetError,
    CheckpointError,
    MemsavingError,
    PeakMemoryUnavailableError,
    PlanWarning,
    UnsupportedGraphError,
)

__version__ = "0.1.0"

_LAZY = {
    "checkpoint": "memsaving.tf.marking",
    "CHECKPOINTS_COLLECTION": "memsaving.tf.marking",
    "gradients": "memsaving.api",
    "gradients_and_plan": "memsaving.api",
    "gradients_collection": "memsaving.api",
    "gradients_memory": "memsaving.api",
    "gradients_speed": "memsaving.api",
    "plan": "memsaving.api",
    "clear_plan_cache": "memsaving.planners.cache",
    "patch": "memsaving.patching",
    "patched": "memsaving.patching",
    "unpatch": "memsaving.patching",
    "Plan": "memsaving.planners.planning",
    "SwapOptions": "memsaving.tf.swap_rewrite",
    "OffloadOptions": "memsaving.tf.offload",
    "measure_peak": "memsaving.tf.measure",
    "measure_peak_increase": "memsaving.tf.measure",
    "fit_to_budget": "memsaving.fit_budget",
    "function": "memsaving.tape_function",
    "MemsavingFunction": "memsaving.tape_function",
    "timeline": "memsaving.tools.memory_timeline",
    "plot_timeline": "memsaving.tools.memory_timeline",
    "Timeline": "memsaving.tools.memory_timeline",
}
"""Public name -> the module that defines it."""


def __getattr__(name):
    """Load a public name's module on first use and keep the name."""
    if name == "keras":
        return _importlib.import_module("memsaving.keras")
    if name not in _LAZY:
        raise AttributeError(f"module 'memsaving' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"keras"})


__all__ = [
    "BudgetError",
    "CHECKPOINTS_COLLECTION",
    "Plan",
    "CheckpointError",
    "MemsavingError",
    "MemsavingFunction",
    "PeakMemoryUnavailableError",
    "PlanWarning",
    "OffloadOptions",
    "SwapOptions",
    "UnsupportedGraphError",
    "checkpoint",
    "clear_plan_cache",
    "fit_to_budget",
    "function",
    "gradients",
    "gradients_and_plan",
    "gradients_collection",
    "gradients_memory",
    "gradients_speed",
    "measure_peak",
    "measure_peak_increase",
    "patch",
    "patched",
    "plan",
    "unpatch",
]
