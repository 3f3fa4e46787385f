"""Budget selection: recomputation chosen under a memory budget, side by side.

For random heterogeneous chains (sizes and costs differ per layer) and
budgets from 0.4 to 0.95 of the keep-everything peak, prints the total
compute (forward + recompute + backward, relative to plain backprop) of

* memsaving's budget selection (``budget=``: single- and multi-level plans),
* the exact optimum of single-level whole-segment plans (enumeration, small
  chains only; multi-level plans and segments kept in place may beat it),
* evenly spaced sqrt(n) checkpoints (Chen et al.), when they fit the budget,

all scored by the same simulator, and the time the budget selection takes on
a 350-layer chain.

    python -m experiments.bench_budget [--chains 6] [--layers 12]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from memsaving.planners.budget import plan_for_budget
from memsaving.errors import BudgetError
from memsaving.references.exact import optimal_plan
from memsaving.model.graph import chain_model
from memsaving.sim.simulate import simulate

FRACTIONS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.95)


def _total(model, recompute):
    step = 3 * model.forward_cost()
    return (step + recompute) / step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"{'chain':>5} {'budget':>7} {'memsaving':>10} {'optimum':>8} {'sqrt(n)':>8}")
    ratios = []
    for c in range(args.chains):
        model = chain_model(list(rng.integers(100, 1000, args.layers)), list(rng.uniform(1, 10, args.layers)),
                            grad_reads=("input", "output", "both")[c % 3])
        plain = simulate(model).peak_bytes
        candidates = list(range(args.layers - 1))
        k = max(1, int(round(math.sqrt(args.layers))))
        sqrt_ops = [int(round((j + 1) * args.layers / (k + 1))) - 1 for j in range(k)]
        sqrt_sim = simulate(model, sqrt_ops)
        for fraction in FRACTIONS:
            budget = int(plain * fraction)
            optimum = optimal_plan(model, candidates, budget)
            try:
                chosen = plan_for_budget(model, candidates, budget)
                ours = _total(model, chosen.recompute_cost)
            except BudgetError:
                ours = float("nan")
            best = _total(model, optimum[1]) if optimum else float("nan")
            chen = _total(model, sqrt_sim.recompute_cost) if sqrt_sim.peak_bytes <= budget else float("nan")
            if optimum:
                ratios.append(ours / best)
            print(f"{c:>5} {fraction:>7.2f} {ours:>10.3f} {best:>8.3f} {chen:>8.3f}")
    finite = [r for r in ratios if np.isfinite(r)]
    print(f"\nmemsaving / optimum, geometric mean over {len(finite)} feasible cases: "
          f"{np.exp(np.mean(np.log(finite))):.4f} (max {max(finite):.4f}); "
          f"infeasible where the optimum exists: {len(ratios) - len(finite)}")
    big = chain_model(list(rng.integers(100, 1000, 350)), list(rng.uniform(1, 10, 350)))
    plain = simulate(big).peak_bytes
    for fraction in (0.3, 0.1):
        start = time.perf_counter()
        chosen = plan_for_budget(big, list(range(349)), int(plain * fraction))
        print(f"350-layer chain, budget {fraction} of the peak: selection took "
              f"{time.perf_counter() - start:.2f} s ({'multi' if chosen.inner else 'single'}-level plan)")


if __name__ == "__main__":
    main()
