"""``memsaving plan MODEL``: the plan memsaving would run for a Keras model.

The model's training step (a scalar loss of its outputs, gradients with
respect to every trainable weight) is traced at the given batch size, and the
plan is printed: the table of backward units, the predicted peak against
plain backprop, and the predicted compute.  ``--plot`` draws the predicted
memory timelines of plain backprop and the plan.

Saved models are called with the input structure they were built with (a
single tensor, a list, or a dict of named inputs, as keras_hub models take),
with each input's own dtype; ``--size`` gives every unknown non-batch
dimension (sequence lengths, image sizes) a value, and ``--import`` loads the
modules that define a model's custom layers first.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple, Union

from memsaving.errors import MemsavingError
from memsaving.planners.planning import Plan
from memsaving.tools.arguments import UsageError, check_plot_path, import_tensorflow_quietly, unreadable_model_reason
from memsaving.tools.footprints import BUILT_IN, Footprint, archive_footprint, refuse_if_too_big

DEFAULT_SIZE = 64
"""Image size / sequence length of the built-in models when ``--size`` is not given."""


@dataclass
class Clock:
    """Wall and CPU seconds of one part of the command (for ``--verbose``).

    CPU time is the process's (every thread), so on a shared machine a wall
    time well above the CPU time means the command waited for a core.
    """

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: "Clock") -> "Clock":
        return Clock(self.wall + other.wall, self.cpu + other.cpu)

    def __sub__(self, other: "Clock") -> "Clock":
        return Clock(self.wall - other.wall, self.cpu - other.cpu)


@contextmanager
def timed(into: Dict[str, Clock], key: str) -> Iterator[None]:
    """Add the wall and CPU time of the ``with`` body to ``into[key]``."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        into[key] = into.get(key, Clock()) + Clock(time.perf_counter() - wall, time.process_time() - cpu)


@contextmanager
def progress(what: str, stream: Optional[TextIO] = None):
    """Show ``what`` with a running clock while it runs, then its duration.

    On a terminal the line updates every half second; elsewhere (logs, CI)
    one line is printed when the step ends.
    """
    stream = stream if stream is not None else sys.stderr
    start = time.perf_counter()
    stop = threading.Event()
    live = hasattr(stream, "isatty") and stream.isatty()

    def tick():
        while not stop.wait(0.5):
            stream.write(f"\r{what} ... {time.perf_counter() - start:.0f} s")
            stream.flush()

    ticker = threading.Thread(target=tick, daemon=True) if live else None
    if ticker:
        ticker.start()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        stop.set()
        if ticker:
            ticker.join()
        stream.write(f"{chr(13) if live else ''}{what} ... {outcome} {time.perf_counter() - start:.1f} s\n")
        stream.flush()


def import_modules(names: Sequence[str]) -> None:
    """Import the modules that define a saved model's custom layers.

    Keras finds a custom class only if the module that registers it (with
    ``@keras.saving.register_keras_serializable``) has been imported before
    loading.  Each name is a module (``keras_hub``, ``my_package.layers``),
    looked up on ``sys.path`` and in the current directory, or a ``.py`` file.
    """
    if names and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # the console script, unlike ``python -m``, does not look here
    for name in names:
        try:
            if name.endswith(".py"):
                if not os.path.isfile(name):
                    raise FileNotFoundError(f"no such file: {name}")
                module_name = os.path.splitext(os.path.basename(name))[0]
                spec = importlib.util.spec_from_file_location(module_name, name)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(name)
        except Exception as error:  # pylint: disable=broad-except  # any failure of user code: say which
            sys.modules.pop(os.path.splitext(os.path.basename(name))[0] if name.endswith(".py") else name, None)
            raise SystemExit(f"memsaving plan --import {name}: the import failed: {type(error).__name__}: "
                             f"{error}. Give a module importable from the current directory or PYTHONPATH "
                             "(e.g. --import keras_hub or --import my_layers), or the path of a .py file, "
                             "and check that its own imports are installed.") from error


