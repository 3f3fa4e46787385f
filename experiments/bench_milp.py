"""Budget plans against the Checkmate MILP, on layer-level Keras graphs.

For VGG16, ResNet50, MobileNetV2 (keras.applications, weights=None) and the
U-Net of :mod:`memsaving.models`, the layer-level graph of the
training step (:mod:`memsaving.layer_graph`) is planned under budgets from
0.4 to 0.95 of the keep-everything activation peak (budget = resident +
fraction * (plain peak - resident)).  Printed side by side, as total compute
(forward + recompute + backward) relative to plain backprop, all replayed by
the same simulator:

* memsaving's ``select_for_budget`` (candidates from ``memory_candidates``),
* the same plan without the recomputations nobody reads ("DP lean": a
  segment recomputes its anchor op even when its gradient does not read its
  output),
* ``plan_for_budget`` with multi-level (recursive) plans competing ("multi"),
* Chen et al.'s sqrt(n) cuts and Chen's greedy (best of ``greedy_plans``
  that fits),
* the MILP optimum over Checkmate schedules (``memsaving.milp``), replayed;
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
from memsaving import candidates as cand
from memsaving.budget import plan_for_budget, select_for_budget
from memsaving.errors import BudgetError
from memsaving.layer_graph import layer_graph_model
from memsaving.milp import MAX_NODES, run_milp, training_graph
from memsaving.replay import plan_schedule, simulate_schedule
from memsaving.simulate import simulate


@dataclass
class Row:
    """One model and budget: compute ratios (None = no plan) and timings."""

    model: str
    fraction: float
    dp: Optional[float]
    lean: Optional[float]
    sqrtn: Optional[float]
    greedy: Optional[float]
    multi: Optional[float] = None
    milp: Optional[float] = None
    optimal: bool = False
    lower: Optional[float] = None
    dp_seconds: float = 0.0
    milp_seconds: Optional[float] = None
    status: str = "too large"
    size: str = ""
    notes: List[str] = field(default_factory=list)


def _fmt(value: Optional[float], mark: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{mark}"


def _dp(model, cuts, budget):
    """memsaving's plan: (ratio, lean ratio, seconds); ratios None if infeasible."""
    start = time.perf_counter()
    try:
        ops, _ = select_for_budget(model, [c for c, _ in cuts], budget, cut_bytes=[b for _, b in cuts])
    except BudgetError:
        return None, None, time.perf_counter() - start
    seconds = time.perf_counter() - start
    lean = simulate_schedule(model, plan_schedule(model, ops, drop_unread=True))
    return simulate(model, ops).compute_ratio, lean.compute_ratio, seconds


def _multi(model, cuts, budget) -> Optional[float]:
    """plan_for_budget with multi-level plans: its compute ratio, None if infeasible."""
    try:
        plan = plan_for_budget(model, [c for c, _ in cuts], budget, cut_bytes=[b for _, b in cuts])
    except BudgetError:
        return None
    return simulate(model, plan.checkpoint_ops, inner=plan.inner).compute_ratio


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
    print(f"{'budget':>6} {'DP':>7} {'DP lean':>8} {'multi':>7} {'sqrt(n)':>8} {'greedy':>7} {'MILP':>8} "
          f"{'MILP lb':>8} {'DP s':>6} {'MILP s':>7}  MILP status")
    rows = []
    for fraction in FRACTIONS:
        budget = resident + int(fraction * (plain.peak_bytes - resident))
        dp, lean, dp_seconds = _dp(model, cuts, budget)
        g = greedy(model, cuts, budget)
        row = Row(name, fraction, dp, lean, sqrt_sim.compute_ratio if sqrt_sim.peak_bytes <= budget else None,
                  g.compute_ratio if g is not None else None, dp_seconds=dp_seconds)
        row.multi = _multi(model, cuts, budget)
        if nodes <= args.max_nodes:
            _milp(model, budget, args, row, step)
        milp = "n/a" if row.status == "too large" else _fmt(row.milp, "" if row.optimal else "*")
        seconds = "-" if row.milp_seconds is None else f"{row.milp_seconds:.1f}"
        print(f"{fraction:>6.2f} {_fmt(dp):>7} {_fmt(lean):>8} {_fmt(row.multi):>7} {_fmt(row.sqrtn):>8} "
              f"{_fmt(row.greedy):>7} {milp:>8} {_fmt(row.lower):>8} {dp_seconds:>6.2f} {seconds:>7}  {row.status}",
              flush=True)
        rows.append(row)
    sizes = sorted({r.size for r in rows if r.size})
    if sizes:
        print(f"  MILP program: {' / '.join(sizes)}")
    return rows


