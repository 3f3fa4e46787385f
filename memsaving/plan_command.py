"""``memsaving plan MODEL``: the plan memsaving would run for a Keras model.

The model's training step (a scalar loss of its outputs, gradients with
respect to every trainable weight) is traced at the given batch size, and the
plan is printed: the table of backward units, the predicted peak against
plain backprop, and the predicted compute.  ``--plot`` draws the predicted
memory timelines of plain backprop and the plan.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional, TextIO, Tuple

from memsaving.planning import Plan


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
    try:
        yield
    finally:
        stop.set()
        if ticker:
            ticker.join()
        stream.write(f"{chr(13) if live else ''}{what} ... done in {time.perf_counter() - start:.1f} s\n")
        stream.flush()


def load_model(name_or_path: str, size: int):
    """A saved Keras model (a path) or a built-in one (a name)."""
    import keras

    from memsaving.models import BUILDERS, build

    if os.path.exists(name_or_path):
        return keras.models.load_model(name_or_path, compile=False)
    if name_or_path in BUILDERS:
        return build(name_or_path, size)
    raise SystemExit(f"memsaving plan: {name_or_path!r} is neither a file nor a built-in model "
                     f"({', '.join(sorted(BUILDERS))})")


def trace_plans(model, batch: int, checkpoints="memory", budget=None, swap: str = "off") -> Tuple[Plan, Plan]:
    """The plan for ``model``'s training step and the plain-backprop plan."""
    import tensorflow as tf

    import memsaving

    captured = {}
    specs = [tf.TensorSpec([batch] + list(t.shape[1:]), t.dtype) for t in model.inputs]

    @tf.function
    def step(*inputs):
        outputs = model(list(inputs) if len(inputs) > 1 else inputs[0], training=True)
        loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32))) for o in tf.nest.flatten(outputs)])
        weights = model.trainable_variables
        captured["plain"] = memsaving.plan(loss, weights, checkpoints=[], batch_size=batch)
        swap_kwargs = {"swap": {"auto": "auto", "all": True}[swap]} if swap != "off" else {}
        captured["plan"] = memsaving.plan(loss, weights, checkpoints=checkpoints, budget=budget, batch_size=batch,
                                          **swap_kwargs)
        return loss

    step.get_concrete_function(*specs)
    return captured["plan"], captured["plain"]


def run(model: str, batch: int = 8, size: int = 64, checkpoints: str = "memory", budget: Optional[str] = None,
        swap: str = "off", plot: Optional[str] = None, out: Optional[TextIO] = None) -> Plan:
    """The ``memsaving plan`` command; returns the plan it printed."""
    out = out if out is not None else sys.stdout
    if swap == "auto" and budget is None:
        raise SystemExit("memsaving plan --swap auto: give a --budget too (keep / swap / recompute is chosen under it)")
    with progress(f"loading {model}"):
        keras_model = load_model(model, size)
    with progress(f"tracing and planning the training step of {keras_model.name} (batch {batch})"):
        plan, plain = trace_plans(keras_model, batch, checkpoints, budget, swap)
    out.write(plan.table())
    mib = 2 ** 20
    activations = plan.predicted_peak - plan.resident_bytes
    plain_activations = plain.predicted_peak - plain.resident_bytes
    out.write(f"\nparameters and inputs: {plan.resident_bytes / mib:.1f} MiB; activations and gradients: "
              f"{activations / mib:.1f} MiB with this plan, {plain_activations / mib:.1f} MiB plain "
              f"({plain_activations / max(activations, 1):.2f}x lower); "
              f"overhead {100 * (plan.predicted_compute - 1):.0f}% more compute\n")
    if plot:
        from memsaving.memory_timeline import Timeline, plot_timeline

        def predicted(p: Plan) -> Timeline:
            sim = p.simulation
            return Timeline(p, [p.resident_bytes + b for b in sim.timeline], list(sim.labels), list(sim.unit_ends))

        plot_timeline({"plain tf.gradients": predicted(plain), f"memsaving ({plan.mode})": predicted(plan)}, plot,
                      title=f"{keras_model.name}, batch {batch}: predicted memory")
        out.write(f"timeline plot written to {plot}\n")
    return plan
