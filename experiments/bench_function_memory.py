"""A tape loop under ``memsaving.function``: step memory against ``tf.function``.

The training step users write in TensorFlow 2 (a ``tf.GradientTape`` in a
``tf.function``, Keras layers, Adam) is run both ways on the same model:
plain ``tf.function`` and ``memsaving.function(checkpoints="memory")``.  For
each, the step's own memory (``measure_peak_increase``: the allocator's peak
less what it held before the call) is measured ``--repeats`` times after a
warm-up, with TensorFlow's default settings (default thread pools, Grappler
on), and printed as the lowest and highest run beside the plan's prediction
(its predicted peak less its resident bytes).  Each model runs in a Python
process of its own, so no figure is moved by what an earlier model left in
the allocator.

``python -m experiments.bench_function_memory [--models attention,resconv] [--repeats 5]``;
``resconv-bn`` (32 blocks with BatchNorm) takes 1-2 minutes more.
"""

from __future__ import annotations

import sys
from typing import Dict, List

from experiments.child_figures import each_model, models_asked

MODELS: Dict[str, str] = {
    "attention": "attention_encoder(size=64, blocks=6, dim=32, heads=4), batch 8",
    "resconv": "residual_convnet(size=64, blocks=48, filters=(16,), batch_norm=False), batch 8",
    "resconv-bn": "residual_convnet(size=64, blocks=32, filters=(16, 32)), batch 4",
}
"""The models, as the tests of ``tests/api/test_function.py`` build them."""

MiB = 2 ** 20


def _build(name: str):
    import keras
    import tensorflow as tf

    from memsaving.tools import models

    keras.utils.set_random_seed(0)
    if name == "attention":
        return models.attention_encoder(size=64, blocks=6, dim=32, heads=4), \
            tf.random.stateless_normal([8, 64, 32], [1, 2])
    if name == "resconv":
        return models.residual_convnet(size=64, blocks=48, filters=(16,), batch_norm=False), \
            tf.random.stateless_normal([8, 64, 64, 3], [1, 2])
    return models.residual_convnet(size=64, blocks=32, filters=(16, 32)), \
        tf.random.stateless_normal([4, 64, 64, 3], [1, 2])


def measure(name: str, repeats: int) -> Dict[str, object]:
    """Both ways on ``name``, in this process: the step memory of every run, and memsaving's prediction."""
    import memsaving  # first: it turns the CPU allocator's statistics on before TensorFlow starts
    import keras
    import tensorflow as tf

    figures: Dict[str, object] = {}
    for way, decorate in (("plain", tf.function), ("memory", memsaving.function(checkpoints="memory"))):
        model, x = _build(name)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        step = decorate(step)
        step(x)
        figures[way] = [memsaving.measure_peak_increase(step, x) for _ in range(repeats)]
        if way == "memory":
            plan = step.plans[0]
            figures["predicted_memory"] = plan.predicted_peak - plan.resident_bytes
            figures["predicted_plain"] = plan.plain_peak - plan.resident_bytes
    return figures


def main(argv: List[str] = None) -> int:
    asked = models_asked(argv, "experiments.bench_function_memory", __doc__, MODELS, "attention,resconv", 5, measure)
    if asked is None:
        return 0
    names, repeats = asked
    print("step memory (MiB, measure_peak_increase, TensorFlow's default settings), lowest-highest of "
          f"{repeats} runs; predicted: the plan's peak less its resident bytes")
    print(f"{'model':12} {'plain':>15} {'memory':>15} {'ratio (lowest)':>15} {'predicted':>17}")
    for name, f, error in each_model("experiments.bench_function_memory", names, repeats):
        if f is None:
            print(f"{name:12} failed: {error}")
            continue
        plain, memory = f["plain"], f["memory"]
        print(f"{name:12} {min(plain) / MiB:7.1f}-{max(plain) / MiB:<7.1f} {min(memory) / MiB:7.1f}-"
              f"{max(memory) / MiB:<7.1f} {min(plain) / min(memory):14.2f}x "
              f"{f['predicted_plain'] / MiB:7.1f} / {f['predicted_memory'] / MiB:<7.1f}")
        print(f"{'':12} ({MODELS[name]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
