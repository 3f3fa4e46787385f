"""The one-model-per-process protocol of the side-by-side benchmarks (experiments.child_figures)."""

import pytest

from experiments.child_figures import print_figures, run_child


def test_a_child_that_prints_no_figures_is_an_error_naming_its_last_line():
    with pytest.raises(RuntimeError, match="No module named"):
        run_child("experiments.no_such_benchmark", [])


def test_the_figures_line_round_trips(capsys):
    print_figures({"plain": [1, 2], "name": "lstm"})
    line = capsys.readouterr().out
    assert line.startswith("FIGURES ") and line.endswith("\n")
    import json

    assert json.loads(line[len("FIGURES "):]) == {"plain": [1, 2], "name": "lstm"}
