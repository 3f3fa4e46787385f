"""Plan quality: memsaving's budget planner against the Checkmate MILP optimum
and Chen et al.'s heuristics, with planning times.

Wraps :mod:`experiments.bench_milp` (layer-level graphs of Keras models, the
MILP solved with scipy's HiGHS) and writes its rows as a table.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List

from experiments import bench_milp
from experiments.report import Table, progress


def run(out_dir: str, models: List[str], batch: int, size: int, time_limit: float, truncate=None) -> dict:
    args = SimpleNamespace(batch=batch, size=size, time_limit=time_limit, max_nodes=bench_milp.MAX_NODES,
                           truncate=truncate)
    table = Table("plan_quality", "Budget plans: total compute relative to plain backprop (layer-level graphs, "
                  f"batch {batch}, {size}x{size}{f', first {truncate} layers' if truncate else ''})",
                  ["model", "budget", "cut DP", "memsaving", "sqrt(n)", "Chen greedy", "MILP", "MILP proven",
                   "memsaving / MILP", "plan s", "MILP s"])
    rows = []
    for name in models:
        progress("plan_quality", f"{name}: planning and solving the MILP at 6 budgets "
                 f"(up to {time_limit:.0f} s each)")
        for row in bench_milp.bench_model(name, args):
            rows.append(row)
            ratio = row.full / row.milp if row.full is not None and row.milp is not None else None
            table.add(name, row.fraction, row.dp, row.full, row.sqrtn, row.greedy, row.milp,
                      "yes" if row.optimal else "no", ratio, round(row.full_seconds, 2),
                      round(row.milp_seconds, 1) if row.milp_seconds is not None else None)
    proven = [r.full / r.milp for r in rows if r.full is not None and r.milp is not None and r.optimal]
    if proven:
        mean = math.exp(sum(math.log(v) for v in proven) / len(proven))
        table.notes.append(f"memsaving / MILP optimum over {len(proven)} proven cases: geometric mean {mean:.4f}, "
                           f"max {max(proven):.4f}. '-' = no plan within the budget.")
    return {"rows": rows, "files": table.write(out_dir), "geomean": mean if proven else None}
