"""Recompute-only vs swap-only vs hybrid: predicted step time under a budget.

For the layer-level training graphs of ResNet50 and a U-Net (Keras,
``weights=None``) and budgets from 0.3 to 0.9 of the keep-everything
activation peak, prints the predicted step time, relative to plain backprop
under the same cost model, of

* recompute-only: the budget DP's single-level plan;
* swap-only: nothing recomputed, every tensor the backward pass reads swapped
  (TFLMS);
* hybrid: ``memsaving.planners.hybrid.plan_hybrid`` (swap="auto");

for two accelerators behind PCIe 3 x16 (16 GB/s): a fast one (15 TFLOP/s,
where transfers are the bottleneck) and a slow one (1 TFLOP/s).  "-" = the
plan does not fit.  All figures are predictions of the simulator's timed
replay: this machine has no GPU, so no transfer was measured.

    python -m experiments.bench_hybrid [--models resnet50,unet] [--batch 32] [--size 64]
"""

from __future__ import annotations

import argparse
import time

import memsaving  # noqa: F401  (allocator setup before TensorFlow)
from memsaving.candidates import cuts as cand
from memsaving.errors import BudgetError
from memsaving.planners.hybrid import plan_hybrid
from memsaving.references.layer_graph import layer_graph_model
from memsaving.tools.models import build
from memsaving.sim.simulate import simulate
from memsaving.sim.swap import CostModel

FRACTIONS = (0.3, 0.5, 0.7, 0.9)
DEVICES = {
    "15 TFLOP/s + PCIe3": CostModel(flops_per_second=15e12, bandwidth=16e9),
    "1 TFLOP/s + PCIe3": CostModel(flops_per_second=1e12, bandwidth=16e9),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,unet")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args(argv)
    worse = 0
    for name in args.models.split(","):
        model = layer_graph_model(build(name, args.size), args.batch)
        cuts = cand.memory_candidates(model)
        pool, cut_bytes = [c for c, _ in cuts], [b for _, b in cuts]
        for device, cost in DEVICES.items():
            plain = simulate(model, cost=cost)
            activations = plain.peak_bytes - model.resident_bytes
            print(f"\n{name} (layer graph, {len(model.ops)} ops, batch {args.batch}, {args.size}x{args.size}), "
                  f"{device}: plain step {plain.step_seconds * 1e3:.1f} ms, activation peak "
                  f"{activations / 2**20:.0f} MiB")
            print(f"{'budget':>7} {'recompute-only':>15} {'swap-only':>10} {'hybrid':>8} {'swapped':>8} {'plan s':>7}")
            for fraction in FRACTIONS:
                budget = model.resident_bytes + int(fraction * activations)
                start = time.perf_counter()
                try:
                    result = plan_hybrid(model, pool, budget, cost=cost, cut_bytes=cut_bytes)
                except BudgetError:
                    print(f"{fraction:>7.2f} {'-':>15} {'-':>10} {'-':>8}")
                    continue
                seconds = time.perf_counter() - start

                def ratio(p):
                    return f"{p.seconds / plain.step_seconds:.3f}" if p is not None else "-"

                pure = [p.seconds for p in (result.recompute_only, result.swap_only) if p is not None]
                if pure and result.best.seconds > min(pure) + 1e-12:
                    worse += 1
                print(f"{fraction:>7.2f} {ratio(result.recompute_only):>15} {ratio(result.swap_only):>10} "
                      f"{ratio(result.best):>8} {len(result.best.swapped):>8} {seconds:>7.1f}")
    print(f"\nhybrid slower than the better pure plan in {worse} case(s)")


if __name__ == "__main__":
    main()
