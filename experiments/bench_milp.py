"""Budget plans against the Checkmate MILP, on layer-level Keras graphs.

For VGG16, ResNet50, MobileNetV2 (keras.applications, weights=None) and the
U-Net of :mod:`memsaving.tools.models`, the layer-level graph of the
training step (:mod:`memsaving.references.layer_graph`) is planned under budgets from
0.4 to 0.95 of the keep-everything activation peak (budget = resident +
fraction * (plain peak - resident)).  Printed side by side, as total compute
(forward + recompute + backward) relative to plain backprop, all replayed by
the same simulator:

* the DP over candidate cuts alone (``select_for_budget``, candidates from
  ``memory_candidates``; "cut DP"),
* ``plan_for_budget``, what ``gradients(..., budget=)`` runs ("memsaving"):
  the cut DP's plan, its per-op refinements (``memsaving.planners.refine``) and
  multi-level (recursive) plans, the cheapest that fits,
* Chen et al.'s sqrt(n) cuts and Chen's greedy (best of ``greedy_plans``
  that fits),
* the MILP optimum over Checkmate schedules (``memsaving.references.milp``), replayed;
  ``*`` marks a schedule not proven optimal in the time limit, and the
  lower-bound column gives what no schedule can beat.

"-" = no plan within the budget (or, for the MILP, none found in the time
limit); "n/a" = the training graph exceeds the MILP's size limit.

    python -m experiments.bench_milp [--models vgg16,resnet50,mobilenet,unet] [--batch 8] [--size 64]
        [--time-limit 120] [--truncate N] [--max-nodes 250]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import List, Optional

import memsaving  # noqa: F401  (allocator setup before TensorFlow)
import keras

from experiments.bench_keras_budget import BUILDERS, FRACTIONS, greedy
from memsaving.candidates import cuts as cand
from memsaving.planners.budget import plan_for_budget, select_for_budget
from memsaving.errors import BudgetError
from memsaving.references.layer_graph import layer_graph_model
from memsaving.references.milp import MAX_NODES, run_milp, training_graph
from memsaving.sim.simulate import simulate


@dataclass
class Row:
    """One model and budget: compute ratios (None = no plan) and timings."""

    model: str
    fraction: float
    dp: Optional[float]
    sqrtn: Optional[float]
    greedy: Optional[float]
    full: Optional[float] = None
    milp: Optional[float] = None
    optimal: bool = False
    lower: Optional[float] = None
    dp_seconds: float = 0.0
    full_seconds: float = 0.0
    milp_seconds: Optional[float] = None
    status: str = "too large"
    size: str = ""
    notes: List[str] = field(default_factory=list)


def _fmt(value: Optional[float], mark: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{mark}"


def _dp(model, cuts, budget):
    """The cut DP's plan: (compute ratio or None if infeasible, seconds)."""
    start = time.perf_counter()
    try:
        ops = select_for_budget(model, [c for c, _ in cuts], budget, cut_bytes=[b for _, b in cuts]).checkpoint_ops
    except BudgetError:
        return None, time.perf_counter() - start
    seconds = time.perf_counter() - start
    return simulate(model, ops).compute_ratio, seconds


def _full(model, cuts, budget):
    """plan_for_budget: (compute ratio or None if infeasible, seconds)."""
    start = time.perf_counter()
    try:
        plan = plan_for_budget(model, [c for c, _ in cuts], budget, cut_bytes=[b for _, b in cuts])
    except BudgetError:
        return None, time.perf_counter() - start
    seconds = time.perf_counter() - start
    sim = simulate(model, plan.checkpoint_ops, inner=plan.inner)
    assert sim.peak_bytes <= budget, "plan_for_budget returned a plan over the budget"
    return sim.compute_ratio, seconds


def _milp(model, budget, args, row: Row, plain_step: float) -> None:
    outcome = run_milp(model, budget, time_limit=args.time_limit, max_nodes=args.max_nodes)
    row.status = outcome.status
    if outcome.variables:
        row.size = f"{outcome.variables} variables ({outcome.integer_variables} binary), {outcome.constraints} rows"
    row.milp_seconds = outcome.seconds
    if outcome.lower_bound is not None:
        row.lower = outcome.lower_bound / plain_step
    result = outcome.result
    if result is None:
        return
    assert result.peak_bytes <= budget, "replayed MILP schedule exceeds the budget"
    row.milp = result.compute_ratio
    row.optimal = result.optimal


