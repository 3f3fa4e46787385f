"""The demo command and measure_peak's error path."""

import dataclasses
import os

import memsaving
from memsaving.tools.cli import main
from memsaving.tools.demo import run_demo

from helpers import in_a_fresh_process


def test_demo_runs_and_saves_memory_on_a_small_model(capsys):
    assert main(["demo", "--depth", "16", "--batch", "512", "--width", "64"]) == 0
    out = capsys.readouterr().out
    assert "peak memory (MiB)" in out and "max relative gradient difference" in out


def demo_figures(depth: int, batch: int, width: int) -> dict:
    """``run_demo``'s result as a dict (run in a fresh process by the test)."""
    return dataclasses.asdict(run_demo(depth=depth, batch=batch, width=width, repeats=1))


def test_demo_result_is_measured():
    """The demo's Keras Dense stack, with TensorFlow's default thread pools
    as the demo runs: memory mode measures well below plain (Grappler
    cancelled this saving on Keras Dense stacks before), and both measured
    peaks are near the plan's predictions."""
    result = in_a_fresh_process("test_cli_and_measure", "demo_figures", 16, 1024, 256, test_settings=False)
    assert result["max_relative_difference"] <= 1e-5
    assert result["peak_plain"] > 1.5 * result["peak_memsaving"]
    # measured 23.3-24.3 MiB plain and 13.5-14.5 memory mode, from process to process, against 23.0 and 13.0
    assert abs(result["predicted_plain"] / result["peak_plain"] - 1) <= 0.10
    assert abs(result["predicted_memsaving"] / result["peak_memsaving"] - 1) <= 0.15


def test_measure_peak_without_statistics_says_what_to_do(monkeypatch):
    """When the allocator keeps no statistics TensorFlow raises; we explain."""
    import pytest
    import tensorflow as tf

    def no_stats(device):
        raise ValueError(f"memory statistics are not supported for {device}")

    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", no_stats)
    with pytest.raises(memsaving.PeakMemoryUnavailableError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
        memsaving.measure_peak(lambda: None, device="CPU:0")


def test_import_sets_bfc_variable():
    assert os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true"
    assert memsaving.measure_peak(lambda: memsaving.__name__) >= 0


def test_measure_peak_increase_excludes_memory_already_in_use():
    import tensorflow as tf

    held = tf.ones([1024, 1024])  # 4 MiB alive before the call
    x = tf.random.normal([512, 1024], seed=1)
    step = tf.function(lambda x: tf.reduce_sum(tf.exp(x) * 2.0))  # 2 MiB temporaries
    step(x)
    total = memsaving.measure_peak(step, x)
    increase = memsaving.measure_peak_increase(step, x)
    assert total - increase >= held.shape.num_elements() * 4
    assert 2 * 2 ** 20 <= increase < total
