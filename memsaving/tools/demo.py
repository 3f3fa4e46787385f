"""The built-in demo: one gradient step of a deep Keras MLP, plain vs memsaving.

Prints peak memory (measured on the allocator, beside the plan's
prediction), step time and the largest gradient difference, side by side,
so a user sees in a minute what the package does on their machine.  The
model is a stack of Keras ``Dense`` layers, as users build it, and
TensorFlow runs with its default settings (Grappler on, default thread
pools).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

import memsaving
from memsaving.tf.measure import measure_peak


@dataclass
class DemoResult:
    """Measured and predicted peaks (absolute bytes: weights and input
    included), best step times, and the largest relative difference between
    the two ways' gradients."""

    peak_plain: int
    peak_memsaving: int
    predicted_plain: int
    predicted_memsaving: int
    seconds_plain: float
    seconds_memsaving: float
    max_relative_difference: float


def dense_stack(depth: int, width: int) -> keras.Sequential:
    """``depth`` Keras ``Dense(width, activation="relu")`` layers."""
    return keras.Sequential([keras.Input((width,))]
                            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)])


def run_demo(depth: int = 64, batch: int = 2048, width: int = 256, checkpoints="memory",
             repeats: int = 3, seed: int = 0) -> DemoResult:
    """Build a ``depth``-layer Keras ReLU MLP and compare one gradient step both ways.

    Peaks are the largest of ``repeats`` measured runs after a warm-up run;
    times the best of ``repeats``."""
    keras.utils.set_random_seed(seed)
    model = dense_stack(depth, width)
    x = tf.constant(np.random.default_rng(seed).standard_normal((batch, width)).astype(np.float32))
    plans = {}

    def grads(use_memsaving):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        weights = model.trainable_variables
        if use_memsaving:
            result, plans["memsaving"] = memsaving.gradients_and_plan(loss, weights, checkpoints=checkpoints,
                                                                      batch_size=batch)
            return result
        return tf.gradients(loss, weights)

    # Steps reduce the gradients to one number so returned weight gradients do
    # not dominate the peak; the full gradients are compared separately.
    plain_step = tf.function(lambda: tf.add_n([tf.reduce_sum(g) for g in grads(False)]))
    ours_step = tf.function(lambda: tf.add_n([tf.reduce_sum(g) for g in grads(True)]))
    plain_grads = tf.function(lambda: grads(False))()
    ours_grads = tf.function(lambda: grads(True))()
    difference = max(
        float(np.max(np.abs(a.numpy() - b.numpy())) / max(float(np.max(np.abs(a.numpy()))), 1e-30))
        for a, b in zip(plain_grads, ours_grads)
    )
    del plain_grads, ours_grads

    def timed(step):
        step().numpy()  # trace and warm up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step().numpy()
            best = min(best, time.perf_counter() - start)
        return best

    seconds_plain, seconds_ours = timed(plain_step), timed(ours_step)
    peak_plain = max(measure_peak(plain_step) for _ in range(repeats))
    peak_ours = max(measure_peak(ours_step) for _ in range(repeats))
    plan = plans["memsaving"]  # the step's own plan; its plain_peak is the same model's plain prediction
    return DemoResult(peak_plain, peak_ours, plan.plain_peak, plan.predicted_peak, seconds_plain, seconds_ours,
                      difference)


def format_result(result: DemoResult, depth: int, batch: int, width: int, checkpoints) -> str:
    mib = 2 ** 20
    lines = [
        f"memsaving demo: {depth} Keras Dense({width}, relu) layers, batch {batch}, checkpoints={checkpoints!r}",
        "",
        f"{'':28}{'tf.gradients':>14}{'memsaving':>14}{'ratio':>10}",
        f"{'peak memory (MiB)':28}{result.peak_plain / mib:14.1f}{result.peak_memsaving / mib:14.1f}"
        f"{result.peak_plain / result.peak_memsaving:9.2f}x",
        f"{'  predicted by the plan':28}{result.predicted_plain / mib:14.1f}{result.predicted_memsaving / mib:14.1f}"
        f"{result.predicted_plain / max(result.predicted_memsaving, 1):9.2f}x",
        f"{'step time (s)':28}{result.seconds_plain:14.3f}{result.seconds_memsaving:14.3f}"
        f"{result.seconds_memsaving / result.seconds_plain:9.2f}x",
        "",
        f"max relative gradient difference: {result.max_relative_difference:.2e}",
        "(peaks: weights and input included, measured with memsaving.measure_peak, TensorFlow's default settings;",
        " peak ratio = plain / memsaving, higher is better; time ratio = memsaving / plain)",
    ]
    return "\n".join(lines)


def main(depth: int = 64, batch: int = 2048, width: int = 256, checkpoints="memory") -> int:
    result = run_demo(depth, batch, width, checkpoints)
    print(format_result(result, depth, batch, width, checkpoints))
    return 0