def _loading_advice(path: str, error: Exception) -> str:
    """The message for a model that Keras could not load, with what to do."""
    text = str(error)
    missing = re.search(r"Could not deserialize \w+ '([^']+)' because its parent module (\S+) cannot be imported",
                        text)
    if missing:
        package = missing.group(2).split(".")[0]
        return (f"memsaving plan: cannot load {path}: its class {missing.group(1)!r} comes from the package "
                f"{package!r}, which is not installed here; install it (e.g. pip install "
                f"{package.replace('_', '-')}) and run again (adding --import {package} if needed).")
    unknown = re.search(r"Could not locate (?:class|function) '([^']+)'|Unknown [\w ]+: '([^']+)'", text)
    if unknown:
        name = unknown.group(1) or unknown.group(2)
        return (f"memsaving plan: cannot load {path}: it uses {name!r}, which Keras does not know. Import the "
                f"module that defines it with --import MODULE (repeatable), e.g. --import keras_hub or "
                f"--import my_layers for a file my_layers.py whose classes are decorated with "
                f"@keras.saving.register_keras_serializable().")
    short = text.split(" Full object config:")[0]
    return f"memsaving plan: cannot load {path}: {type(error).__name__}: {short}"


def check_model_argument(model: str, batch: int, size: Optional[int] = None) -> bool:
    """Whether ``model`` names a saved model file (else a built-in one), once
    it is known the command can load it; before TensorFlow is imported.

    Raises :class:`UsageError` for a name that is neither a file nor a
    built-in model, and for a built-in model at a size it cannot be built
    at or too big for this machine (:func:`refuse_if_too_big`); exits with
    status 1 for a file that is no Keras model (truncated, damaged, of
    another type), with the reason.
    """
    if os.path.exists(model):
        reason = unreadable_model_reason(model)
        if reason:
            raise SystemExit(f"memsaving plan: cannot load {model}: not a readable Keras model: {reason}")
        bound = archive_footprint(model, size)
        if bound is not None:  # refused before loading (TensorFlow takes seconds) when even this bound is too big
            refuse_if_too_big(bound, batch, f"a training step of {model}", "give a smaller --batch or --size")
        return True
    if model not in BUILT_IN:
        raise UsageError(f"{model!r}: no such file, and no built-in model of that name: give the path of a saved "
                         f"Keras model (.keras, .h5) or one of {', '.join(sorted(BUILT_IN))}")
    size = size or DEFAULT_SIZE
    problem = BUILT_IN[model].size_problem(size)
    if problem:
        raise UsageError(f"--size {size}: {model} takes an image size that {problem}: give such a --size")
    refuse_if_too_big(BUILT_IN[model].footprint(size), batch, f"a training step of {model} at size {size}",
                      "give a smaller --size or --batch")
    return False


def load_model(name_or_path: str, size: Optional[int] = None):
    """A saved Keras model (a path) or a built-in one (a name, built at ``size``;
    :func:`check_model_argument` says first whether it can be)."""
    import keras

    from memsaving.tools.models import build

    if os.path.exists(name_or_path):
        try:
            return keras.models.load_model(name_or_path, compile=False)
        except Exception as error:  # pylint: disable=broad-except  # Keras raises TypeError/ValueError/...
            raise SystemExit(_loading_advice(name_or_path, error)) from error
    return build(name_or_path, size or DEFAULT_SIZE)


def model_footprint(model, size: Optional[int] = None) -> Footprint:
    """What a training step of the loaded ``model`` takes, from its weights and its layers' output shapes.

    Every unknown non-batch dimension is ``size`` (1 when None).  Only the
    layers' outputs are counted, not the tensors inside a layer (a
    MultiHeadAttention's scores): the activations are a lower bound.
    """
    import tensorflow as tf

    def sample_bytes(tensor) -> int:
        dims = [(size or 1) if d is None else int(d) for d in tuple(tensor.shape)[1:]]
        return math.prod(dims) * tf.as_dtype(tensor.dtype).size

    parameter_bytes = sum(math.prod(int(d) for d in w.shape) * tf.as_dtype(w.dtype).size for w in model.weights)
    activation_bytes = 0
    for layer in model.layers:
        try:
            outputs = tf.nest.flatten(layer.output)
        except (AttributeError, ValueError):  # a layer never called on a KerasTensor records no output
            continue
        activation_bytes += sum(sample_bytes(t) for t in outputs if hasattr(t, "shape"))
    return Footprint(parameter_bytes, activation_bytes)


