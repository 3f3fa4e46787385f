"""What memsaving does on a GPU, in one command: ``python -m experiments.gpu_check``.

Every figure in ``experiments/RESULTS.md`` was measured on CPU, where two
logical devices stand in for accelerator and host, they share one allocator,
and the convolutions' work buffers are Eigen's.  The product is for GPUs.
This command measures, on a machine with one, what the CPU cannot show, and
fits in 8 minutes so that a short lease of a GPU machine is enough:

``demo``
    ``make demo``'s step (64 Dense layers, plain against memory mode): peaks
    and step times on the GPU's allocator.
``budget``
    a residual conv net's plain and memory-mode peaks, then for budgets of
    resident + 0.3 / 0.5 / 0.7 of the plain step's own memory, 20 training
    steps through ``memsaving.fit_to_budget`` with the GPU's memory capped at
    the budget (``tf.config.set_logical_device_configuration(...,
    memory_limit=...)``, so a step over it is a real out-of-memory error):
    trained, refused (``BudgetError``) or crashed, and the highest peak.
``swap``
    ``swap=True`` on a chain of Dense layers against plain and memory mode:
    peaks, step times, the bytes swapped, the time those bytes take to go to
    the host and back alone, and the share of that time the step hid
    behind its compute (the overlap).
``profiles``
    memory mode on the conv net with kernel profiling: the op signatures
    profiled, their time, the largest work buffer (cuDNN's workspaces), and
    the predicted peak against the measured one.

Each section runs in a Python process of its own (a GPU's memory limit is
set when TensorFlow starts, and an out-of-memory crash must not end the
check), under its share of ``--minutes``.  The figures go to
``experiments/results/gpu/gpu_check.json`` and ``gpu_check.md``.

Without a GPU it says so and exits 0: nothing is measured.  ``--allow-cpu``
runs the same sections on the CPU (into ``--out``, default
``experiments/results/gpu/cpu-trial``), to check the command itself where
no GPU is at hand; ``--quick`` makes every model small.

Examples
--------
``python -m experiments.gpu_check``: on a GPU machine, about 5-8 minutes.

``python -m experiments.gpu_check --allow-cpu --quick --sections swap``:
the swap section on CPU, small, in under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from experiments.child_figures import PREFIX, print_figures

SECTIONS = ("demo", "budget", "swap", "profiles")
"""The parts of the check, in the order they run."""

DEFAULT_OUT = os.path.join("experiments", "results", "gpu")
MiB = 2 ** 20
FRACTIONS = (0.3, 0.5, 0.7)
"""Budgets: resident + this fraction of the plain step's own memory."""
TRAINED_STEPS = 20


# ----------------------------------------------------------------------------- the sizes


def sizes(quick: bool) -> Dict[str, Any]:
    """The models' sizes: ``quick`` ones run in seconds on a CPU."""
    if quick:
        return {"demo": dict(depth=8, batch=256, width=64), "conv": dict(size=16, blocks=4, batch=4),
                "chain": dict(depth=6, batch=256, width=256)}
    return {"demo": dict(depth=64, batch=2048, width=256), "conv": dict(size=64, blocks=16, batch=32),
            "chain": dict(depth=24, batch=4096, width=1024)}


# ----------------------------------------------------------------------------- one section, in its own process


def _start_tensorflow(limit_mib: Optional[int]):
    """TensorFlow, with the first GPU's memory capped at ``limit_mib`` when given."""
    import memsaving  # noqa: F401  (sets the CPU allocator's statistics on before TensorFlow starts)
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus and limit_mib is not None:
        tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(
            memory_limit=int(limit_mib))])
    return tf


def _conv_setup(quick: bool):
    """The conv net every conv section measures (seeded), its input batch and a built SGD optimizer."""
    import keras
    import tensorflow as tf

    from memsaving.tools import models

    shape = sizes(quick)["conv"]
    keras.utils.set_random_seed(0)
    model = models.residual_convnet(size=shape["size"], blocks=shape["blocks"], filters=(32,), batch_norm=False)
    x = tf.random.stateless_normal([shape["batch"], shape["size"], shape["size"], 3], [1, 2])
    optimizer = keras.optimizers.SGD(1e-3)
    optimizer.build(model.trainable_variables)
    return model, x, optimizer


def _conv_step(model, optimizer, **options):
    """A training step of ``model`` with ``memsaving.gradients(**options)``
    (``tf.gradients`` when no option is given)."""
    import memsaving
    import tensorflow as tf

    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        weights = model.trainable_variables
        grads = memsaving.gradients(loss, weights, **options) if options else tf.gradients(loss, weights)
        optimizer.apply_gradients(zip(grads, weights))
        return loss

    return step


