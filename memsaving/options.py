"""The keywords of ``memsaving.gradients`` and ``memsaving.plan``, parsed once.

Each keyword is checked here, before any graph work, and travels on in one
of five small frozen records instead of a ``**kwargs`` dict: what
``tf.gradients`` itself takes (:class:`GradientOptions`), how the plan is
sized (:class:`PlannerOptions`), the device's speeds
(:class:`HardwareOptions`), host swapping (:class:`SwapSettings`) and
parameter offloading (:class:`OffloadSettings`).
Defaults come from the records the options configure (:class:`SwapOptions`,
:class:`CostModel`), so each is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from memsaving.sim.allowance import DEFAULT_PLANNING_SECONDS
from memsaving.sim.swap import CostModel
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.swap_rewrite import SwapOptions

PASSED_THROUGH = ("gate_gradients", "aggregation_method", "colocate_gradients_with_ops")
"""Keywords handed unchanged to TensorFlow's gradient function for each unit."""

SWAP_KEYS = ("swap", "swap_device", "swap_trigger", "swap_lb", "swap_ub", "swap_fuse", "bandwidth",
             "flops_per_second", "swap_backend")

OFFLOAD_KEYS = ("offload_params", "offload_device")

ACCEPTED_KEYWORDS = frozenset(PASSED_THROUGH + ("name", "stop_gradients", "unconnected_gradients", "batch_size")
                              + SWAP_KEYS + OFFLOAD_KEYS + ("profile", "follow_order", "planning_time", "split"))
"""The keywords ``memsaving.gradients`` takes besides ys, xs, grad_ys, checkpoints and budget."""


@dataclass(frozen=True)
class GradientOptions:
    """What ``tf.gradients`` itself takes, and the order option of the rewrite.

    ``follow_order`` None leaves the choice to the rewrite (on, except in
    half precision or with swaps)."""

    name: str = "memsaving_gradients"
    unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE
    stop_gradients: Tuple[Any, ...] = ()
    passed_through: Tuple[Tuple[str, Any], ...] = ()
    follow_order: Optional[bool] = None

    @property
    def passed(self) -> Dict[str, Any]:
        """The pass-through keywords as a dict, for TensorFlow's gradient function."""
        return dict(self.passed_through)

    @property
    def colocated(self) -> bool:
        """``colocate_gradients_with_ops`` was given: only tf.compat.v1.gradients takes it."""
        return any(key == "colocate_gradients_with_ops" for key, _ in self.passed_through)


@dataclass(frozen=True)
class PlannerOptions:
    """How the step is sized and planned.

    ``profile`` is the user's choice (None: decided from the checkpoints
    and budget, see ``memsaving.api``); ``planning_time`` the seconds of
    simulation a plan may take (None: no limit; see
    :mod:`memsaving.sim.allowance`)."""

    batch_size: int = 1
    batch_size_given: bool = False
    keep_x_gradients: bool = False
    profile: Optional[bool] = None
    planning_time: Optional[float] = DEFAULT_PLANNING_SECONDS
    split: Any = None
    """``split=``: None, ``"auto"``, or ``((op_or_tensor_or_name, pieces), ...)``
    (:mod:`memsaving.planners.splits`)."""


@dataclass(frozen=True)
class HardwareOptions:
    """The device's speeds, used to time swaps against compute."""

    flops_per_second: float = CostModel.flops_per_second
    bandwidth: float = CostModel.bandwidth


@dataclass(frozen=True)
class SwapSettings:
    """Host swapping: ``swap`` as given (None or False: off; True; ``"auto"``;
    tensors), how swaps are emitted (only when on) and the copy backend."""

    swap: Any = None
    emit: Optional[SwapOptions] = None
    backend: Any = None

    @property
    def on(self) -> bool:
        return self.swap is not None and self.swap is not False


@dataclass(frozen=True)
class OffloadSettings:
    """Parameter offloading (``offload_params``): None when off, else where
    the variables live and how their copies are timed (the swap-in timing
    keywords, ``swap_trigger``, ``swap_lb``, ``swap_ub``, ``swap_fuse``,
    time them too)."""

    emit: Optional[OffloadOptions] = None

    @property
    def on(self) -> bool:
        return self.emit is not None


@dataclass(frozen=True)
class Options:
    """Every keyword of one call, parsed."""

    gradient: GradientOptions
    planner: PlannerOptions
    hardware: HardwareOptions
    swap: SwapSettings
    offload: OffloadSettings = OffloadSettings()

    def cost_model(self) -> CostModel:
        """Speeds and swap timing for the simulator (swaps start ``swap_lb``
        actions ahead, as they are emitted)."""
        emit = self.swap.emit
        lead = emit.lb if emit is not None else CostModel.lb
        fuse = (emit.fuse_levels if emit.fuse else None) if emit is not None else CostModel.fuse_levels
        return CostModel(flops_per_second=self.hardware.flops_per_second, bandwidth=self.hardware.bandwidth,
                         lb=lead, fuse_levels=fuse)


def parse_options(keywords: Mapping[str, Any]) -> Options:
    """The call's keywords as :class:`Options`; a bad value raises with what
    to pass instead.  Unknown keywords are the caller's to refuse (each
    entry point takes its own set)."""
    return Options(
        gradient=_gradient_options(keywords),
        planner=_planner_options(keywords),
        hardware=HardwareOptions(
            flops_per_second=float(keywords.get("flops_per_second") or HardwareOptions.flops_per_second),
            bandwidth=float(keywords.get("bandwidth") or HardwareOptions.bandwidth),
        ),
        swap=_swap_settings(keywords),
        offload=_offload_settings(keywords),
    )


