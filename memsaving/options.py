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

import functools
import math
import warnings
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from memsaving.sim.allowance import DEFAULT_PLANNING_SECONDS
from memsaving.sim.swap import CostModel
from memsaving.tf.forward import is_tensor_like
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.placement import same_device
from memsaving.tf.swap_rewrite import SwapOptions

PASSED_THROUGH = ("gate_gradients", "aggregation_method", "colocate_gradients_with_ops")
"""Keywords handed unchanged to TensorFlow's gradient function for each unit."""

SWAP_KEYS = ("swap", "swap_device", "swap_trigger", "swap_lb", "swap_ub", "swap_fuse", "bandwidth",
             "flops_per_second", "swap_backend")

OFFLOAD_KEYS = ("offload_params", "offload_device")

ACCEPTED_KEYWORDS = frozenset(PASSED_THROUGH + ("name", "stop_gradients", "unconnected_gradients", "batch_size")
                              + SWAP_KEYS + OFFLOAD_KEYS + ("profile", "follow_order", "planning_time", "split",
                                                          "multilevel", "keep_x_gradients", "swap_options",
                                                          "offload_options"))
"""The keywords ``memsaving.gradients_and_plan`` takes besides ys, xs, grad_ys, checkpoints and budget."""

SHARED_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "checkpoints": "memory",
    "budget": None,
    "swap": None,
    "split": None,
    "batch_size": None,
    "profile": None,
    "planning_time": DEFAULT_PLANNING_SECONDS,
    "multilevel": False,
    "follow_order": None,
    "keep_x_gradients": False,
    "offload_params": False,
    "swap_options": None,
    "offload_options": None,
    "flops_per_second": None,
    "bandwidth": None,
})
"""The memsaving options every entry point takes (``gradients``, ``plan``,
``function``, ``patch``, ``keras.enable``), keyword-only, with these
defaults: the one place they are defined.  Each signature names them
(``tests/api/test_options.py`` checks that the five agree with this table)
and hands them on with :func:`option_keywords`.

* ``checkpoints``: which forward tensors are kept (a list of tensors,
  ``"collection"``, ``"speed"``, ``"memory"``);
* ``budget``: bytes or a string such as ``"2GiB"``;
* ``swap``: host swapping (True, ``"auto"``, tensors; None or False: off);
* ``split``: ``"auto"`` or ``{op_or_tensor_ref: pieces}``;
* ``batch_size``: the size of unknown dimensions when predicting memory;
* ``profile``: measure kernel temporaries and run times (None: decided by
  the call);
* ``planning_time``: seconds of simulation a plan may take (None: no limit);
* ``multilevel``: allow multi-level plans under a budget;
* ``follow_order``: run the step in the planned order (None: decided by
  the rewrite);
* ``keep_x_gradients``: predict as if the gradients are held to the end;
* ``offload_params``: variables live on the host, copied in before use;
* ``swap_options`` (:class:`memsaving.tf.swap_rewrite.SwapOptions`) and
  ``offload_options`` (:class:`memsaving.tf.offload.OffloadOptions`): where
  and when copies are made;
* ``flops_per_second``, ``bandwidth``: the device's speeds, for timing swaps.
"""

DEPRECATED_KEYS: Mapping[str, str] = MappingProxyType({
    "swap_device": "swap_options=SwapOptions(device=...)",
    "swap_trigger": "swap_options=SwapOptions(trigger=...) (and offload_options=OffloadOptions(trigger=...))",
    "swap_lb": "swap_options=SwapOptions(lb=...) (and offload_options=OffloadOptions(lb=...))",
    "swap_ub": "swap_options=SwapOptions(ub=...) (and offload_options=OffloadOptions(ub=...))",
    "swap_fuse": "swap_options=SwapOptions(fuse=...) (and offload_options=OffloadOptions(fuse=...))",
    "swap_backend": "swap_options=SwapOptions(backend=...)",
    "offload_device": "offload_options=OffloadOptions(device=...)",
})
"""The keywords of earlier versions that :func:`accepts_deprecated_keys`
still takes, each with what replaces it."""


