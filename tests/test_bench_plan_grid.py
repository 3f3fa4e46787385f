"""experiments.bench_plan_grid's run and compare on a small pickled chain
(no TensorFlow): every budget planned, figures saved, and a saved run read
back beside a new one."""

import json
import pickle

import numpy as np

from experiments import bench_plan_grid
from memsaving.model.graph import chain_model


def test_run_saves_every_budget_and_compares_with_a_saved_run(tmp_path, capsys):
    rng = np.random.default_rng(0)
    model = chain_model(list(rng.integers(100, 1000, 30)), list(rng.uniform(1, 10, 30)), grad_reads="both")
    with open(tmp_path / "chain.pkl", "wb") as f:
        pickle.dump(model, f)
    saved = tmp_path / "saved.json"
    bench_plan_grid.main(["run", str(tmp_path), "--save", str(saved)])
    figures = json.loads(saved.read_text())
    assert sorted(figures) == sorted(f"chain {fraction}" for fraction in bench_plan_grid.FRACTIONS)
    costs = [figures[f"chain {fraction}"][1] for fraction in bench_plan_grid.FRACTIONS]
    assert all(cost is not None for cost in costs), "budgets between the memory plan and plain all fit"
    assert costs[0] > costs[-1], "a tighter budget recomputes more"
    capsys.readouterr()
    bench_plan_grid.main(["run", str(tmp_path), "--compare", str(saved)])
    out = capsys.readouterr().out
    assert "geometric mean 1.000 over 6 budgets" in out, out
