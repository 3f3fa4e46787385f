"""Memory a training step leaves on the device each time it is traced.

``memsaving.fit_to_budget`` traces the step once per calibration round, and
a step called again is traced again.  When each trace leaves memory behind
(a model that caches tensors per trace), every later plan is measured that
much higher, which ``Calibration.held_per_trace`` accounts for.  This
benchmark measures the figure for the budget sweep's models, with plain
``tf.gradients`` (no memsaving in the step), and for the activation that
explains part of it (``tf.nn.silu``, which Keras' swish calls: a
``tf.custom_gradient``)::

    python -m experiments.trace_memory [--models efficientnetb0,resnet50v2,...] [--traces 4]

Each trace is a new ``tf.function`` of the same step, run once and dropped;
the bytes in use are read after ``gc.collect()``.  The first trace's growth
includes once-only allocations; the later ones are the per-trace figure.
"""

from __future__ import annotations

import argparse
import gc
from typing import Callable, List, Optional

import memsaving  # noqa: F401  (sets TF_CPU_ALLOCATOR_USE_BFC before TensorFlow starts)
import tensorflow as tf

from memsaving.tf.measure import bytes_in_use

KIB = 2 ** 10
DEFAULT_MODELS = "efficientnetb0,resnet50v2,mlp24,gpt2"


def growth_per_trace(make_step: Callable[[], Callable], traces: int) -> List[int]:
    """Bytes in use after each trace (a new step, run once, dropped) less before it."""
    growth = []
    for _ in range(traces):
        gc.collect()
        before = bytes_in_use()
        step = make_step()
        step()
        step = None
        gc.collect()
        growth.append(bytes_in_use() - before)
    return growth


def model_step(name: str) -> Callable[[], Callable]:
    """New traced plain steps of the budget sweep's model ``name``."""
    from experiments import bench_budget_promise as sweep  # pylint: disable=import-outside-toplevel

    case = sweep.MODELS[name](False)

    def make():
        step, _ = sweep.make_step(case.model, case.batch, "plain")
        return lambda: step(case.inputs)
    return make


def silu_step(shape) -> Callable[[], Callable]:
    """New traced steps differentiating one ``tf.nn.silu`` of ``shape``."""
    x = tf.random.normal(shape)

    def make():
        @tf.function
        def step(v):
            with tf.GradientTape() as tape:
                tape.watch(v)
                loss = tf.reduce_sum(tf.nn.silu(v) ** 2)
            return tf.reduce_sum(tape.gradient(loss, v))
        return lambda: step(x)
    return make


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="budget sweep models (bench_budget_promise.MODELS)")
    parser.add_argument("--traces", type=int, default=4, help="traces per case (default 4)")
    args = parser.parse_args(argv)
    if args.traces < 2:
        parser.error("--traces must be at least 2: the first trace includes once-only allocations")
    cases = [(f"{name} (plain tf.gradients)", lambda name=name: model_step(name))
             for name in args.models.split(",") if name.strip()]
    cases += [(f"one tf.nn.silu {shape}", lambda shape=shape: silu_step(shape))
              for shape in ([8, 32, 32, 16], [8, 64, 64, 32])]
    print(f"{'case':45} {'first KiB':>10} {'later KiB per trace':>22}")
    for label, build in cases:
        try:
            make = build()
        except ImportError as error:
            print(f"{label:45} skipped: {error}")
            continue
        growth = growth_per_trace(make, args.traces)
        later = ", ".join(f"{g / KIB:.1f}" for g in growth[1:])
        print(f"{label:45} {growth[0] / KIB:>10.1f} {later:>22}", flush=True)


if __name__ == "__main__":
    main()