def bench_model(name: str, args) -> List[Row]:
    keras.utils.set_random_seed(0)
    model = layer_graph_model(BUILDERS[name](args.size), args.batch, max_layers=args.truncate)
    plain = simulate(model)
    resident = model.resident_bytes
    cuts = cand.memory_candidates(model)
    sqrt_sim = simulate(model, cand.sqrtn_sets(model, cuts))
    nodes = training_graph(model).node_count
    step = plain.forward_cost + plain.backward_cost
    print(f"\n{name}{f' (first {args.truncate} layers)' if args.truncate else ''}: {len(model.ops)} layer ops "
          f"(loss included), {nodes} training-graph nodes, {len(cuts)} candidate cuts, plain activation peak "
          f"{(plain.peak_bytes - resident) / 2**20:.1f} MiB, resident {resident / 2**20:.1f} MiB "
          f"(batch {args.batch}, {args.size}x{args.size})")
    print(f"{'budget':>6} {'cut DP':>7} {'memsaving':>9} {'sqrt(n)':>8} {'greedy':>7} {'MILP':>8} "
          f"{'MILP lb':>8} {'plan s':>6} {'MILP s':>7}  MILP status")
    rows = []
    for fraction in FRACTIONS:
        budget = resident + int(fraction * (plain.peak_bytes - resident))
        dp, dp_seconds = _dp(model, cuts, budget)
        g = greedy(model, cuts, budget)
        row = Row(name, fraction, dp, sqrt_sim.compute_ratio if sqrt_sim.peak_bytes <= budget else None,
                  g.compute_ratio if g is not None else None, dp_seconds=dp_seconds)
        row.full, row.full_seconds = _full(model, cuts, budget)
        if nodes <= args.max_nodes:
            _milp(model, budget, args, row, step)
        milp = "n/a" if row.status == "too large" else _fmt(row.milp, "" if row.optimal else "*")
        seconds = "-" if row.milp_seconds is None else f"{row.milp_seconds:.1f}"
        print(f"{fraction:>6.2f} {_fmt(dp):>7} {_fmt(row.full):>9} {_fmt(row.sqrtn):>8} "
              f"{_fmt(row.greedy):>7} {milp:>8} {_fmt(row.lower):>8} {row.full_seconds:>6.2f} {seconds:>7}  "
              f"{row.status}",
              flush=True)
        rows.append(row)
    sizes = sorted({r.size for r in rows if r.size})
    if sizes:
        print(f"  MILP program: {' / '.join(sizes)}")
    return rows


def _geomean(values: List[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: List[Row]) -> None:
    print("\nSummary")
    for label, attr in (("memsaving (plan_for_budget)", "full"), ("cut DP alone", "dp")):
        solved = [r for r in rows if getattr(r, attr) is not None and r.milp is not None and r.optimal]
        if not solved:
            continue
        ratios = [getattr(r, attr) / r.milp for r in solved]
        worst = max(solved, key=lambda r: getattr(r, attr) / r.milp)
        print(f"  {label} / MILP optimum over {len(solved)} proven cases: geometric mean "
              f"{_geomean(ratios):.4f}, max {max(ratios):.4f} ({worst.model} at {worst.fraction:.2f})")
    for r in rows:
        if r.full is not None and r.milp is not None and not r.optimal:
            print(f"  {r.model} {r.fraction:.2f}: MILP not proven optimal in the time limit; memsaving / best "
                  f"schedule {r.full / r.milp:.4f}, memsaving / lower bound {r.full / r.lower:.4f}")
        if r.full is None and r.milp is not None:
            print(f"  {r.model} {r.fraction:.2f}: memsaving finds no plan, the MILP has a schedule ({r.milp:.3f})")
    worse = [(r, kind, value) for r in rows for kind, value in (("sqrt(n)", r.sqrtn), ("greedy", r.greedy))
             if value is not None and (r.full is None or value < r.full - 1e-9)]
    for r, kind, value in worse:
        print(f"  memsaving worse than Chen {kind}: {r.model} at {r.fraction:.2f} "
              f"({_fmt(r.full)} against {value:.3f})")
    if not worse:
        print("  memsaving never worse than Chen's sqrt(n) or greedy plans (and feasible wherever they are)")
    times = [r.full_seconds for r in rows]
    print(f"  memsaving planning time: mean {sum(times) / len(times):.2f} s, max {max(times):.2f} s")
    for r in rows:
        if r.status == "timeout":
            bound = "" if r.lower is None or r.full is None else f"; memsaving / lower bound {r.full / r.lower:.4f}"
            print(f"  {r.model} {r.fraction:.2f}: no MILP schedule found in the time limit{bound}")
    milp_times = [r.milp_seconds for r in rows if r.milp_seconds is not None and r.status != "too large"]
    if milp_times:
        print(f"  MILP solve time: median {sorted(milp_times)[len(milp_times) // 2]:.1f} s, "
              f"max {max(milp_times):.1f} s over {len(milp_times)} solves")


def time_largest(args) -> None:
    """Planning time on the full ResNet50 layer graph (the largest)."""
    keras.utils.set_random_seed(0)
    model = layer_graph_model(BUILDERS["resnet50"](args.size), args.batch)
    plain = simulate(model)
    cuts = cand.memory_candidates(model)
    print(f"\nplan_for_budget on the full ResNet50 layer graph ({len(model.ops)} ops, "
          f"{training_graph(model).node_count} training-graph nodes, {len(cuts)} cuts):")
    for fraction in (0.4, 0.7):
        budget = model.resident_bytes + int(fraction * (plain.peak_bytes - model.resident_bytes))
        _, dp_seconds = _dp(model, cuts, budget)
        _, seconds = _full(model, cuts, budget)
        print(f"  budget {fraction:.2f}: {seconds:.2f} s (the cut DP alone: {dp_seconds:.2f} s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg16,resnet50,mobilenet,unet")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--max-nodes", type=int, default=MAX_NODES,
                        help="largest training graph handed to the MILP")
    parser.add_argument("--truncate", type=int, default=None,
                        help="keep the first N layers of each model (a prefix the MILP can solve)")
    args = parser.parse_args(argv)
    rows: List[Row] = []
    for name in args.models.split(","):
        rows += bench_model(name, args)
    summarize(rows)
    time_largest(args)


if __name__ == "__main__":
    main()