def _model_inputs(model) -> Any:
    """The structure ``model`` is called with: one KerasTensor, a list, or a dict.

    Functional models (keras_hub's included) record it, publicly, as
    ``model.input``; a Sequential model has one input (``model.inputs``).
    """
    try:
        structure = model.input
    except (AttributeError, ValueError):
        structure = None
    if structure is None:
        try:
            flat = list(model.inputs or [])
        except (AttributeError, ValueError):
            flat = []
        structure = flat[0] if len(flat) == 1 else (flat or None)
    if structure is None:
        raise SystemExit(
            f"memsaving plan: model {model.name!r} ({type(model).__name__}) has no recorded inputs, so its "
            "training step cannot be traced: save a functional or Sequential model built on keras.Input(...) "
            "(a subclassed model that was never built on Inputs does not record them).")
    return structure


def input_signature(model, batch: int, size: Optional[int] = None) -> Tuple[Any, bool]:
    """``tf.TensorSpec`` s in the structure of ``model``'s inputs, and whether ``size`` was used.

    The batch dimension becomes ``batch``; every other unknown dimension
    becomes ``size``.  Dtypes are the inputs' own (int32 token ids and
    padding masks stay integers).
    """
    import tensorflow as tf

    used = []

    def spec(path, tensor) -> tf.TensorSpec:
        keys = [p for p in path if isinstance(p, str)]  # dict keys name inputs; list positions do not
        name = "/".join(keys) if keys else str(getattr(tensor, "name", None) or "input")
        if getattr(tensor, "sparse", False) or getattr(tensor, "ragged", False):
            raise SystemExit(f"memsaving plan: input {name!r} is sparse or ragged; only dense inputs can be traced")
        shape = list(tensor.shape)
        if not shape:
            raise SystemExit(f"memsaving plan: input {name!r} is a scalar; inputs need a batch dimension")
        if shape[0] is not None and shape[0] != batch:
            raise SystemExit(f"memsaving plan: input {name!r} has a fixed batch size {shape[0]} (shape "
                             f"{tuple(tensor.shape)}): run with --batch {shape[0]}")
        shape[0] = batch
        for axis, dim in enumerate(shape[1:], start=1):
            if dim is None:
                if size is None:
                    raise SystemExit(
                        f"memsaving plan: input {name!r} has shape {tuple(tensor.shape)}: dimension {axis} is "
                        "unknown (a sequence length or image size); give it with --size N (sets every unknown "
                        "non-batch dimension).")
                shape[axis] = size
                used.append(name)
        return tf.TensorSpec(shape, tf.as_dtype(tensor.dtype), name=_placeholder_name(name))

    specs = _map_with_path(spec, _model_inputs(model))
    return specs, bool(used)


