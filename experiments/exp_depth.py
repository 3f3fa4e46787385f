"""Memory and step time against depth: CIFAR-sized ResNets (the seed blog's figure).

ResNets for 32x32x3 inputs (a 3x3 stem, three stages of ``n`` residual
blocks of two 3x3 convolutions with 16/32/64 channels, strided first blocks
with 1x1 projections, global pooling and a dense layer; 6n+2 layers, no
BatchNorm) are differentiated at a fixed batch with:

* ``plain``: ``tf.gradients``;
* ``recompute_grad``: TensorFlow's built-in alternative, ``tf.recompute_grad``
  around every residual block;
* ``memory`` and ``speed``: ``memsaving.gradients`` with those modes;
* ``budget``: ``memsaving.gradients(budget=...)`` at half the predicted
  plain activation peak (plus the resident bytes), or the smallest
  feasible budget where that is infeasible (shallow nets).

The peak is the CPU BFC allocator's (``memsaving.measure_peak_increase``: memory
in use before the step is subtracted), the gradients reduced to a scalar in
the step; step times are medians of several runs, as ratios to the plain step
of the same depth measured in the same run.  The growth of each method's
peak is fitted as ``peak ~ depth^k`` (least squares in log-log).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

import memsaving
from experiments.report import Table, plot_lines, progress

METHODS = ("plain", "recompute_grad", "memory", "speed", "budget")


def _conv(shape, seed):
    return tf.Variable(tf.random.normal(shape, stddev=(2.0 / (shape[0] * shape[1] * shape[2])) ** 0.5, seed=seed))


class CifarResNet:
    """Variables and forward pass of a 6n+2-layer residual net (plain TF ops)."""

    def __init__(self, n: int, width: int = 16, classes: int = 10):
        self.n = n
        self.depth = 6 * n + 2
        seed = iter(range(10_000))
        self.stem = _conv([3, 3, 3, width], next(seed))
        self.blocks = []
        channels = width
        for stage, out in enumerate((width, 2 * width, 4 * width)):
            for b in range(n):
                stride = 2 if stage > 0 and b == 0 else 1
                block = {
                    "a": _conv([3, 3, channels, out], next(seed)),
                    "b": _conv([3, 3, out, out], next(seed)),
                    "proj": _conv([1, 1, channels, out], next(seed)) if channels != out else None,
                    "stride": stride,
                }
                self.blocks.append(block)
                channels = out
        self.dense = tf.Variable(tf.random.normal([channels, classes], stddev=channels ** -0.5, seed=next(seed)))

    @property
    def variables(self) -> List[tf.Variable]:
        found = [self.stem]
        for block in self.blocks:
            found += [block["a"], block["b"]] + ([block["proj"]] if block["proj"] is not None else [])
        return found + [self.dense]

    @staticmethod
    def block_fn(block) -> Callable[[tf.Tensor], tf.Tensor]:
        def apply(h):
            y = tf.nn.relu(tf.nn.conv2d(h, block["a"], block["stride"], "SAME"))
            y = tf.nn.conv2d(y, block["b"], 1, "SAME")
            skip = h if block["proj"] is None else tf.nn.conv2d(h, block["proj"], block["stride"], "SAME")
            return tf.nn.relu(y + skip)
        return apply

    def loss(self, x: tf.Tensor, recompute: bool = False) -> tf.Tensor:
        h = tf.nn.relu(tf.nn.conv2d(x, self.stem, 1, "SAME"))
        for block in self.blocks:
            fn = self.block_fn(block)
            h = tf.recompute_grad(fn)(h) if recompute else fn(h)
        logits = tf.matmul(tf.reduce_mean(h, axis=[1, 2]), self.dense)
        return tf.reduce_mean(tf.square(logits))


def step_function(net: CifarResNet, method: str) -> Callable:
    """A tf.function computing the gradients of ``net`` with ``method``,
    reduced to a scalar (so returned weight gradients do not hide activations)."""
    ws = net.variables

    @tf.function
    def step(x):
        loss = net.loss(x, recompute=method == "recompute_grad")
        if method in ("plain", "recompute_grad"):
            grads = tf.gradients(loss, ws)
        elif method == "budget":
            plain = memsaving.plan(loss, ws, checkpoints=[])
            budget = plain.resident_bytes + int(0.5 * (plain.plain_peak - plain.resident_bytes))
            try:
                grads = memsaving.gradients(loss, ws, budget=budget)
            except memsaving.BudgetError as error:  # shallow nets: the smallest budget that fits
                grads = memsaving.gradients(loss, ws, budget=error.smallest_budget)
        else:
            grads = memsaving.gradients(loss, ws, checkpoints=method)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    return step


def median_seconds(fn: Callable, x, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).numpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def fit_exponent(depths, peaks) -> Optional[float]:
    """``k`` in ``peak ~ depth^k`` (least squares in log-log)."""
    if len(depths) < 2:
        return None
    slope, _ = np.polyfit(np.log(depths), np.log(peaks), 1)
    return float(slope)


def run(out_dir: str, blocks: List[int], batch: int, repeats: int, methods=METHODS) -> Dict[str, list]:
    """Measure every method at every depth; write tables and plots."""
    peaks: Dict[str, Dict[int, float]] = {m: {} for m in methods}
    ratios: Dict[str, Dict[int, float]] = {m: {} for m in methods}
    table = Table("memory_vs_depth", f"Peak memory and step time against depth (CIFAR ResNets, batch {batch})",
                  ["layers", "method", "peak MiB", "peak / plain", "step ms", "time / plain"])
    for n in blocks:
        net = CifarResNet(n)
        x = tf.random.normal([batch, 32, 32, 3], seed=n)
        steps = {m: step_function(net, m) for m in methods}
        measured = {}
        for method, step in steps.items():
            step(x)  # trace, plan and warm up
            measured[method] = memsaving.measure_peak_increase(step, x) / 2 ** 20
        # times: rounds over all methods, so drifts of the machine hit all alike
        times = {m: [] for m in methods}
        for _ in range(repeats):
            for method, step in steps.items():
                times[method].append(median_seconds(step, x, 1))
        plain_time, plain_peak = float(np.median(times["plain"])), measured["plain"]
        for method in methods:
            peak, seconds = measured[method], float(np.median(times[method]))
            ratio = seconds / plain_time
            peaks[method][net.depth] = peak
            ratios[method][net.depth] = ratio
            table.add(net.depth, method, round(peak, 2), round(peak / plain_peak, 3), round(seconds * 1e3, 2),
                      round(ratio, 3))
            progress("memory_vs_depth", f"{net.depth} layers, {method}: peak {peak:.2f} MiB, "
                     f"step {seconds * 1e3:.1f} ms ({ratio:.2f}x plain)")
    fits = Table("memory_vs_depth_fit", "Growth of the peak with depth: peak ~ layers^k",
                 ["method", "k (log-log slope)", "mean time / plain"])
    for method in methods:
        depths = sorted(peaks[method])
        k = fit_exponent(depths, [peaks[method][d] for d in depths])
        mean_ratio = float(np.mean([ratios[method][d] for d in depths])) if depths else None
        fits.add(method, round(k, 3) if k is not None else None, round(mean_ratio, 3) if mean_ratio else None)
    fits.notes.append("k = 1: linear growth (plain backprop); k = 0.5: sqrt(n) checkpointing.")
    files = table.write(out_dir) + fits.write(out_dir)
    files.append(plot_lines(f"{out_dir}/memory_vs_depth.png", f"Peak memory vs depth (batch {batch})", "layers",
                            "peak MiB", {m: (sorted(peaks[m]), [peaks[m][d] for d in sorted(peaks[m])])
                                         for m in methods}))
    files.append(plot_lines(f"{out_dir}/time_vs_depth.png", "Step time relative to plain", "layers",
                            "time / plain", {m: (sorted(ratios[m]), [ratios[m][d] for d in sorted(ratios[m])])
                                             for m in methods}))
    return {"peaks": peaks, "ratios": ratios, "files": files}