def _gradient_options(keywords: Mapping[str, Any]) -> GradientOptions:
    follow_order = keywords.get("follow_order")
    if follow_order is not None and not isinstance(follow_order, (bool, np.bool_)):
        raise TypeError(f"follow_order={follow_order!r}: pass True (run gradient ops in the planned order), "
                        "False (leave the order to TensorFlow) or leave it out")
    stop = keywords.get("stop_gradients")
    stop = () if stop is None else tuple(stop) if isinstance(stop, (list, tuple)) else (stop,)
    return GradientOptions(
        name=keywords.get("name") or GradientOptions.name,
        unconnected_gradients=tf.UnconnectedGradients(keywords.get("unconnected_gradients", "none")),
        stop_gradients=stop,
        passed_through=tuple((key, keywords[key]) for key in PASSED_THROUGH if key in keywords),
        follow_order=None if follow_order is None else bool(follow_order),
    )


def _planner_options(keywords: Mapping[str, Any]) -> PlannerOptions:
    profile = keywords.get("profile")
    if profile is not None and not isinstance(profile, (bool, np.bool_)):
        raise ValueError(f"profile={profile!r} is not supported: use profile=True (measure kernel temporaries), "
                         "profile=False (do not count them) or leave it out")
    return PlannerOptions(
        batch_size=_batch_size(keywords.get("batch_size")),
        batch_size_given=keywords.get("batch_size") is not None,
        keep_x_gradients=bool(keywords.get("keep_x_gradients", False)),
        profile=None if profile is None else bool(profile),
        planning_time=_planning_time(keywords.get("planning_time", DEFAULT_PLANNING_SECONDS)),
        split=_split(keywords.get("split")),
    )


def _split(value) -> Any:
    """``split=`` checked: None, ``"auto"``, or ``{key: pieces}`` (pieces an
    int >= 2) as a tuple of ``(key, pieces)`` pairs.  A key is an op, a
    tensor's ``ref()`` or a name (tensors cannot be dict keys); a list of
    ``(tensor, pieces)`` pairs is taken too."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and value and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                           for p in value):
        pairs = [tuple(p) for p in value]
    else:
        pairs = None
    if not pairs:
        raise ValueError(f"split={value!r} is not supported: give split='auto' (the planner splits the ops that "
                         "hold the most, when that helps), or {op_or_tensor_ref: pieces} such as "
                         "{logits.op: 8} or {logits.ref(): 8} (a list of (tensor, pieces) pairs works too), "
                         "or leave it out")
    checked = []
    for key, pieces in pairs:
        if hasattr(key, "deref"):
            key = key.deref()
        label = getattr(key, "name", key)
        if isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer)) or pieces < 2:
            raise ValueError(f"split: {label!r} is given {pieces!r} pieces; give an int >= 2")
        if not isinstance(key, (tf.Tensor, tf.Operation, str)):
            raise TypeError(f"split: keys must be ops, tensor refs (tensor.ref()) or names of the forward pass, "
                            f"got {type(key).__name__}")
        checked.append((key, int(pieces)))
    return tuple(checked)


def _planning_time(value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
        raise ValueError(f"planning_time={value!r} is not supported: give the seconds of simulation a plan may "
                         "take as a positive number (default 30), or None for no limit")
    return float(value)


def _batch_size(value) -> int:
    """The ``batch_size`` argument as a positive int (default 1).

    It sizes unknown dimensions when predicting memory; a string or a
    fraction there is a mistake to report, not a number to coerce."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"batch_size={value!r} is not supported: give a positive int, the size memsaving gives to unknown "
            "dimensions (usually the batch) when predicting memory; omit it for 1"
        )
    return int(value)


def _swap_settings(keywords: Mapping[str, Any]) -> SwapSettings:
    settings = SwapSettings(swap=keywords.get("swap"), backend=keywords.get("swap_backend"))
    if not settings.on:
        return settings  # the swap options are read only when swapping is asked for
    defaults = SwapOptions()
    emit = SwapOptions(
        device=keywords.get("swap_device") or defaults.device,
        trigger=keywords.get("swap_trigger") or defaults.trigger,
        lb=_swap_distance(keywords, "swap_lb", defaults.lb),
        ub=_swap_distance(keywords, "swap_ub", defaults.ub),
        fuse=bool(keywords.get("swap_fuse", defaults.fuse)),
    )
    return SwapSettings(swap=settings.swap, emit=emit, backend=settings.backend)


def _swap_distance(keywords: Mapping[str, Any], key: str, default: int) -> int:
    value = keywords.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{key} must be an int number of topological levels (default {default}), got {value!r}")
    return int(value)


def _offload_settings(keywords: Mapping[str, Any]) -> OffloadSettings:
    offload = keywords.get("offload_params")
    if offload is None or offload is False:
        return OffloadSettings()
    if offload is not True:
        raise ValueError(f"offload_params={offload!r}: pass True (variables and optimizer state on the host "
                         "device, offload_device) or leave it out")
    if keywords.get("split") is not None:
        raise ValueError("split= cannot be combined with offload_params= yet: choose one of them")
    defaults = OffloadOptions()
    return OffloadSettings(OffloadOptions(
        device=keywords.get("offload_device") or defaults.device,
        trigger=keywords.get("swap_trigger") or defaults.trigger,
        lb=_swap_distance(keywords, "swap_lb", defaults.lb),
        ub=_swap_distance(keywords, "swap_ub", defaults.ub),
        fuse=bool(keywords.get("swap_fuse", defaults.fuse)),
    ))
