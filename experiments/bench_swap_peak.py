"""Swap plans: measured peak against predicted, with the host-store backend.

This machine has no GPU, so device and host share one allocator; the test
backend (``memsaving.tf.swap_rewrite.HostStoreBackend``) moves swapped bytes
into a numpy store outside TensorFlow's allocator, which makes what swapping
saves measurable.  For tanh MLPs of several shapes and both trigger
strategies, every tensor the backward pass reads is swapped
(``checkpoints=[]``, ``swap=True``) and the step's peak above the memory in
use before it is measured, beside plain tf.gradients and the plan's
prediction.  The cost model is this CPU's: about 50 GFLOP/s, copies to the
store at about 10 GB/s.

    python -m experiments.bench_swap_peak
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import memsaving  # noqa: E402  (allocator setup before TensorFlow)
import tensorflow as tf  # noqa: E402
from memsaving.tf.swap_rewrite import HostStoreBackend  # noqa: E402

# depth, width, batch, swap_lb, swap_trigger
CONFIGS = [
    (32, 128, 512, 2, "direct"),
    (16, 128, 512, 3, "direct"),
    (32, 256, 256, 2, "chain"),
    (24, 64, 1024, 1, "direct"),
    (32, 128, 512, 4, "chain"),
    (8, 512, 128, 2, "direct"),
    (32, 128, 512, 0, "direct"),
]
MiB = 2 ** 20


def _mlp(depth: int, width: int):
    ws = [tf.Variable(tf.random.normal([width, width], stddev=width ** -0.5, seed=i)) for i in range(depth)]

    def loss(x):
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        return tf.reduce_mean(h * h)

    return ws, loss


def measure(depth: int, width: int, batch: int, lb: int, trigger: str):
    """(plain measured, swap measured, swap predicted), bytes above resident."""
    ws, loss = _mlp(depth, width)
    backend = HostStoreBackend()
    plans = {}

    def step(swap: bool):
        options = dict(checkpoints=[])
        if swap:
            options.update(swap=True, swap_options=memsaving.SwapOptions(lb=lb, trigger=trigger, backend=backend),
                           flops_per_second=5e10, bandwidth=1e10)

        @tf.function
        def run(x):
            plans[swap] = memsaving.plan(loss(x), ws, **options)
            grads = memsaving.gradients(loss(x), ws, **options)
            return tf.add_n([tf.reduce_sum(g) for g in grads])

        return run

    x = tf.random.normal([batch, width], seed=1)
    plain, swapping = step(False), step(True)
    plain(x)
    swapping(x)
    measured_plain = memsaving.measure_peak_increase(plain, x)
    measured_swap = memsaving.measure_peak_increase(swapping, x)
    predicted = plans[True].predicted_peak - plans[True].resident_bytes
    return measured_plain, measured_swap, predicted


def main() -> None:
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"{'MLP':>14} {'lb':>3} {'trigger':>7} {'plain MiB':>10} {'swap MiB':>9} {'predicted':>9} {'ratio':>6}")
    for depth, width, batch, lb, trigger in CONFIGS:
        plain, swap, predicted = measure(depth, width, batch, lb, trigger)
        shape = f"{depth}x{width} b{batch}"
        print(f"{shape:>14} {lb:>3} {trigger:>7} {plain / MiB:>10.2f} {swap / MiB:>9.2f} "
              f"{predicted / MiB:>9.2f} {swap / predicted:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