def _geomean(values: List[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: List[Row]) -> None:
    solved = [r for r in rows if r.dp is not None and r.milp is not None and r.optimal]
    print("\nSummary")
    if solved:
        ratios = [r.dp / r.milp for r in solved]
        lean = [r.lean / r.milp for r in solved]
        worst = max(solved, key=lambda r: r.dp / r.milp)
        print(f"  DP / MILP optimum over {len(solved)} proven cases: geometric mean {_geomean(ratios):.4f}, "
              f"max {max(ratios):.4f} ({worst.model} at {worst.fraction:.2f}); DP lean / MILP: "
              f"{_geomean(lean):.4f}, max {max(lean):.4f}")
        multi = [r.multi / r.milp for r in solved if r.multi is not None]
        if multi:
            print(f"  multi-level plan_for_budget / MILP over {len(multi)} of them: geometric mean "
                  f"{_geomean(multi):.4f}, max {max(multi):.4f}")
    bounded = [r for r in rows if r.dp is not None and r.milp is not None and not r.optimal]
    for r in bounded:
        print(f"  {r.model} {r.fraction:.2f}: MILP not proven optimal in the time limit; DP / best schedule "
              f"{r.dp / r.milp:.4f}, DP / lower bound {r.dp / r.lower:.4f}")
    missed = [r for r in rows if r.dp is None and r.milp is not None]
    for r in missed:
        print(f"  {r.model} {r.fraction:.2f}: the DP finds no plan, the MILP has a schedule ({r.milp:.3f})")
    worse = [(r, kind, value) for r in rows for kind, value in (("sqrt(n)", r.sqrtn), ("greedy", r.greedy))
             if value is not None and (r.dp is None or value < r.dp - 1e-9)]
    if worse:
        for r, kind, value in worse:
            print(f"  DP worse than Chen {kind}: {r.model} at {r.fraction:.2f} "
                  f"(DP {_fmt(r.dp)}, {kind} {value:.3f})")
    else:
        print("  DP never worse than Chen's sqrt(n) or greedy plans (and feasible wherever they are)")
    dp_times = [r.dp_seconds for r in rows]
    print(f"  DP selection time: mean {sum(dp_times) / len(dp_times):.2f} s, max {max(dp_times):.2f} s")
    for r in rows:
        if r.status == "timeout":
            bound = "" if r.lower is None or r.dp is None else f"; DP / lower bound {r.dp / r.lower:.4f}"
            print(f"  {r.model} {r.fraction:.2f}: no MILP schedule found in the time limit{bound}")
    milp_times = [r.milp_seconds for r in rows if r.milp_seconds is not None and r.status != "too large"]
    if milp_times:
        print(f"  MILP solve time: median {sorted(milp_times)[len(milp_times) // 2]:.1f} s, "
              f"max {max(milp_times):.1f} s over {len(milp_times)} solves")


def time_largest(args) -> None:
    """select_for_budget on the full ResNet50 layer graph (the largest)."""
    keras.utils.set_random_seed(0)
    model = layer_graph_model(BUILDERS["resnet50"](args.size), args.batch)
    plain = simulate(model)
    cuts = cand.memory_candidates(model)
    print(f"\nselect_for_budget on the full ResNet50 layer graph ({len(model.ops)} ops, "
          f"{training_graph(model).node_count} training-graph nodes, {len(cuts)} cuts):")
    for fraction in (0.4, 0.7):
        budget = model.resident_bytes + int(fraction * (plain.peak_bytes - model.resident_bytes))
        _, _, seconds = _dp(model, cuts, budget)
        print(f"  budget {fraction:.2f}: {seconds:.2f} s")


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