def _median_seconds(step, *args, runs: int = 5) -> float:
    step(*args)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = step(*args)
        _ = result.numpy() if hasattr(result, "numpy") else result
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def section_demo(quick: bool, **_: Any) -> Dict[str, Any]:
    from memsaving.tools.demo import run_demo

    result = run_demo(**sizes(quick)["demo"])
    return {key: getattr(result, key) for key in result.__dataclass_fields__}


def section_conv_peaks(quick: bool, **_: Any) -> Dict[str, Any]:
    """The conv net's resident bytes, and its plain and memory-mode step peaks (no limit)."""
    import memsaving
    import tensorflow as tf

    model, x, optimizer = _conv_setup(quick)
    from memsaving.tf.measure import bytes_in_use

    figures: Dict[str, Any] = {"resident": bytes_in_use()}
    for name, options in (("plain", {}), ("memory", {"checkpoints": "memory"})):
        step = tf.function(_conv_step(model, optimizer, **options))
        step(x)
        figures[name] = max(memsaving.measure_peak(step, x) for _ in range(3))
        figures[f"{name}_seconds"] = _median_seconds(step, x)
    return figures


def section_budget_run(quick: bool, budget: int, **_: Any) -> Dict[str, Any]:
    """``fit_to_budget`` and 20 steps in all, under a memory limit of ``budget``."""
    import memsaving
    import tensorflow as tf

    model, x, optimizer = _conv_setup(quick)
    try:
        step = memsaving.fit_to_budget(_conv_step(model, optimizer, budget=budget), x, budget=budget)
    except memsaving.BudgetError as error:
        return {"outcome": "refused", "smallest_budget": error.smallest_budget, "steps": 0}
    steps, highest = 0, 0
    try:
        while steps < TRAINED_STEPS:
            highest = max(highest, memsaving.measure_peak(step, x))
            steps += 1
    except tf.errors.ResourceExhaustedError:
        return {"outcome": "out of memory", "steps": steps, "peak": highest}
    return {"outcome": "trained", "steps": steps, "peak": highest,
            "rounds": len(step.calibration.rounds), "calibration_seconds": step.calibration.seconds}


def section_swap(quick: bool, **_: Any) -> Dict[str, Any]:
    """Plain, memory mode and ``swap=True`` on a Dense chain; the copies' time alone."""
    import memsaving
    import numpy as np
    import tensorflow as tf

    shape = sizes(quick)["chain"]
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((shape["width"], shape["width"])).astype(np.float32) * 0.03)
               for _ in range(shape["depth"])]
    x = tf.constant(rng.standard_normal((shape["batch"], shape["width"])).astype(np.float32))
    plans: Dict[str, Any] = {}

    def make(name, **options):
        @tf.function
        def step(x):
            h = x
            for w in weights:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h * h)
            if options:
                grads, plans[name] = memsaving.gradients_and_plan(loss, weights, **options)
            else:
                grads = tf.gradients(loss, weights)
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        return step

    figures: Dict[str, Any] = {}
    for name, options in (("plain", {}), ("memory", {"checkpoints": "memory"}),
                          ("swap", {"checkpoints": [], "swap": True})):
        step = make(name, **options)
        step(x)
        figures[f"{name}_peak"] = max(memsaving.measure_peak(step, x) for _ in range(3))
        figures[f"{name}_seconds"] = _median_seconds(step, x)
    swapped = plans["swap"].swapped_bytes
    figures["swapped_bytes"] = int(sum(swapped))
    figures["predicted_transfer_seconds"] = float(2 * sum(plans["swap"].transfer_seconds))
    figures["copy_seconds"] = _round_trip_seconds(swapped)
    extra = figures["swap_seconds"] - figures["plain_seconds"]
    copy = figures["copy_seconds"]
    figures["overlap"] = None if copy <= 0 else max(0.0, min(1.0, 1.0 - extra / copy))
    return figures


