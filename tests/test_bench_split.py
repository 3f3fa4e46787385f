"""experiments.bench_split in its quick configuration: every row is measured
and the lowest split measures below the best unsplit plan."""

import pytest

from experiments import bench_split


@pytest.mark.slow  # about a minute: a benchmark
def test_bench_split_quick_gpt(capsys):
    rows = {row[0]: row for row in bench_split.measure("gpt", quick=True, repeat=1, timeline_units=3)}
    unsplit = min(rows["memory"][2], rows["floor (budget, no split)"][2])
    assert rows["split (lowest)"][2] < unsplit  # measured peaks
    assert "pieces of" in rows["split (lowest)"][-1]
    printed = capsys.readouterr().out
    assert "units of largest measured peak" in printed and "held MiB" in printed
