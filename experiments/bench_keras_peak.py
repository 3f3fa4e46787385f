"""Measured peak memory of one training step of Keras models, plain vs memsaving.

For each model (keras.applications, weights=None) the gradient of a scalar
loss with respect to all trainable variables is computed in a tf.function,
reduced to a scalar inside the function (so returned weight gradients do not
hide activation memory), with tf.gradients and with memsaving in "memory"
and "speed" modes.  Peaks are read from the CPU BFC allocator, with
TensorFlow's default thread pools unless ``--inter-op-threads`` says
otherwise; memory in use before the step (the variables) is subtracted.  The
plan's predicted peak is printed beside the measured one.

    python -m experiments.bench_keras_peak [--models resnet50,mobilenet,vgg16] [--batch 16] [--size 64]
                                           [--inter-op-threads N]
"""

from __future__ import annotations

import argparse
import time

import memsaving
import keras
import tensorflow as tf

BUILDERS = {
    "resnet50": lambda s: keras.applications.ResNet50(weights=None, input_shape=(s, s, 3), classes=10),
    "mobilenet": lambda s: keras.applications.MobileNetV2(weights=None, input_shape=(s, s, 3), classes=10),
    "vgg16": lambda s: keras.applications.VGG16(weights=None, input_shape=(s, s, 3), classes=10),
}


def measure(model, mode, x):
    captured = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        variables = model.trainable_variables
        if mode == "plain":
            captured["plan"] = memsaving.plan(loss, variables, checkpoints=[])
            grads = tf.gradients(loss, variables)
        else:
            captured["plan"] = memsaving.plan(loss, variables, checkpoints=mode)
            grads = memsaving.gradients(loss, variables, checkpoints=mode)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    step(x)
    start = time.perf_counter()
    step(x).numpy()
    seconds = time.perf_counter() - start
    peak = memsaving.measure_peak_increase(step, x)
    plan = captured["plan"]
    predicted = plan.predicted_peak - plan.resident_bytes if mode != "plain" else plan.plain_peak - plan.resident_bytes
    return peak, predicted, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,mobilenet,vgg16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--inter-op-threads", type=int, default=None,
                        help="TensorFlow's inter-op threads (default: TensorFlow's own choice, as users run)")
    args = parser.parse_args(argv)
    if args.inter_op_threads is not None:
        try:
            tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
        except RuntimeError:
            print("TensorFlow already started: --inter-op-threads ignored")
    mib = 2 ** 20
    for name in args.models.split(","):
        keras.utils.set_random_seed(0)
        model = BUILDERS[name](args.size)
        x = tf.random.normal([args.batch, args.size, args.size, 3], seed=1)
        rows = {mode: measure(model, mode, x) for mode in ("plain", "memory", "speed")}
        base_peak, _, base_time = rows["plain"]
        threads = args.inter_op_threads or "default"
        print(f"\n{name}, batch {args.batch}, {args.size}x{args.size}, inter-op threads {threads}: "
              "step peak above resident memory")
        print(f"{'mode':>8} {'measured MiB':>13} {'predicted MiB':>14} {'peak ratio':>11} {'step s':>8} {'time ratio':>11}")
        for mode, (peak, predicted, seconds) in rows.items():
            print(f"{mode:>8} {peak / mib:>13.1f} {predicted / mib:>14.1f} {base_peak / peak:>10.2f}x "
                  f"{seconds:>8.3f} {seconds / base_time:>10.2f}x")


if __name__ == "__main__":
    main()
