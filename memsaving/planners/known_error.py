"""How far a prediction may be from the step it predicts, and what that
means for a budget.

A budget is the memory a device has, so a plan may run only when its
predicted peak stays under the budget even if the step's memory (its peak
above the resident bytes: weights, optimizer slots, inputs, what the device
held while planning) is :data:`KNOWN_ERROR` above the prediction.  A
calibration replaces that prior with the error it measures
(:mod:`memsaving.calibration`), and where running out of memory raises it
may measure the lowest plan the prior forbids once, as a probe
(:meth:`memsaving.calibration.Calibrator.may_probe`).
"""

from __future__ import annotations

import math

KNOWN_ERROR = 0.30
"""How far a step's measured memory may be above its predicted memory
before anything of the model was measured, as a fraction of the predicted
step memory (the peak above the resident bytes).

Measured under a hard memory limit (``experiments/bench_hard_limit.py``):
keras.applications' EfficientNetB0 measured 1.22-1.27x its budget plans'
predicted step memory and an Embedding + Conv1D net 1.28x, where the
small nets of the earlier sweep stayed within 1.15x; with 15% both ran
out of memory under budgets their plans were admitted to."""

HEADROOM = 0.10
"""Fraction of the step's room (the budget less what is in use before the
step) kept free beside its peak *bytes in use* (was 5%: EfficientNetB0's
calibrated step, measured 94-96 MiB of a 100 MiB cap with 48.6 MiB in use
before it, ran out of memory at its sixth step with 96.5 MiB in use).

The device's limit is on the memory its allocator holds, not on the bytes
in use: TensorFlow's BFC allocator hands a request a free chunk of up to
twice its size whole, and a request needs one free chunk large enough in
one region.  Under ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` steps measured 97.4-97.9%
of the cap in bytes in use (an attention encoder: 36 MiB, 8 MiB of it
weights and inputs) ran out of memory a few steps later, when the free
memory left was in pieces too small for the next request.  The pieces come
from the step's own allocations and frees (what was in use before it was
allocated once), so the room kept is a fraction of the step's room: a
measured peak counts as fitting only this far under the budget, and plans
are made for the budget less it."""


def safe_target(budget: int, resident: int, ratio: float, headroom: float = 0.0) -> int:
    """The budget to plan for so that a plan whose step memory is ``ratio``
    times its prediction still stays under ``budget`` less ``headroom``
    (a fraction of the step's room, ``budget - resident``).

    Examples
    --------
    >>> safe_target(1000, 200, 1.0), safe_target(1000, 200, 2.0), safe_target(1000, 200, 1.0, 0.05)
    (1000, 600, 960)
    """
    room = (budget - resident) * (1 - headroom)
    return int(resident + max(room, 0) / max(ratio, 1e-9))


def admissible(predicted: int, resident: int, budget: int, ratio: float, headroom: float = 0.0) -> bool:
    """Whether a plan predicted at ``predicted`` may run under ``budget``:
    its step memory times ``ratio`` fits the step's room less ``headroom``.

    Examples
    --------
    >>> admissible(800, 200, 1000, 1.15), admissible(900, 200, 1000, 1.15)
    (True, False)
    """
    return (predicted - resident) * ratio <= (budget - resident) * (1 - headroom)


def needed_budget(predicted: int, resident: int, ratio: float = 1 + KNOWN_ERROR, headroom: float = 0.0) -> int:
    """The smallest budget under which a plan predicted at ``predicted`` may
    run (:func:`admissible`).

    Examples
    --------
    >>> needed_budget(800, 200)
    980
    >>> needed = needed_budget(800, 200, 1.15, headroom=0.05)
    >>> admissible(800, 200, needed, 1.15, 0.05), admissible(800, 200, needed - 1, 1.15, 0.05)
    (True, False)
    """
    return int(resident + math.ceil(max(predicted - resident, 0) * ratio / (1 - headroom)))
