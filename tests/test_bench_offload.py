"""experiments.bench_offload on a small MLP: both columns printed, the
variables and Adam's state counted, the offloaded peak lower and the
reduction ratio what the two peaks give, and the note that the peak is
predicted only."""

import re

from experiments import bench_offload


def test_prints_both_predictions_side_by_side(capsys):
    bench_offload.main(["--width", "128", "--depth", "3", "--batch", "8"])
    out = capsys.readouterr().out
    trainable = (3 * (128 * 128 + 128) + 128 * 10 + 10) * 4
    assert f"variables {trainable / 2**20:.1f} MiB" in out and f"Adam state {2 * trainable / 2**20:.1f} MiB" in out
    without = re.search(r"without offload\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([\d.]+) ms", out)
    with_ = re.search(r"with offload\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([\d.]+) ms\s+([\d.]+) MiB", out)
    assert without and with_, out
    assert float(with_.group(1)) < float(without.group(1))
    assert float(with_.group(2)) < float(without.group(2)), "variables and Adam state leave the device"
    found = bench_offload.figures(width=128, depth=3, batch=8)
    ratio = found["resident"].peak_bytes / found["offloaded"].peak_bytes
    assert ratio > 1 and f"device peak {ratio:.2f}x lower" in out
    assert "Predicted only" in out and "share one allocator" in out


def test_figures_count_every_weight_copy():
    found = bench_offload.figures(width=64, depth=2, batch=4)
    offloaded = found["offloaded"]
    assert offloaded.offloaded_bytes == found["trainable"]
    assert offloaded.returned_bytes == found["trainable"], "every weight gradient goes back to the host"
    # a forward copy of every weight, a backward one of every kernel but the first (its input needs no gradient)
    kernels = 64 * 64 * 4 * 2 + 64 * 10 * 4
    assert found["trainable"] + kernels - 64 * 64 * 4 <= offloaded.copied_bytes <= found["trainable"] + kernels
