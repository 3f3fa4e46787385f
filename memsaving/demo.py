"""The built-in demo: one gradient step of a deep MLP, plain vs memsaving.

Prints peak memory (measured on the allocator), step time and the largest
gradient difference, side by side, so a user sees in a minute what the
package does on their machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

import memsaving
from memsaving.measure import measure_peak


@dataclass
class DemoResult:
    peak_plain: int
    peak_memsaving: int
    seconds_plain: float
    seconds_memsaving: float
    max_relative_difference: float


def _configure_threads() -> None:
    # One inter-op thread makes the measured peak repeat exactly; it must be
    # set before TensorFlow runs its first op, so failure is silently fine.
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass


def run_demo(depth: int = 64, batch: int = 2048, width: int = 256, checkpoints="memory",
             repeats: int = 3, seed: int = 0) -> DemoResult:
    """Build a ``depth``-layer ReLU MLP and compare one gradient step both ways."""
    rng = np.random.default_rng(seed)
    weights = [tf.Variable(rng.standard_normal((width, width)).astype(np.float32) * width ** -0.5)
               for _ in range(depth)]
    x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))

    def loss_fn(inp):
        h = inp
        for w in weights:
            h = tf.nn.relu(tf.matmul(h, w))
        return tf.reduce_mean(h * h)

    def grads(use_memsaving):
        loss = loss_fn(x)
        if use_memsaving:
            return memsaving.gradients(loss, weights, checkpoints=checkpoints)
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
    peak_plain, peak_ours = measure_peak(plain_step), measure_peak(ours_step)
    return DemoResult(peak_plain, peak_ours, seconds_plain, seconds_ours, difference)


def format_result(result: DemoResult, depth: int, batch: int, width: int, checkpoints) -> str:
    mib = 2 ** 20
    lines = [
        f"memsaving demo: {depth}-layer ReLU MLP, batch {batch}, width {width}, checkpoints={checkpoints!r}",
        "",
        f"{'':24}{'tf.gradients':>14}{'memsaving':>14}{'ratio':>10}",
        f"{'peak memory (MiB)':24}{result.peak_plain / mib:14.1f}{result.peak_memsaving / mib:14.1f}"
        f"{result.peak_plain / result.peak_memsaving:9.2f}x",
        f"{'step time (s)':24}{result.seconds_plain:14.3f}{result.seconds_memsaving:14.3f}"
        f"{result.seconds_memsaving / result.seconds_plain:9.2f}x",
        "",
        f"max relative gradient difference: {result.max_relative_difference:.2e}",
        "(peak ratio = plain / memsaving, higher is better; time ratio = memsaving / plain)",
    ]
    return "\n".join(lines)


def main(depth: int = 64, batch: int = 2048, width: int = 256, checkpoints="memory") -> int:
    _configure_threads()
    result = run_demo(depth, batch, width, checkpoints)
    print(format_result(result, depth, batch, width, checkpoints))
    return 0
