"""memsaving: train TensorFlow 2 models that do not fit in accelerator memory.

The package rewrites the backward pass so that activations between chosen
checkpoint tensors are recomputed when the backward pass needs them instead of
being kept alive from the forward pass (gradient checkpointing).

``import memsaving`` sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` when TensorFlow has
not been imported yet, because the CPU allocator only reports peak memory
(used by :func:`measure_peak`) when that variable is set before TensorFlow
starts.
"""

import os as _os
import sys as _sys

if "tensorflow" not in _sys.modules:
    _os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from memsaving.errors import (  # noqa: E402
    BudgetError,
    CheckpointError,
    MemsavingError,
    PeakMemoryUnavailableError,
    UnsupportedGraphError,
)
from memsaving.marking import checkpoint, CHECKPOINTS_COLLECTION  # noqa: E402
from memsaving.gradients import (  # noqa: E402
    gradients,
    gradients_and_plan,
    gradients_collection,
    gradients_memory,
    gradients_speed,
    plan,
)
from memsaving.patching import patch, patched, unpatch  # noqa: E402
from memsaving.planning import Plan  # noqa: E402
from memsaving.measure import measure_peak, measure_peak_increase  # noqa: E402
from memsaving.fit_budget import fit_to_budget  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name):
    """``memsaving.keras``, ``memsaving.timeline`` and ``memsaving.plot_timeline``
    load on first use (Keras and matplotlib cost seconds to import)."""
    import importlib

    if name == "keras":
        return importlib.import_module("memsaving.keras")
    if name in ("timeline", "plot_timeline", "Timeline"):
        return getattr(importlib.import_module("memsaving.memory_timeline"), name)
    raise AttributeError(f"module 'memsaving' has no attribute {name!r}")


__all__ = [
    "BudgetError",
    "CHECKPOINTS_COLLECTION",
    "Plan",
    "CheckpointError",
    "MemsavingError",
    "PeakMemoryUnavailableError",
    "UnsupportedGraphError",
    "checkpoint",
    "fit_to_budget",
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