def _placeholder_name(name: str) -> str:
    """``name`` as a valid graph op name (dict keys may hold any character)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return cleaned if re.match(r"[A-Za-z0-9.]", cleaned) else f"input{cleaned}"


def _map_with_path(fn, structure, path=()):
    """``fn(path, leaf)`` over a nest of dicts, lists and tuples (the shapes Keras inputs take)."""
    if isinstance(structure, dict):
        return {k: _map_with_path(fn, v, path + (k,)) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        mapped = [_map_with_path(fn, v, path + (i,)) for i, v in enumerate(structure)]
        return mapped if isinstance(structure, list) else tuple(mapped)
    return fn(path, structure)


def describe_signature(specs) -> str:
    """``name dtype[shape]`` for every input, for messages."""
    import tensorflow as tf

    parts = []
    for spec in tf.nest.flatten(specs):
        parts.append(f"{spec.name} {spec.dtype.name}{list(spec.shape)}")
    return ", ".join(parts)


@dataclass
class Traced:
    """What tracing the training step gave: the plans and where the time went."""

    plan: Plan
    plain: Optional[Plan]
    """The plain-backprop plan, only planned when its timeline is needed (``--plot``):
    its peak is ``plan.plain_peak`` already."""
    signature: Any
    size_used: bool
    """Whether ``size`` filled an unknown input dimension."""
    graph_ops: int
    """Ops in the traced graph when planning started (forward pass and loss)."""
    clocks: Dict[str, Clock] = field(default_factory=dict)
    """``"step"`` (the whole trace), ``"plan"`` and ``"plain plan"`` (inside memsaving.plan)."""


def trace_plans(model, batch: int, checkpoints="memory", budget=None, swap: str = "off",
                size: Optional[int] = None, plain: bool = True) -> Traced:
    """Trace ``model``'s training step once and plan it (and plain backprop, if ``plain``).

    Planning happens while the step is traced, on the graph tf.function
    builds; no op is run.
    """
    import tensorflow as tf

    import memsaving

    signature, size_used = input_signature(model, batch, size)
    weights = model.trainable_variables
    if not weights:
        raise SystemExit(f"memsaving plan: model {model.name!r} has no trainable weights: nothing to differentiate")
    captured: Dict[str, Any] = {}
    clocks: Dict[str, Clock] = {}

    @tf.function
    def step(inputs):
        try:
            outputs = model(inputs, training=True)
        except Exception as error:  # pylint: disable=broad-except  # reported with the inputs it was given
            captured["call error"] = error
            raise
        floats = [o for o in tf.nest.flatten(outputs) if o.dtype.is_floating]
        if not floats:
            raise SystemExit(f"memsaving plan: model {model.name!r} has no floating-point output to build a "
                             "loss from")
        loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32))) for o in floats])
        captured["graph ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        if plain:
            with timed(clocks, "plain plan"):
                captured["plain"] = memsaving.plan(loss, weights, checkpoints=[], batch_size=batch)
        swap_kwargs = {"swap": {"auto": "auto", "all": True}[swap]} if swap != "off" else {}
        with timed(clocks, "plan"):
            try:
                captured["plan"] = memsaving.plan(loss, weights, checkpoints=checkpoints, budget=budget,
                                                  batch_size=batch, **swap_kwargs)
            except MemsavingError as error:  # raised again below as it was, not as tf.function re-wraps it
                captured["plan error"] = error
                raise
        return loss

    try:
        with timed(clocks, "step"):
            step.get_concrete_function(signature)
    except Exception as error:  # pylint: disable=broad-except
        if "plan error" in captured:
            raise captured["plan error"] from None
        if "call error" not in captured:
            raise
        original = captured["call error"]
        raise SystemExit(f"memsaving plan: calling model {model.name!r} on inputs {describe_signature(signature)} "
                         f"failed: {type(original).__name__}: {original}\n(--batch sets the batch size, --size "
                         "every unknown non-batch dimension)") from error
    return Traced(captured["plan"], captured.get("plain"), signature, size_used, captured["graph ops"], clocks)


def _verbose_report(clocks: Dict[str, Clock], traced: Traced, stream: TextIO) -> None:
    """Where the time went, wall and CPU, and how big the traced graph is."""
    inside = clocks.get("plan", Clock()) + clocks.get("plain plan", Clock())
    rows: List[Tuple[str, Clock]] = [(k, v) for k, v in clocks.items() if k.startswith("import ")]
    rows.append(("loading the model", clocks["load"]))
    rows.append(("tracing the step (model call, loss)", clocks["step"] - inside))
    rows.append((f"memsaving.plan ({traced.plan.mode})", clocks["plan"]))
    if "plain plan" in clocks:
        rows.append(("memsaving.plan (plain backprop, for --plot)", clocks["plain plan"]))
    total = Clock()
    for _, clock in rows:
        total = total + clock
    rows.append(("total", total))
    stream.write("time, wall / CPU seconds (CPU of every thread; wall above CPU means waiting for a core):\n")
    for label, clock in rows:
        stream.write(f"  {label:45} {clock.wall:8.2f} {clock.cpu:8.2f}\n")
    stream.write(f"inputs: {describe_signature(traced.signature)}\n")
    stream.write(f"graph: {traced.graph_ops} ops traced (forward pass and loss); plan: "
                 f"{len(traced.plan.kept_ops)} kept ops, {len(traced.plan.segments)} backward units, "
                 f"{sum(s.ops for s in traced.plan.segments)} ops in them\n")


def run(model: str, batch: int = 8, size: Optional[int] = None, checkpoints: str = "memory",
        budget: Union[int, str, None] = None, swap: str = "off", plot: Optional[str] = None,
        out: Optional[TextIO] = None, imports: Sequence[str] = (), verbose: bool = False,
        err: Optional[TextIO] = None) -> Plan:
    """The ``memsaving plan`` command; returns the plan it printed.

    ``size`` is the image size / sequence length of a built-in model
    (default 64), and for a saved model the value of every unknown
    non-batch input dimension.  ``imports`` are imported before loading
    (modules defining custom layers).  ``verbose`` reports where the time
    went on ``err`` (default stderr).

    What can be told before loading is checked first, without TensorFlow
    (:func:`check_model_argument`, the plot's path); a saved model too big
    for this machine is refused once loaded, before its step is traced.
    Arguments that cannot work raise :class:`UsageError`.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if swap == "auto" and budget is None:
        raise UsageError("--swap auto: give a --budget too (keep / swap / recompute is chosen under it)")
    if plot:
        check_plot_path(plot)
    saved = check_model_argument(model, batch, size)
    clocks: Dict[str, Clock] = {}
    with timed(clocks, "import tensorflow"):
        import_tensorflow_quietly()
    for name in imports:
        with timed(clocks, f"import {name}"):
            import_modules([name])
    with progress(f"loading {model}", err), timed(clocks, "load"):
        keras_model = load_model(model, size)
    if saved:
        refuse_if_too_big(model_footprint(keras_model, size), batch,
                          f"a training step of {model}" + (f" at size {size}" if size else ""),
                          "give a smaller --batch" + (" or --size" if size else ""))
    with progress(f"tracing and planning the training step of {keras_model.name} (batch {batch})", err):
        traced = trace_plans(keras_model, batch, checkpoints, budget, swap, size if saved else None,
                             plain=bool(plot))
    if saved and size is not None and not traced.size_used:
        err.write(f"note: --size {size} was not used: every non-batch input dimension of {model} is known\n")
    plan = traced.plan
    clocks.update(traced.clocks)
    out.write(plan.table())
    mib = 2 ** 20
    activations = plan.predicted_peak - plan.resident_bytes
    plain_activations = plan.plain_peak - plan.resident_bytes
    out.write(f"\nin use before the step (parameters, inputs): {plan.resident_bytes / mib:.1f} MiB; "
              f"activations and gradients: {activations / mib:.1f} MiB with this plan, "
              f"{plain_activations / mib:.1f} MiB plain "
              f"({plain_activations / max(activations, 1):.2f}x lower); "
              f"overhead {100 * (plan.predicted_compute - 1):.0f}% more compute\n")
    if plot:
        from memsaving.tools.memory_timeline import Timeline, plot_timeline

        def predicted(p: Plan) -> Timeline:
            sim = p.simulation
            return Timeline(p, [p.resident_bytes + b for b in sim.timeline], list(sim.labels), list(sim.unit_ends))

        plot_timeline({"plain tf.gradients": predicted(traced.plain), f"memsaving ({plan.mode})": predicted(plan)},
                      plot, title=f"{keras_model.name}, batch {batch}: predicted memory")
        out.write(f"timeline plot written to {plot}\n")
    if verbose:
        _verbose_report(clocks, traced, err)
    return plan
