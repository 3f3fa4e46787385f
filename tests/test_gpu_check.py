"""experiments.gpu_check: its command line, what it says without a GPU, its
page of figures, and (slow) a whole trial of its sections on the CPU."""

import json

import pytest
import tensorflow as tf

from experiments import gpu_check

no_gpu = pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                            reason="with a GPU, the command measures instead of saying there is none")


def test_help_works(capsys):
    with pytest.raises(SystemExit) as ended:
        gpu_check.main(["--help"])
    assert ended.value.code == 0
    assert "--allow-cpu" in capsys.readouterr().out


def test_an_unknown_section_is_refused_with_the_choices():
    with pytest.raises(SystemExit) as ended:
        gpu_check.main(["--sections", "demo,speed"])
    assert ended.value.code == 2


@no_gpu
def test_without_a_gpu_it_says_so_and_exits_0(capsys, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "no GPU is present" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_the_page_shows_bytes_in_mib_and_every_failure_is_found():
    results = {"swap": {"swap_peak": 3 * 2 ** 20, "swap_seconds": 0.0123456},
               "budget": {"peaks": {"resident": 2 ** 20, "plain": 9 * 2 ** 20, "memory": 4 * 2 ** 20},
                          "runs": {"0.3": {"budget": 2 * 2 ** 20, "feasible": False, "error": "exit status 139"}}}}
    page = gpu_check.markdown(results, "trial")
    assert "- swap_peak: 3.0 MiB" in page and "- swap_seconds: 0.01235" in page
    assert "| 0.3 | 2.0 | False | exit status 139 |" in page
    assert gpu_check.errors(results) == [("budget/runs/0.3", "exit status 139")]


@pytest.mark.slow  # about 2 minutes: every section in processes of their own
def test_a_quick_trial_on_the_cpu_runs_every_section(tmp_path):
    assert gpu_check.main(["--allow-cpu", "--quick", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    assert set(figures) == set(gpu_check.SECTIONS)
    assert figures["demo"]["max_relative_difference"] < 1e-5
    assert figures["budget"]["runs"]["0.7"]["outcome"] in ("trained", "refused")
    assert figures["profiles"]["profiled_signatures"] > 0  # a fresh cache: every kernel profiled
    assert figures["swap"]["swapped_bytes"] > 0
