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


def test_the_command_line_measures_as_the_child_and_checks_the_models_as_the_parent(capsys):
    from experiments.child_figures import models_asked

    models = {"lstm": "an LSTM", "gru": "a GRU"}

    def measure(name, repeats):
        return {"name": name, "repeats": repeats}

    assert models_asked(["--child", "gru", "--repeats", "2"], "m", "doc", models, "lstm", 3, measure) is None
    assert capsys.readouterr().out == 'FIGURES {"name": "gru", "repeats": 2}\n'
    assert models_asked([], "m", "doc", models, "lstm,gru", 3, measure) == (["lstm", "gru"], 3)
    with pytest.raises(SystemExit):
        models_asked(["--models", "lstm,rnn"], "m", "doc", models, "lstm", 3, measure)
    assert "unknown model(s) ['rnn']" in capsys.readouterr().err
