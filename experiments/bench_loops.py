"""Loops checkpointed inside: a recurrent step's memory and time, plain against memory mode.

For each model, ``tf.gradients`` and ``memsaving.gradients(checkpoints="memory")``
(whose loops keep one state every ceil(sqrt(T)) iterations, see
:mod:`memsaving.tf.loop_checkpoints`) run the same loss in a process of
their own, with TensorFlow's default settings.  Printed: the step's own
memory (``measure_peak_increase``, lowest and highest of ``--repeats`` runs),
the ratio, the plan's predictions (its peak less its resident bytes), the
median step time of each (alternating rounds) and the largest difference
between the two gradients, relative to the largest gradient.

``python -m experiments.bench_loops [--models lstm,gru,scan] [--repeats 3]``
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Dict, List

from experiments.child_figures import each_model, models_asked

MODELS: Dict[str, str] = {
    "lstm": "LSTM(128) over 512 steps of 32 features, batch 32",
    "gru": "GRU(128) over 512 steps of 32 features, batch 32",
    "scan": "tf.scan of a two-layer cell (h = tanh(relu([x, h] W1) W2), 64 wide, 256 inside) over 512 steps, "
            "batch 32",
    "scan-small": "tf.scan of a tanh recurrence (h = tanh(x + h W), 64 wide) over 512 steps, batch 32",
}
MiB = 2 ** 20


def _build(name: str):
    """(loss function of x, the variables, x)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    if name.startswith("scan"):
        x = tf.random.stateless_normal([512, 32, 64], [1, 2])
        if name == "scan-small":
            w = tf.Variable(tf.random.stateless_normal([64, 64], [3, 3]) * 0.2)
            weights = [w]

            def cell(h, xt):
                return tf.tanh(xt + h @ w)
        else:
            w1 = tf.Variable(tf.random.stateless_normal([128, 256], [3, 3]) * 0.1)
            w2 = tf.Variable(tf.random.stateless_normal([256, 64], [4, 4]) * 0.1)
            weights = [w1, w2]

            def cell(h, xt):
                return tf.tanh(tf.nn.relu(tf.concat([xt, h], 1) @ w1) @ w2)

        def scan_loss(x):
            states = tf.scan(cell, x, initializer=tf.zeros([32, 64]))
            return tf.reduce_sum(tf.square(states))

        return scan_loss, weights, x
    layer = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU}[name](128)
    x = tf.random.stateless_normal([32, 512, 32], [1, 2])
    layer(x)

    def loss(x):
        return tf.reduce_sum(tf.square(layer(x, training=True)))

    return loss, layer.trainable_variables, x


def measure(name: str, repeats: int) -> Dict[str, object]:
    import memsaving  # first: it turns the CPU allocator's statistics on before TensorFlow starts
    import numpy as np
    import tensorflow as tf

    loss, variables, x = _build(name)
    captured = {}
    plain = tf.function(lambda x: tf.gradients(loss(x), variables + [x]))

    @tf.function
    def ours(x):
        grads, captured["plan"] = memsaving.gradients_and_plan(loss(x), variables + [x], checkpoints="memory")
        return grads

    expected, got = plain(x), ours(x)
    scale = max(float(np.abs(e.numpy()).max()) for e in expected)
    difference = max(float(np.abs(e.numpy() - g.numpy()).max()) for e, g in zip(expected, got)) / scale
    peaks = {"plain": [], "memory": []}
    times = {"plain": [], "memory": []}
    for _ in range(repeats):
        for way, fn in (("plain", plain), ("memory", ours)):
            peaks[way].append(memsaving.measure_peak_increase(fn, x))
            start = time.perf_counter()
            [g.numpy() for g in fn(x)]
            times[way].append(time.perf_counter() - start)
    plan = captured["plan"]
    return {"peaks": peaks, "times": times, "difference": difference,
            "predicted_plain": plan.plain_peak - plan.resident_bytes,
            "predicted_memory": plan.predicted_peak - plan.resident_bytes,
            "loops": len(plan.checkpointed_loops)}


def main(argv: List[str] = None) -> int:
    asked = models_asked(argv, "experiments.bench_loops", __doc__, MODELS, "lstm,gru,scan,scan-small", 3, measure)
    if asked is None:
        return 0
    names, repeats = asked
    print("step memory (MiB, measure_peak_increase, default settings), lowest-highest of "
          f"{repeats} runs; predicted: the plan's peak less its resident bytes; time: median seconds")
    print(f"{'model':10} {'plain':>13} {'memory':>13} {'ratio':>7} {'predicted':>15} {'time plain/memory':>19} "
          f"{'grad diff':>9}")
    for name, f, error in each_model("experiments.bench_loops", names, repeats):
        if f is None:
            print(f"{name:10} failed: {error}")
            continue
        plain, memory = f["peaks"]["plain"], f["peaks"]["memory"]
        t_plain, t_memory = statistics.median(f["times"]["plain"]), statistics.median(f["times"]["memory"])
        print(f"{name:10} {min(plain) / MiB:6.1f}-{max(plain) / MiB:<6.1f} {min(memory) / MiB:6.1f}-"
              f"{max(memory) / MiB:<6.1f} {min(plain) / min(memory):6.2f}x "
              f"{f['predicted_plain'] / MiB:6.1f} / {f['predicted_memory'] / MiB:<6.1f} "
              f"{t_plain:7.3f} / {t_memory:<7.3f} ({t_memory / t_plain:.2f}x) {f['difference']:9.1e}")
        print(f"{'':10} ({MODELS[name]}; {f['loops']} loop(s) checkpointed inside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
