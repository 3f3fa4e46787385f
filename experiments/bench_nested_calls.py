"""ConvNeXt, whose every block runs a grouped convolution through a nested
``tf.function(jit_compile=True)``: plain backprop, memory mode and
``fit_to_budget``, measured beside their predictions.

Each row runs in a Python process of its own (a measured peak depends on
what the allocator held before), with TensorFlow's default threads.  The
step is a training step's gradient computation: the mean squared output,
``tf.gradients`` or ``memsaving.gradients`` with respect to every trainable
weight, the gradients reduced to a scalar inside the step.  Peaks are the
allocator's whole peak (weights included), the highest of three runs after a
warm-up; the gradient difference is the largest relative difference from
``tf.gradients`` in the same process.

``fit_to_budget`` calibrates the step that returns the gradients, all of
them alive when it ends (108 MiB here): it measured 438.7 MiB for a plan
predicted at 388.5, so a 440 MiB budget is refused with a BudgetError; the
default budget is 480 MiB.

    python -m experiments.bench_nested_calls                      # ConvNeXtTiny, 64x64, batch 8: ~2 minutes
    python -m experiments.bench_nested_calls --size 32 --batch 4                 # a smaller run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 2 ** 20


def _row(mode: str, size: int, batch: int, budget: str) -> dict:
    import memsaving
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(size, size, 3), classes=10)
    x = tf.random.stateless_normal([batch, size, size, 3], seed=(1, 2))
    variables = model.trainable_variables
    plans = {}

    def body(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        if mode == "plain":
            plans["plan"] = memsaving.plan(loss, variables, checkpoints=[], profile=True)
            return tf.gradients(loss, variables)
        if mode == "memory":
            grads, plans["plan"] = memsaving.gradients_and_plan(loss, variables, checkpoints="memory")
            return grads
        return memsaving.gradients(loss, variables, checkpoints="memory", budget=budget)

    start = time.perf_counter()
    if mode == "fit_to_budget":
        gradients_fn = memsaving.fit_to_budget(body, x, budget=budget, restore_variables=True)
        plan = gradients_fn.calibration.plans[0]
    else:
        gradients_fn = tf.function(body)
        gradients_fn(x)
        plan = plans["plan"]
    seconds = time.perf_counter() - start

    @tf.function
    def reference(x):
        return tf.gradients(tf.reduce_mean(model(x, training=True) ** 2), variables)

    ours, theirs = gradients_fn(x), reference(x)
    difference = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)) for a, b in zip(ours, theirs))
    del ours, theirs

    @tf.function
    def step(x):
        return tf.add_n([tf.reduce_sum(g) for g in gradients_fn(x)])

    step(x)
    peaks = [memsaving.measure_peak(step, x) for _ in range(3)]
    predicted = plan.plain_peak if mode == "plain" else plan.predicted_peak
    return {"peaks": peaks, "predicted": predicted, "difference": difference, "seconds": seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", default="480MiB", help="fit_to_budget's budget")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        print("RESULT " + json.dumps(_row(args.row, args.size, args.batch, args.budget)), flush=True)
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"ConvNeXtTiny, weights=None, {args.size}x{args.size}, batch {args.batch}; peaks in MiB (weights "
          "included), highest of 3 runs")
    print(f"{'row':>24} {'measured':>9} {'predicted':>10} {'measured/predicted':>19} {'grad diff':>10} {'plan s':>7}")
    plain = None
    for mode in ("plain", "memory", "fit_to_budget"):
        done = subprocess.run([sys.executable, "-m", "experiments.bench_nested_calls", "--row", mode,
                               "--size", str(args.size), "--batch", str(args.batch), "--budget", args.budget],
                              cwd=root, capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        label = mode if mode != "fit_to_budget" else f"fit_to_budget {args.budget}"
        if not lines:
            print(f"{label:>24} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        measured = max(r["peaks"])
        plain = plain or measured
        print(f"{label:>24} {measured / MIB:9.1f} {r['predicted'] / MIB:10.1f} {measured / r['predicted']:19.3f} "
              f"{r['difference']:10.1e} {r['seconds']:7.1f}" + ("" if mode == "plain" else
                                                                 f"   ({plain / measured:.2f}x below plain)"))


if __name__ == "__main__":
    main()