def _round_trip_seconds(sizes_in_bytes: List[int]) -> float:
    """The time tensors of these sizes take to go to the host and back, alone
    (median of 5), as the swaps copy them."""
    import tensorflow as tf

    from memsaving.tf.measure import default_device

    device = default_device()
    with tf.device(device):
        tensors = [tf.ones([max(n // 4, 1)], tf.float32) for n in sizes_in_bytes]

    @tf.function
    def round_trip():
        back = []
        for t in tensors:
            with tf.device("/CPU:0"):
                host = tf.identity(t)
            with tf.device(device):
                back.append(tf.reduce_sum(tf.identity(host)))
        return tf.add_n(back) if back else tf.constant(0.0)

    return _median_seconds(round_trip)


def section_profiles(quick: bool, **_: Any) -> Dict[str, Any]:
    """Memory mode on the conv net with its kernels profiled (a fresh profile cache)."""
    import memsaving
    import tensorflow as tf

    model, x, optimizer = _conv_setup(quick)
    plans = []

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        weights = model.trainable_variables
        grads, plan = memsaving.gradients_and_plan(loss, weights, checkpoints="memory", profile=True)
        plans.append(plan)
        optimizer.apply_gradients(zip(grads, weights))
        return loss

    step(x)
    plan = plans[-1]
    return {"profiled_signatures": plan.profiled_signatures, "cached_signatures": plan.cached_signatures,
            "profile_seconds": plan.profile_seconds, "largest_work_buffer": plan.largest_work_buffer,
            "predicted_peak": plan.predicted_peak, "measured_peak": max(memsaving.measure_peak(step, x)
                                                                        for _ in range(3))}


CHILDREN = {"demo": section_demo, "conv_peaks": section_conv_peaks, "budget_run": section_budget_run,
            "swap": section_swap, "profiles": section_profiles}


def child_main(name: str, quick: bool, limit_mib: Optional[int], budget: Optional[int]) -> None:
    """Run one section in this process and print its figures as one JSON line."""
    tf = _start_tensorflow(limit_mib)
    figures = CHILDREN[name](quick=quick, budget=budget)
    figures["device"] = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    print_figures(figures)


# ----------------------------------------------------------------------------- the orchestration


def _run_child(name: str, quick: bool, timeout: float, limit_mib: Optional[int] = None,
               budget: Optional[int] = None, environment: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """One section in a process of its own: its figures, or what went wrong."""
    command = [sys.executable, "-m", "experiments.gpu_check", "--child", name]
    command += ["--quick"] if quick else []
    command += [] if limit_mib is None else ["--limit-mib", str(limit_mib)]
    command += [] if budget is None else ["--budget", str(budget)]
    start = time.perf_counter()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(environment or {}))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout, 1.0), env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after its {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit status {done.returncode}: " + " | ".join(tail)}
    figures = json.loads(lines[-1][len(PREFIX):])
    figures["seconds"] = round(time.perf_counter() - start, 1)
    return figures


def run_check(sections: List[str], quick: bool, minutes: float, progress=print) -> Dict[str, Any]:
    """Every section asked for, each under its share of ``minutes``."""
    deadline = time.perf_counter() + 60 * minutes
    results: Dict[str, Any] = {}
    for index, section in enumerate(sections):
        left = deadline - time.perf_counter()
        share = left / (len(sections) - index)
        progress(f"gpu_check: {section} ({share:.0f} s at most)")
        if section == "budget":
            results[section] = _budget_section(quick, share)
        elif section == "profiles":  # every kernel profiled afresh, not read from the earlier sections' cache
            with tempfile.TemporaryDirectory() as cache:
                results[section] = _run_child(section, quick, share, environment={"MEMSAVING_CACHE_DIR": cache})
        else:
            results[section] = _run_child(section, quick, share)
        progress(f"gpu_check: {section}: {json.dumps(results[section])[:300]}")
    return results


def _budget_section(quick: bool, seconds: float) -> Dict[str, Any]:
    """The conv net's peaks without a limit, then one capped process per budget."""
    deadline = time.perf_counter() + seconds
    peaks = _run_child("conv_peaks", quick, seconds / 2)
    if "error" in peaks:
        return {"peaks": peaks}
    runs = {}
    for index, fraction in enumerate(FRACTIONS):
        budget = int(peaks["resident"] + fraction * (peaks["plain"] - peaks["resident"]))
        left = (deadline - time.perf_counter()) / (len(FRACTIONS) - index)
        limit = -(-budget // MiB)
        # on a GPU the cap is the logical device's memory limit; on CPU (--allow-cpu) the allocator's
        runs[str(fraction)] = dict(budget=budget, feasible=peaks["memory"] <= budget,
                                   **_run_child("budget_run", quick, left, limit_mib=limit, budget=budget,
                                                environment={"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit)}
                                                if peaks.get("device") == "CPU" else None))
    return {"peaks": peaks, "runs": runs}


def markdown(results: Dict[str, Any], header: str) -> str:
    """The figures as a page of tables."""
    lines = [f"# gpu_check: {header}", ""]
    for section, figures in results.items():
        lines.append(f"## {section}")
        lines.append("")
        if section == "budget" and "runs" in figures:
            lines.append("| fraction | budget MiB | feasible | outcome | steps | peak MiB |")
            lines.append("|---|---|---|---|---|---|")
            for fraction, run in figures["runs"].items():
                peak = run.get("peak")
                lines.append(f"| {fraction} | {run['budget'] / MiB:.1f} | {run['feasible']} | "
                             f"{run.get('outcome', run.get('error'))} | {run.get('steps', '')} | "
                             f"{'' if peak is None else f'{peak / MiB:.1f}'} |")
            figures = figures["peaks"]
            lines.append("")
        for key, value in figures.items():
            lines.append(f"- {key}: {shown(key, value)}")
        lines.append("")
    return "\n".join(lines)


BYTE_FIGURES = ("peak", "bytes", "buffer", "plain", "memory", "resident", "budget")
"""Figures named with one of these words are bytes (shown in MiB), unless they are seconds."""


def shown(key: str, value: Any) -> str:
    """One figure as the page shows it: bytes in MiB, floats to 4 significant digits.

    >>> shown("memory_peak", 3 * MiB), shown("memory_seconds", 0.0123456), shown("steps", 20)
    ('3.0 MiB', '0.01235', '20')
    """
    if isinstance(value, int) and not isinstance(value, bool) and "seconds" not in key and \
            any(word in key for word in BYTE_FIGURES):
        return f"{value / MiB:.1f} MiB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gpu_check",
        description="Measure memsaving on a GPU in under 8 minutes: the demo, budgets under a capped GPU memory, "
                    "swap with real host transfers, and kernel profiles (cuDNN workspaces). Without a GPU it "
                    "says so and exits 0.")
    parser.add_argument("--out", default=None, help=f"folder for gpu_check.json and .md (default {DEFAULT_OUT}; "
                        f"with --allow-cpu, {DEFAULT_OUT}/cpu-trial)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated parts to run, of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--minutes", type=float, default=7.5, help="time for the whole check (default 7.5)")
    parser.add_argument("--quick", action="store_true", help="small models (seconds each, for a trial)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU when no GPU is present (to try the command itself)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--limit-mib", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, args.quick, args.limit_mib, args.budget)
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    device = _gpu_present()
    if device is None and not args.allow_cpu:
        print("gpu_check: no GPU is present (TensorFlow lists no GPU device), so nothing was measured. Run it on a "
              "machine with a GPU and tensorflow[and-cuda]; --allow-cpu tries the sections on the CPU.")
        return 0
    out = args.out or (DEFAULT_OUT if device is not None else os.path.join(DEFAULT_OUT, "cpu-trial"))
    results = run_check(sections, args.quick, args.minutes)
    header = f"{device or 'CPU (--allow-cpu trial)'}, {time.strftime('%Y-%m-%d %H:%M')}" + \
        (", --quick" if args.quick else "")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as file:
        json.dump({"header": header, "results": results}, file, indent=1)
    with open(os.path.join(out, "gpu_check.md"), "w") as file:
        file.write(markdown(results, header) + "\n")
    print(f"gpu_check: figures in {out}/gpu_check.json and gpu_check.md")
    failed = errors(results)
    for where, error in failed:
        print(f"gpu_check: {where} failed: {error}")
    return 1 if failed else 0


def errors(results: Dict[str, Any], where: str = "") -> List[tuple]:
    """``(section path, message)`` of every part that failed to run."""
    found = []
    for key, value in results.items():
        if key == "error":
            found.append((where, value))
        elif isinstance(value, dict):
            found += errors(value, f"{where}/{key}" if where else key)
    return found


def _gpu_present() -> Optional[str]:
    """The first GPU's name as TensorFlow describes it, or None; asked in a
    process of its own, so this one starts TensorFlow only in its children."""
    code = ("import tensorflow as tf; g = tf.config.list_physical_devices('GPU'); "
            "print('GPU', tf.config.experimental.get_device_details(g[0]).get('device_name', 'GPU') if g else '')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    line = next((line for line in done.stdout.splitlines() if line.startswith("GPU")), "GPU ")
    name = line[4:].strip()
    return name or None


if __name__ == "__main__":
    sys.exit(main())
