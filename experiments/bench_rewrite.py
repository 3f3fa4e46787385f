"""How long building the backward graph takes: tf.gradients vs memsaving.gradients.

Traces a Keras ResNet50 training step (weights=None, 64x64 input, the 16
residual-block outputs as checkpoints) three ways and prints the build times
side by side:

* forward only (the cost shared by both),
* forward + tf.gradients,
* forward + memsaving.gradients.

Target: the rewrite's extra build time (memsaving minus plain) is at most
tf.gradients' own time, so the whole build is at most 2x the plain one.

    python -m experiments.bench_rewrite [--model resnet50] [--repeats 1]
"""

from __future__ import annotations

import argparse
import time

import memsaving  # noqa: F401  (sets up the allocator before TensorFlow)
import keras
import tensorflow as tf


def build_model(name: str, size: int):
    if name == "resnet50":
        base = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
    elif name == "resnet152":
        base = keras.applications.ResNet152(weights=None, input_shape=(size, size, 3), classes=10)
    else:
        raise SystemExit(f"unknown model {name}")
    block_outs = [layer.output for layer in base.layers if layer.name.endswith("_out")]
    return keras.Model(base.input, [base.output] + block_outs), len(block_outs)


def trace_seconds(model, kind: str, batch: int, size: int) -> float:
    spec = tf.TensorSpec([batch, size, size, 3], tf.float32)

    @tf.function
    def step(x):
        outs = model(x, training=True)
        loss = tf.reduce_mean(outs[0])
        if kind == "forward":
            return loss
        if kind == "plain":
            return tf.gradients(loss, model.trainable_variables)
        return memsaving.gradients(loss, model.trainable_variables, checkpoints=list(outs[1:]))

    start = time.perf_counter()
    step.get_concrete_function(spec)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "resnet152"])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    model, n_blocks = build_model(args.model, args.size)
    times = {}
    for kind in ("forward", "plain", "memsaving"):
        times[kind] = min(trace_seconds(model, kind, args.batch, args.size) for _ in range(args.repeats))
    grad_plain = times["plain"] - times["forward"]
    grad_ours = times["memsaving"] - times["forward"]
    print(f"{args.model}, {n_blocks} block checkpoints, graph build times (s):")
    print(f"  forward only              {times['forward']:8.2f}")
    print(f"  forward + tf.gradients    {times['plain']:8.2f}   (backward {grad_plain:.2f})")
    print(f"  forward + memsaving       {times['memsaving']:8.2f}   (backward {grad_ours:.2f})")
    overhead = times["memsaving"] - times["plain"]
    print(f"  rewrite overhead (memsaving - plain) {overhead:.2f} s = {overhead / grad_plain:.2f} x tf.gradients' own time  (target <= 1.0)")
    print(f"  total build ratio memsaving / plain:           {times['memsaving'] / times['plain']:.2f}  (target <= 2.0)")


if __name__ == "__main__":
    main()
