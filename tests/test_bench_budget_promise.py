"""The budget-promise sweep's summary: read back from its CSV, and which
budgets count as feasible as measured.  No model runs here: the rows are
written by hand in the sweep's own format."""

import pytest

from experiments import bench_budget_promise as sweep

MIB_ROWS = {
    # model, case, fraction, budget, status, measured, measured min, predicted, measured/budget,
    # predicted/budget, error, smallest_budget, smallest/plain, then the calibrated columns
    "a": [
        ["a", "plain", None, None, "-", 20.0, 19.5, 19.0, None, None, -0.05, None, None] + sweep.NO_CAL,
        ["a", "memory", None, None, "-", 10.0, 9.8, 9.5, None, None, -0.05, None, None] + sweep.NO_CAL,
        ["a", "budget", 0.6, 12.0, "OVER", 12.5, 12.4, 11.9, 12.5 / 12, 11.9 / 12, -0.048, None, None,
         "fits", 2, 11.5, 11.6, 11.5, 11.6 / 12, None, None, None, None],
        # the planner calls 9.0 MiB feasible, but no step of the model measured under 10.0
        ["a", "budget", 0.45, 9.0, "OVER", 10.4, 10.3, 8.9, 10.4 / 9, 8.9 / 9, -0.144, None, None,
         "BudgetError", 4, 10.2, 10.2, 10.1, 10.2 / 10.2, 10.2, 0.51, "fits", 1],
    ],
}


def _results():
    result = sweep.ModelResult("a", "by hand", 4, calibrated=True)
    result.rows = [list(row) for row in MIB_ROWS["a"]]
    return [result]


def test_summary_read_back_from_the_csv_is_the_same(tmp_path):
    results = _results()
    table, lines = sweep.summarize(results, [])
    sweep.write(results, table, lines, str(tmp_path), "by hand")
    again = sweep.read_csv(str(tmp_path / "budget_promise.csv"))
    table_again, lines_again = sweep.summarize(again, [])
    for read, written in zip(again[0].rows, results[0].rows):
        assert read == [pytest.approx(v, abs=1e-4) if isinstance(v, float) else v for v in written]
    assert lines_again == lines
    assert table_again[2].split("|")[1:-2] == table[2].split("|")[1:-2]  # all but the sweep's seconds


def test_a_budget_below_every_measured_step_is_not_feasible_as_measured():
    results = _results()
    assert sweep.lowest_measured(results[0]) == 10.0
    _, lines = sweep.summarize(results, [])
    line = next(text for text in lines if text.startswith("- feasible as measured"))
    assert "1 of 2 cases; calibrated measured <= budget in 1 of them (100%)" in line
    assert "a at 0.45 (BudgetError)" in line