def option_keywords(**values: Any) -> Dict[str, Any]:
    """The options an entry point was given, as the keywords
    :func:`memsaving.api.gradients_and_plan` and :func:`parse_options` read:
    those left at None are left out, so that each call decides them.

    Examples
    --------
    >>> option_keywords(budget="1GiB", swap=None, multilevel=False)
    {'budget': '1GiB', 'multilevel': False}
    """
    return {key: value for key, value in values.items() if value is not None}


def shared_options(values: Mapping[str, Any], leave_out: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The options of :data:`SHARED_DEFAULTS` among ``values`` (an entry
    point's ``locals()``), less ``leave_out``, as :func:`option_keywords`
    gives them; ``planning_time`` is kept when None (no limit), which the
    call would otherwise read as its default.

    Examples
    --------
    >>> shared_options({"budget": "1GiB", "swap": None, "planning_time": None, "ys": 1}, leave_out=("checkpoints",))
    {'budget': '1GiB', 'planning_time': None}
    """
    given = {key: values[key] for key in SHARED_DEFAULTS if key in values and key not in leave_out}
    kept = option_keywords(**given)
    if "planning_time" in given:
        kept["planning_time"] = given["planning_time"]
    return kept


def accepts_deprecated_keys(entry_point: Callable[..., Any]) -> Callable[..., Any]:
    """Let ``entry_point`` (whose signature names every option) still take
    the ``swap_*``/``offload_device`` keywords of earlier versions, with a
    ``DeprecationWarning`` that names the replacement: they are folded into
    ``swap_options``/``offload_options`` before the call.  The signature
    ``inspect.signature`` reports stays the explicit one.

    Examples
    --------
    >>> import warnings
    >>> @accepts_deprecated_keys
    ... def enable(*, swap_options=None, offload_options=None):
    ...     return swap_options.device
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     enable(swap_device="/CPU:0")
    '/CPU:0'
    >>> caught[0].category.__name__
    'DeprecationWarning'
    """
    @functools.wraps(entry_point)
    def with_old_keys(*args: Any, **kwargs: Any) -> Any:
        old = {key: kwargs.pop(key) for key in list(kwargs) if key in DEPRECATED_KEYS}
        if old:
            warnings.warn(
                f"{entry_point.__qualname__}: {', '.join(sorted(old))} "
                f"{'is' if len(old) == 1 else 'are'} deprecated; pass "
                + "; ".join(DEPRECATED_KEYS[key] for key in sorted(old)), DeprecationWarning, stacklevel=2)
            kwargs.update(_folded(old, kwargs.get("swap_options"), kwargs.get("offload_options")))
        return entry_point(*args, **kwargs)
    return with_old_keys


def _folded(old: Mapping[str, Any], swap_options: Optional[SwapOptions],
            offload_options: Optional[OffloadOptions]) -> Dict[str, Any]:
    """The deprecated keys as ``swap_options``/``offload_options`` (on top of any given)."""
    defaults = SwapOptions()
    timing: Dict[str, Any] = {}  # checked as before, with the same messages
    if "swap_trigger" in old:
        timing["trigger"] = old["swap_trigger"]
    for field in ("lb", "ub"):
        if f"swap_{field}" in old:
            timing[field] = _swap_distance(old, f"swap_{field}", getattr(defaults, field))
    if "swap_fuse" in old:
        timing["fuse"] = _fuse(old, defaults.fuse)
    swap = dict(timing, **({"device": old["swap_device"]} if "swap_device" in old else {}),
                **({"backend": old["swap_backend"]} if "swap_backend" in old else {}))
    offload = dict(timing, **({"device": old["offload_device"]} if "offload_device" in old else {}))
    folded: Dict[str, Any] = {}
    if swap:
        folded["swap_options"] = replace(swap_options or SwapOptions(), **swap)
    if offload:
        folded["offload_options"] = replace(offload_options or OffloadOptions(), **offload)
    return folded


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
    multilevel: bool = False
    """``multilevel=True``: a budget below every single-level plan may get a
    multi-level (recursive) plan.  Off by default: their peaks measure
    1.13-1.5x their predictions and move by up to 4 MiB from run to run (a
    U-Net: 12.8-16.8 MiB, out of memory under a 19 MiB cap at its fourth
    step, where the single-level plan measured 14.5-14.9 for 20 steps)."""


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
            flops_per_second=_speed(keywords, "flops_per_second", HardwareOptions.flops_per_second,
                                    "the device's sustained compute rate in FLOP/s"),
            bandwidth=_speed(keywords, "bandwidth", HardwareOptions.bandwidth,
                             "the bytes per second each way between device and host"),
        ),
        swap=_swap_settings(keywords),
        offload=_offload_settings(keywords),
    )


def _flag(keywords: Mapping[str, Any], key: str, when_true: str, when_false: str) -> Optional[bool]:
    """The bool option ``key`` (None when left out or None).  Anything but
    a bool is refused, not coerced: ``"no"`` would count as True."""
    value = keywords.get(key)
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{key}={value!r} is not supported: pass {key}=True ({when_true}), "
                        f"{key}=False ({when_false}) or leave it out")
    return bool(value)


def _finite_positive(value) -> bool:
    """A real number (not a bool), finite and above 0."""
    return (not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))
            and math.isfinite(value) and value > 0)


def _speed(keywords: Mapping[str, Any], key: str, default: float, meaning: str) -> float:
    """A rate of the cost model (``bandwidth``, ``flops_per_second``): a
    finite number above 0; 0 or a negative rate would make every transfer
    or kernel take no time or forever."""
    value = keywords.get(key)
    if value is None:
        return default
    if not _finite_positive(value):
        raise ValueError(f"{key}={value!r} is not supported: give {meaning} as a finite number > 0 "
                         f"(default {default:g}), or leave it out")
    return float(value)


def _gradient_options(keywords: Mapping[str, Any]) -> GradientOptions:
    follow_order = _flag(keywords, "follow_order", "run gradient ops in the planned order",
                         "leave the order to TensorFlow")
    stop = keywords.get("stop_gradients")
    stop = () if stop is None else tuple(stop) if isinstance(stop, (list, tuple)) else (stop,)
    return GradientOptions(
        name=keywords.get("name") or GradientOptions.name,
        unconnected_gradients=tf.UnconnectedGradients(keywords.get("unconnected_gradients", "none")),
        stop_gradients=stop,
        passed_through=tuple((key, keywords[key]) for key in PASSED_THROUGH if key in keywords),
        follow_order=follow_order,
    )


def _planner_options(keywords: Mapping[str, Any]) -> PlannerOptions:
    keep_x = _flag(keywords, "keep_x_gradients", "predict as if the gradients are held to the end",
                   "as if each is consumed when made")
    return PlannerOptions(
        batch_size=_batch_size(keywords.get("batch_size")),
        batch_size_given=keywords.get("batch_size") is not None,
        keep_x_gradients=bool(keep_x),
        profile=_flag(keywords, "profile", "measure kernel temporaries", "do not count them"),
        planning_time=_planning_time(keywords.get("planning_time", DEFAULT_PLANNING_SECONDS)),
        split=_split(keywords.get("split")),
        multilevel=bool(_flag(keywords, "multilevel", "allow multi-level plans under a budget",
                              "single-level plans only")),
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
    if not _finite_positive(value):
        raise ValueError(f"planning_time={value!r} is not supported: give the seconds of simulation a plan may "
                         "take as a finite positive number (default 30), or None for no limit")
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
    given: Optional[SwapOptions] = keywords.get("swap_options")
    if given is not None and not isinstance(given, SwapOptions):
        raise TypeError(f"swap_options={given!r} is not supported: give memsaving.SwapOptions(...) or leave it out")
    backend = keywords.get("swap_backend", given.backend if given is not None else None)
    settings = SwapSettings(swap=_swap(keywords.get("swap")), backend=backend)
    if not settings.on:
        return settings  # the swap options are read only when swapping is asked for
    if given is not None:
        _device({"swap_device": given.device}, "swap_device", given.device)
        return SwapSettings(swap=settings.swap, emit=given, backend=backend)
    defaults = SwapOptions()
    emit = SwapOptions(
        device=_device(keywords, "swap_device", defaults.device),
        trigger=keywords.get("swap_trigger") or defaults.trigger,
        lb=_swap_distance(keywords, "swap_lb", defaults.lb),
        ub=_swap_distance(keywords, "swap_ub", defaults.ub),
        fuse=_fuse(keywords, defaults.fuse),
    )
    return SwapSettings(swap=settings.swap, emit=emit, backend=settings.backend)


SWAP_FORMS = ("swap=True (every tensor the backward pass reads from the forward pass), swap='auto' (with budget=), "
              "a list of tensors, or False / leave it out")
"""What ``swap=`` takes (README, "Swapping to host memory")."""


def _swap(value) -> Any:
    """``swap=`` checked: None or False (off), True, ``"auto"``, a tensor
    or a list (or tuple) of tensors; a numpy bool counts as a bool.  Which
    tensors can be swapped is decided on the plan
    (``memsaving.api._swapped``)."""
    if isinstance(value, np.bool_):
        return bool(value)
    if value is None or isinstance(value, bool) or is_tensor_like(value):
        return value
    if isinstance(value, str):
        if value == "auto":
            return value
        raise ValueError(f"swap={value!r} is not supported: use {SWAP_FORMS}")
    if isinstance(value, (list, tuple)):
        for element in value:
            if not is_tensor_like(element):
                raise TypeError(f"swap: the list holds a {type(element).__name__} ({element!r:.60}); it must hold "
                                "tensors of the forward pass (or pass swap=True or swap='auto')")
        return value
    raise TypeError(f"swap={value!r:.60} ({type(value).__name__}) is not supported: use {SWAP_FORMS}")


def _fuse(keywords: Mapping[str, Any], default: bool) -> bool:
    """``swap_fuse``, which times swap-ins and parameter copies alike."""
    fuse = _flag(keywords, "swap_fuse", "readers close together share one copy", "one copy per reader")
    return default if fuse is None else fuse


def _device(keywords: Mapping[str, Any], key: str, default: str) -> str:
    """The device option ``key`` (``swap_device``, ``offload_device``):
    a device of this process (``tf.config.list_logical_devices()``).  A
    device that does not exist would only fail when the step runs, or be
    silently replaced by another under soft placement."""
    value = keywords.get(key) or default
    if not isinstance(value, str):
        raise TypeError(f"{key}={value!r} is not supported: give a device name such as '/CPU:0'")
    available = [device.name for device in tf.config.list_logical_devices()]
    try:
        present = any(same_device(value, name) for name in available)
    except ValueError:  # not a device string at all
        present = False
    if not present:
        raise ValueError(f"{key}={value!r} names no device of this process; available "
                         f"(tf.config.list_logical_devices()): {', '.join(available)}")
    return value


def _swap_distance(keywords: Mapping[str, Any], key: str, default: int) -> int:
    value = keywords.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{key} must be an int number of topological levels (default {default}), got {value!r}")
    return int(value)


def _offload_settings(keywords: Mapping[str, Any]) -> OffloadSettings:
    offload = _flag(keywords, "offload_params", "variables and optimizer state on the host device, "
                    "offload_device", "they stay where they are")
    if not offload:
        return OffloadSettings()
    if keywords.get("split") is not None:
        raise ValueError("split= cannot be combined with offload_params= yet: choose one of them")
    given = keywords.get("offload_options")
    if given is not None:
        if not isinstance(given, OffloadOptions):
            raise TypeError(f"offload_options={given!r} is not supported: give memsaving.OffloadOptions(...) "
                            "or leave it out")
        _device({"offload_device": given.device}, "offload_device", given.device)
        return OffloadSettings(given)
    defaults = OffloadOptions()
    return OffloadSettings(OffloadOptions(
        device=_device(keywords, "offload_device", defaults.device),
        trigger=keywords.get("swap_trigger") or defaults.trigger,
        lb=_swap_distance(keywords, "swap_lb", defaults.lb),
        ub=_swap_distance(keywords, "swap_ub", defaults.ub),
        fuse=_fuse(keywords, defaults.fuse),
    ))
