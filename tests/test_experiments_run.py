"""experiments.run in its tiny configuration: every experiment runs and writes
its tables and plots, with figures that make sense (so they cannot rot)."""

import csv
import os

import pytest

from experiments import run


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # about 35 s: the experiments are benchmarks
def test_every_experiment_writes_its_tables_and_plots(tmp_path):
    out = str(tmp_path)
    results = run.main(["--tiny", "--out", out])
    assert set(results) == set(run.EXPERIMENTS)
    for name in ("memory_vs_depth", "memory_vs_depth_fit", "largest_batch", "plan_quality", "treedecomp"):
        assert os.path.getsize(os.path.join(out, f"{name}.md")) > 0
        assert _rows(os.path.join(out, f"{name}.csv")), name
    for png in ("memory_vs_depth.png", "time_vs_depth.png", "largest_batch.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    depth = results["depth"]["peaks"]
    deepest = max(depth["plain"])
    # measured, not predicted: memory mode lowers the peak of the deepest net
    assert depth["memory"][deepest] < depth["plain"][deepest]
    assert depth["plain"][deepest] > depth["plain"][min(depth["plain"])], "plain grows with depth"

    batch = results["batch"]["results"]["unet"]
    assert batch["plain"] is not None and batch["plain"] >= 2, "plain fits its own budget at the base batch"

    quality = results["quality"]
    assert quality["rows"], "the plan-quality sweep produced rows"
    for row in quality["rows"]:
        if row.full is not None and row.milp is not None and row.optimal:
            assert row.full >= row.milp - 1e-6, "no plan beats the MILP optimum"

    widths = _rows(os.path.join(out, "treedecomp.csv"))
    assert all(int(r["ours w"]) >= 1 for r in widths)
