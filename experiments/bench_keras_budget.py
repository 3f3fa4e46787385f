"""Budget sweep on the op graphs of real Keras training steps.

For VGG16, ResNet50, MobileNetV2 (keras.applications, weights=None) and a
small U-Net (memsaving.tools.models.unet), the training step's op graph is extracted and, for
budgets from 0.4 to 0.95 of the keep-everything activation peak, three
strategies are scored by the same simulator:

* memsaving's budget selection (cuts + DP + local search),
* Chen et al.'s sqrt(n): about sqrt(n) evenly spaced cuts (one plan, used
  where it fits),
* Chen et al.'s greedy: walk the cuts in order and keep one whenever the
  bytes since the last kept cut exceed a threshold, the threshold searched
  so that the plan fits and recomputes least.

Printed per model and budget: predicted total compute relative to plain
backprop (forward + recompute + backward), "-" where a strategy finds no
plan within the budget.

    python -m experiments.bench_keras_budget [--models vgg16,resnet50,mobilenet,unet] [--batch 8] [--size 64]
"""

from __future__ import annotations

import argparse
import time

import memsaving  # noqa: F401  (allocator setup before TensorFlow)
import keras
import tensorflow as tf

from memsaving.candidates import cuts as cand
from memsaving.planners.budget import greedy_plans, select_for_budget
from memsaving.errors import BudgetError
from memsaving.tf.extract import graph_model
from memsaving.tf.forward import forward_graph
from memsaving.tools.models import BUILDERS as MODELS
from memsaving.sim.simulate import simulate

FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.95)


BUILDERS = {name: MODELS[name] for name in ("vgg16", "resnet50", "mobilenet", "unet")}


def step_model(model, batch: int, size: int):
    captured = {}

    @tf.function
    def trace(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        xs = [tf.convert_to_tensor(v.handle) for v in model.trainable_variables]
        captured["model"] = graph_model(forward_graph(xs, [loss]), batch_size=batch)
        return loss

    trace.get_concrete_function(tf.TensorSpec([batch, size, size, 3]))
    return captured["model"]


def greedy(model, cuts, budget):
    """Chen's greedy (memsaving.planners.budget.greedy_plans): the cheapest plan that fits."""
    best = None
    for chosen in greedy_plans([b for _, b in cuts], model.activation_bytes()):
        ops = sorted({i for k in chosen for i in cuts[k][0]})
        sim = simulate(model, ops)
        if sim.peak_bytes <= budget and (best is None or sim.recompute_cost < best.recompute_cost):
            best = sim
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg16,resnet50,mobilenet,unet")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        keras.utils.set_random_seed(0)
        model = step_model(BUILDERS[name](args.size), args.batch, args.size)
        plain = simulate(model)
        resident = model.resident_bytes
        cuts = cand.memory_candidates(model)
        pool = [c for c, _ in cuts]
        sqrt_sim = simulate(model, cand.sqrtn_sets(model, cuts))
        print(f"\n{name}: {len(model.ops)} ops, {len(cuts)} candidate cuts, plain activation peak "
              f"{(plain.peak_bytes - resident) / 2**20:.1f} MiB (batch {args.batch}, {args.size}x{args.size})")
        print(f"{'budget':>7} {'memsaving':>10} {'sqrt(n)':>8} {'greedy':>8} {'select s':>9}")
        for fraction in FRACTIONS:
            budget = resident + int(fraction * (plain.peak_bytes - resident))
            start = time.perf_counter()
            try:
                ops = select_for_budget(model, pool, budget, cut_bytes=[b for _, b in cuts]).checkpoint_ops
                ours = f"{simulate(model, ops).compute_ratio:.3f}"
            except BudgetError:
                ours = "-"
            seconds = time.perf_counter() - start
            chen = f"{sqrt_sim.compute_ratio:.3f}" if sqrt_sim.peak_bytes <= budget else "-"
            g = greedy(model, cuts, budget)
            gre = f"{g.compute_ratio:.3f}" if g is not None else "-"
            print(f"{fraction:>7.2f} {ours:>10} {chen:>8} {gre:>8} {seconds:>9.2f}")


if __name__ == "__main__":
    main()
