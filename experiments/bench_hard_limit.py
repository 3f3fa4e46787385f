"""Does a budget hold under a hard memory limit, from the first step on?

A user names a budget because that is the memory they have; on a device a
step that goes over is an out-of-memory error, not "1.3x over".  TensorFlow
enforces the same on CPU: ``TF_CPU_BFC_MEM_LIMIT_IN_MB=N``, set before it
starts, caps the CPU allocator at N MiB, and an allocation past it raises
``ResourceExhaustedError`` or ends the process.  This benchmark trains each
model under that cap, set to the budget, through every route a user takes,
each in a Python process of its own, with TensorFlow's default threads:

* ``plain``: plain ``tf.gradients`` steps under the cap: must fail (else the
  budget saves nothing);
* ``memory_cap``: ``checkpoints="memory"`` steps under the cap: whether the
  lowest plan meets the budget where it counts (a peak measured just under
  the budget without the cap can still run out of memory under it);
* ``memory``, ``budget`` (no cap): the peaks of ``checkpoints="memory"`` and
  of ``budget=`` plans, measured (the highest of several runs) beside their
  predictions, with the run-to-run spread and the predicted recompute cost;
* ``fit`` (cap): ``memsaving.fit_to_budget`` then training steps up to 20 in all;
* ``keras`` (cap): ``memsaving.keras.enable(model, budget=...)`` then
  ``fit`` for 20 steps;
* ``alone`` (cap): a step with ``memsaving.gradients(..., budget=...)``
  alone, 20 steps;
* for the models of ``SPLIT_MODELS`` (a GPT-style model with a wide
  vocabulary head), the same with ``split="auto"``: ``split_lowest`` (no
  cap) measures the lowest split plan (``split="auto"`` without a budget),
  which makes such a budget *feasible* when it measures under it;
  ``split_alone`` and ``split_fit`` (cap) train with ``budget=`` and
  ``split="auto"`` alone and through ``fit_to_budget``.

**The allocator as a GPU's.**  A GPU's BFC allocator (TensorFlow's default,
no memory growth) takes its whole memory as one region when it starts; the
CPU's grows region by region (2, 4, 8... MiB, each twice the last) up to the
cap, and no allocation spans two regions.  Under a cap, that cuts the free
memory at region ends a GPU does not have: a Keras GPT step's 62.5 MiB
dataset copy failed with 13.5 MiB free in the regions and 62 MiB left to
grow (192 MiB cap, 116.5 MiB in use).  So by default (``--allocator
one-region``) each capped worker first allocates, and frees, one tensor as
large as the cap allows, before anything else: the allocator's pool is then
(nearly) one region, as on a GPU.  ``--allocator growing`` keeps the CPU's
growth (the sweeps before 2026-11-29's ninth session ran so).

**Out-of-memory errors that raise.**  On the CPU, oneDNN's kernels end the
process (a segmentation fault: "CRASH" below) when an allocation fails
under the cap, where a GPU raises ``ResourceExhaustedError``.  With
``--onednn off`` (``TF_ENABLE_ONEDNN_OPTS=0`` in every worker) TensorFlow's
own kernels run and raise as a GPU does; calibrations may then *probe* a
budget the 30% prior refuses (``Calibrator.may_probe``: nothing measured
yet, the lowest plan predicted under the budget less the headroom): the
``fit`` and ``keras`` columns add "(probe)" where they did.

Every step is a training step: mean squared error against zeros, gradients,
an Adam update.  Budgets are ``resident + f x (plain peak - resident)``
for ``f`` in ``--fractions`` (0.3, 0.5, 0.7), rounded down to whole MiB so
that the cap is the budget exactly: resident is what the
allocator holds before the step (weights, Adam's slots, the batch), the
plain peak the highest of the plain step's measured runs (no cap).  A
budget is *feasible* when memory mode measures under it; an infeasible
budget must get a ``BudgetError`` before any step runs (the optimizer's
step counter says how many ran).

    python -m experiments.bench_hard_limit                        # every model: about 2 hours on 2 cores
    python -m experiments.bench_hard_limit --models mlp,densenet --fractions 0.5
    python -m experiments.bench_hard_limit --quick --out /tmp/hl   # smaller models: a smoke run
    python -m experiments.bench_hard_limit --models gpt --allocator growing   # the CPU's own region growth
    python -m experiments.bench_hard_limit --models resconv --onednn off      # out-of-memory errors raise: probes

Results: ``experiments/results/hard_limit.md`` and ``.csv`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

MIB = 2 ** 20
FRACTIONS = (0.3, 0.5, 0.7)
STEPS = 20
RUNS = 5
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NAME = "hard_limit"
CAPPED_ROUTES = ("plain", "memory_cap", "fit", "keras", "alone")
ALLOCATORS = ("one-region", "growing")
"""How a capped worker's CPU allocator holds its pool (see the module docstring)."""
ALLOCATOR_ENV = "MEMSAVING_BENCH_ALLOCATOR"
"""The environment variable that tells a worker which of :data:`ALLOCATORS` to use."""
SPLIT_ROUTES = ("split_alone", "split_fit")
"""Capped routes of the models in ``SPLIT_MODELS``: budget plans that may split ops (``split="auto"``)."""


# ------------------------------------------------------------------------------------- in the worker


def _worker(route: str, name: str, quick: bool, budget: Optional[int]) -> dict:
    """One route of one model in this process; returns what the parent records."""
    import memsaving  # noqa: F401  (before TensorFlow: the allocator's statistics)
    import keras
    import numpy as np
    import tensorflow as tf

    if os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB") and os.environ.get(ALLOCATOR_ENV, ALLOCATORS[0]) == "one-region":
        pool_as_one_region(int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MIB)
    from experiments.hard_limit_models import build

    case = build(name, quick)
    if case is None:
        return {"skipped": "keras_hub is not installed"}
    model, variables = case.model, case.model.trainable_variables

    def loss_of(inputs, targets):
        predictions = model(inputs, training=True)
        return tf.reduce_mean(tf.square(tf.cast(predictions, tf.float32) - tf.cast(targets, tf.float32)))

    if route == "keras":
        return _keras_route(case, budget)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(variables)
    captured: dict = {}

    def body_for(mode):
        def body(inputs, targets):
            loss = loss_of(inputs, targets)
            if mode == "plain":
                captured["plan"] = memsaving.plan(loss, variables, checkpoints=[], batch_size=case.batch)
                grads = tf.gradients(loss, variables)
            elif mode == "plain_unplanned":
                grads = tf.gradients(loss, variables)  # no memsaving at all: what training without a budget costs
            elif mode == "memory":
                grads, captured["plan"] = memsaving.gradients_and_plan(loss, variables, checkpoints="memory",
                                                                       batch_size=case.batch)
            elif mode == "split_lowest":
                grads, captured["plan"] = memsaving.gradients_and_plan(loss, variables, checkpoints="memory",
                                                                       split="auto", batch_size=case.batch)
            elif mode == "split":
                grads, captured["plan"] = memsaving.gradients_and_plan(loss, variables, checkpoints="memory",
                                                                       budget=budget, split="auto",
                                                                       batch_size=case.batch)
            else:
                grads, captured["plan"] = memsaving.gradients_and_plan(loss, variables, budget=budget,
                                                                       batch_size=case.batch)
            optimizer.apply_gradients(zip(grads, variables))
            return loss
        return body

    args = (case.inputs, case.targets)
    from memsaving.tf.measure import bytes_in_use

    result: dict = {"resident": int(bytes_in_use())}
    if route == "probe":
        return _probe(body_for, args, captured, result)
    if route == "budget":
        return _measured_route(tf.function(body_for("budget")), args, captured, result)
    if route == "split_lowest":
        return _measured_route(tf.function(body_for("split_lowest")), args, captured, result)
    if route == "split_alone":
        return _run_steps(tf.function(body_for("split")), args, optimizer, result, STEPS)
    if route == "plain":
        return _run_steps(tf.function(body_for("plain")), args, optimizer, result, STEPS)
    if route == "memory_cap":
        return _run_steps(tf.function(body_for("memory")), args, optimizer, result, STEPS)
    if route == "alone":
        return _run_steps(tf.function(body_for("budget")), args, optimizer, result, STEPS)
    if route in ("fit", "split_fit"):
        start = time.perf_counter()
        try:
            step = memsaving.fit_to_budget(body_for("split" if route == "split_fit" else "budget"), *args,
                                           budget=budget)
        except memsaving.BudgetError as error:
            result.update(error="BudgetError", message=str(error).splitlines()[0][:300],
                          steps_before_error=int(optimizer.iterations.numpy()),
                          probed=_probed(getattr(error, "calibration", None)))
            return result
        except tf.errors.ResourceExhaustedError as error:
            result.update(error="ResourceExhaustedError", message=str(error).splitlines()[0][:300],
                          steps_before_error=int(optimizer.iterations.numpy()))
            return result
        result["calibration_seconds"] = time.perf_counter() - start
        calibration = getattr(step, "calibration", None)
        result["rounds"] = len(calibration.rounds) if calibration is not None else None
        result["probed"] = _probed(calibration)
        left = max(STEPS - int(optimizer.iterations.numpy()), 0)
        return _run_steps(step, args, optimizer, result, left, traced=True)
    raise ValueError(f"unknown route {route!r}")


def pool_as_one_region(cap: int) -> int:
    """Make the capped CPU allocator hold (nearly) all of ``cap`` bytes as
    one region, as a GPU's allocator does, by allocating and freeing the
    largest tensor it grants; returns that tensor's bytes.

    Call it first, before the process allocates anything else: a region is
    made only when no free chunk is large enough, and is as large as the
    request asks (and the cap allows).  TensorFlow has its first region (2
    MiB) by then, so the sizes are tried from ``cap`` less that down, a MiB
    at a time: each refused size costs the allocator's retry wait (10 s)."""
    import tensorflow as tf

    for size in range(cap - 2 * MIB, cap // 2, -MIB):
        try:
            with tf.device("CPU:0"):
                held = tf.zeros([size], tf.uint8)
        except tf.errors.ResourceExhaustedError:
            continue
        del held
        return size
    raise RuntimeError(f"no tensor of half the {cap} bytes cap could be allocated")


def _probe(body_for, args, captured, result) -> dict:
    """Plain and memory-mode steps, no cap: peaks, predictions, step time."""
    import memsaving
    import tensorflow as tf

    # the process's first tf.function, as calibration is in the fit worker: its trace and first run,
    # with nothing of memsaving in it (the "plain" step below also plans, and profiles kernels into
    # the cache every later worker reads)
    unplanned = tf.function(body_for("plain_unplanned"))
    start = time.perf_counter()
    unplanned(*args).numpy()
    result["plain_first_call_seconds"] = time.perf_counter() - start
    for mode in ("plain", "memory"):
        step = tf.function(body_for(mode))
        start = time.perf_counter()
        step(*args).numpy()  # trace, plan, warm up
        first_call = time.perf_counter() - start
        peaks = [memsaving.measure_peak(step, *args) for _ in range(RUNS)]
        plan = captured["plan"]
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            step(*args).numpy()
            times.append(time.perf_counter() - start)
        result[mode] = {"peaks": peaks, "predicted": plan.plain_peak if mode == "plain" else plan.predicted_peak,
                        "resident": plan.resident_bytes, "compute": plan.predicted_compute,
                        "seconds": statistics.median(times), "first_call_seconds": first_call}
    return result


def _measured_route(step, args, captured, result) -> dict:
    """A ``budget=`` step, no cap: its peaks over several runs, its prediction and cost."""
    import memsaving
    import tensorflow as tf

    try:
        step(*args)
    except memsaving.BudgetError as error:
        result.update(error="BudgetError", message=str(error).splitlines()[-1][:300])
        return result
    plan = captured["plan"]
    peaks = [memsaving.measure_peak(step, *args) for _ in range(RUNS)]
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        step(*args).numpy()
        times.append(time.perf_counter() - start)
    result.update(peaks=peaks, predicted=plan.predicted_peak, planned_resident=plan.resident_bytes,
                  compute=plan.predicted_compute, seconds=statistics.median(times), mode=plan.mode)
    return result


def _run_steps(step, args, optimizer, result, steps: int, traced: bool = False) -> dict:
    """Run ``steps`` training steps; the allocator's peak over them, or the error that stopped them.

    ``first_step_seconds``: the first call's wall time (for a step not
    ``traced`` before: its trace, plan and first run, what ``budget=``
    alone costs before training runs at full speed)."""
    import memsaving
    import tensorflow as tf

    done_before = int(optimizer.iterations.numpy())
    tf.config.experimental.reset_memory_stats("CPU:0")
    try:
        for n in range(steps):
            start = time.perf_counter()
            step(*args).numpy()
            if n == 0:
                result["first_step_seconds"] = time.perf_counter() - start
    except memsaving.BudgetError as error:
        result.update(error="BudgetError", message=str(error).splitlines()[-1][:300])
    except tf.errors.ResourceExhaustedError as error:
        result.update(error="ResourceExhaustedError", message=str(error).splitlines()[0][:300])
    result["steps"] = int(optimizer.iterations.numpy())
    result["steps_before_error"] = result["steps"] if "error" in result else None
    result["peak"] = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    result["completed"] = "error" not in result and result["steps"] >= done_before + steps
    return result


def _keras_route(case, budget: int) -> dict:
    """``memsaving.keras.enable(model, budget=...)`` and ``fit`` for 20 steps."""
    import keras
    import memsaving
    import memsaving.keras  # noqa: F401
    import tensorflow as tf

    model = case.model
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    memsaving.keras.enable(model, budget=budget, verbose=False)
    # tf.data stacks a list of tensors into one: a model of several inputs gets them as a tuple
    inputs = tuple(case.inputs) if isinstance(case.inputs, list) else case.inputs
    data = tf.data.Dataset.from_tensors((inputs, case.targets)).repeat(STEPS)
    result: dict = {}
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = time.perf_counter()
    try:
        model.fit(data, epochs=1, verbose=0)
    except memsaving.BudgetError as error:
        result.update(error="BudgetError", message=str(error).splitlines()[0][:300])
    except tf.errors.ResourceExhaustedError as error:
        result.update(error="ResourceExhaustedError", message=str(error).splitlines()[0][:300])
    result["seconds"] = time.perf_counter() - start
    result["steps"] = int(model.optimizer.iterations.numpy()) if model.optimizer.built else 0
    result["steps_before_error"] = result["steps"] if "error" in result else None
    result["peak"] = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    result["completed"] = "error" not in result and result["steps"] >= STEPS
    calibration = memsaving.keras.calibration_of(model)
    result["rounds"] = len(calibration.rounds) if calibration is not None else None
    result["probed"] = _probed(calibration)
    return result


def _probed(calibration) -> bool:
    """Whether a calibration's first round was a probe (``CalibrationRound.probe``)."""
    return bool(calibration is not None and calibration.rounds and calibration.rounds[0].probe)


# ------------------------------------------------------------------------------------- in the parent


def run_worker(route: str, name: str, quick: bool, budget: Optional[int] = None, cap: Optional[int] = None,
               timeout: int = 900, allocator: str = ALLOCATORS[0]) -> dict:
    """One route in a process of its own; ``cap`` (bytes) sets TF_CPU_BFC_MEM_LIMIT_IN_MB, ``allocator``
    (one of :data:`ALLOCATORS`) how the capped allocator holds its pool."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator={allocator!r}: choose one of {ALLOCATORS}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env[ALLOCATOR_ENV] = allocator
    if cap is not None:
        if cap % MIB:
            raise ValueError(f"the cap must be whole MiB (TF_CPU_BFC_MEM_LIMIT_IN_MB), not {cap} bytes")
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(cap // MIB)
    command = [sys.executable, "-m", "experiments.bench_hard_limit", "--worker", route, "--models", name,
               "--budget", str(budget or 0)] + (["--quick"] if quick else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"crashed": f"timed out after {timeout} s"}
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        return {"crashed": f"{how}: {' | '.join(tail)[:300]}", "wall": wall}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall"] = wall
    return result


@dataclass
class CaseResult:
    model: str
    fraction: float
    budget: int
    resident: int
    plain_peak: int
    memory_peak: int
    routes: Dict[str, dict] = field(default_factory=dict)
    split_peak: Optional[int] = None
    """The lowest split plan's measured peak (``split="auto"`` without a
    budget), for the models whose budgets are tried with splitting."""

    @property
    def feasible(self) -> bool:
        return self.memory_peak <= self.budget

    @property
    def split_feasible(self) -> bool:
        """Some split plan meets the budget as measured (None: not tried)."""
        return self.split_peak is not None and min(self.split_peak, self.memory_peak) <= self.budget


def failed(outcome: dict) -> bool:
    """The route did not complete (error or crash)."""
    return bool(outcome.get("crashed") or outcome.get("error")) or not outcome.get("completed", False)


def refused_before_running(outcome: dict) -> bool:
    return outcome.get("error") == "BudgetError" and not outcome.get("steps_before_error")


def _mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _verdict(outcome: dict) -> str:
    if "crashed" in outcome:
        # ended by a signal (a capped allocator's segfault), or by an error of the benchmark itself
        return "CRASH" if outcome["crashed"].startswith("signal") else "ERROR"
    if outcome.get("error") == "BudgetError":
        return "refused" if not outcome.get("steps_before_error") else f"BudgetError after {outcome['steps_before_error']}"
    if outcome.get("error"):
        return "OOM"
    return "ok" if outcome.get("completed") else "incomplete"


def whole_mib_budget(resident: int, plain_peak: int, fraction: float) -> int:
    """``resident + fraction x (plain_peak - resident)`` rounded down to whole
    MiB: ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` takes whole MiB, and the cap must be
    the budget itself, not up to a MiB below it (2-6% of these small models).

    >>> whole_mib_budget(1 * MIB, 33 * MIB, 0.5) // MIB
    17
    """
    return int(resident + fraction * (plain_peak - resident)) // MIB * MIB


def sweep_model(name: str, quick: bool, fractions, progress, allocator: str = ALLOCATORS[0]) -> List[CaseResult]:
    probe = run_worker("probe", name, quick)
    if "skipped" in probe or "crashed" in probe:
        progress(f"{name}: {probe.get('skipped') or probe.get('crashed')}")
        return []
    resident = probe["resident"]
    plain_peak = max(probe["plain"]["peaks"])
    memory_peak = max(probe["memory"]["peaks"])
    progress(f"{name}: resident {_mib(resident)} MiB, plain {_mib(plain_peak)} (predicted "
             f"{_mib(probe['plain']['predicted'])}), memory {_mib(memory_peak)} (predicted "
             f"{_mib(probe['memory']['predicted'])}), plain step {probe['plain']['seconds']:.3f} s")
    from experiments.hard_limit_models import SPLIT_MODELS  # pylint: disable=import-outside-toplevel

    split_lowest = run_worker("split_lowest", name, quick) if name in SPLIT_MODELS else None
    split_peak = max(split_lowest["peaks"]) if split_lowest and split_lowest.get("peaks") else None
    if split_lowest is not None:
        progress(f"{name}: lowest split plan {_mib(split_peak)} MiB (predicted {_mib(split_lowest.get('predicted'))})")
    results = []
    for fraction in fractions:
        budget = whole_mib_budget(resident, plain_peak, fraction)
        case = CaseResult(name, fraction, budget, resident, plain_peak, memory_peak, split_peak=split_peak)
        case.routes["probe"] = probe
        case.routes["budget"] = run_worker("budget", name, quick, budget)
        capped = CAPPED_ROUTES + (SPLIT_ROUTES if split_lowest is not None else ())
        for route in capped:
            case.routes[route] = run_worker(route, name, quick, budget, cap=budget, allocator=allocator)
        progress(f"{name} {fraction}: budget {_mib(budget)} MiB, feasible {case.feasible}; "
                 + ", ".join(f"{route} {_verdict(case.routes[route])}" for route in capped)
                 + f"; budget plan {_mib(max(case.routes['budget'].get('peaks', [0])) or None)} MiB")
        results.append(case)
    return results


COLUMNS = ["model", "f", "budget MiB", "feasible", "plain (cap)", "memory (cap)", "memory MiB", "budget plan MiB",
           "predicted MiB", "plan/budget", "spread %", "compute (memory)", "fit (cap)", "keras (cap)",
           "alone (cap)", "fit peak/budget", "calibration / plain steps", "beyond plain first call / plain steps",
           "split MiB", "split alone (cap)",
           "split fit (cap)"]


def calibration_beyond_first_call(case: CaseResult) -> Optional[float]:
    """``fit_to_budget``'s calibration wall time less the first call of the
    plain step with nothing of memsaving in it (its trace and first run,
    which every ``tf.function`` pays before it runs at full speed, and which
    calibrating does too): what calibrating costs beyond training with no
    budget.  Both are the first ``tf.function`` call of a fresh process.
    Seconds; None unless calibration ran.  (Until the thirteenth session this
    subtracted the first call of ``budget=`` alone, which is missing wherever
    that route refuses.)"""
    calibration = case.routes.get("fit", {}).get("calibration_seconds")
    first = case.routes.get("probe", {}).get("plain_first_call_seconds")
    return None if calibration is None or first is None else calibration - first


def _probe_mark(outcome: dict) -> str:
    return " (probe)" if outcome.get("probed") else ""


def row(case: CaseResult) -> list:
    plan = case.routes["budget"]
    peaks = plan.get("peaks")
    probe = case.routes["probe"]
    fit = case.routes["fit"]
    spread = (max(peaks) - min(peaks)) / max(peaks) * 100 if peaks else None
    calibration = fit.get("calibration_seconds")
    plain_seconds = probe["plain"]["seconds"]
    return [case.model, case.fraction, _mib(case.budget), "yes" if case.feasible else "no",
            _verdict(case.routes["plain"]), _verdict(case.routes.get("memory_cap", {"crashed": "not run"})),
            _mib(case.memory_peak),
            _mib(max(peaks)) if peaks else ("refused" if plan.get("error") else "-"),
            _mib(plan.get("predicted")), f"{max(peaks) / case.budget:.3f}" if peaks else "-",
            f"{spread:.1f}" if spread is not None else "-",
            (f"{plan['compute']:.2f} ({probe['memory']['compute']:.2f})" if peaks else "-"),
            _verdict(fit) + _probe_mark(fit), _verdict(case.routes["keras"]) + _probe_mark(case.routes["keras"]),
            _verdict(case.routes["alone"]),
            f"{fit['peak'] / case.budget:.3f}" if not failed(fit) and fit.get("peak") else "-",
            f"{calibration / plain_seconds:.0f}" if calibration is not None else "-",
            f"{beyond / plain_seconds:.0f}" if (beyond := calibration_beyond_first_call(case)) is not None else "-",
            _mib(case.split_peak) if case.split_peak is not None else "-",
            _verdict(case.routes["split_alone"]) if "split_alone" in case.routes else "-",
            _verdict(case.routes["split_fit"]) if "split_fit" in case.routes else "-"]


def summary(cases: List[CaseResult]) -> List[str]:
    feasible = [c for c in cases if c.feasible]
    infeasible = [c for c in cases if not c.feasible]
    lines = [f"{len(cases)} cases, {len(feasible)} feasible (memory mode measures under the budget)."]

    def share(items, test) -> str:
        return f"{sum(1 for c in items if test(c))} of {len(items)}"

    lines.append("plain fails under the cap: " + share(cases, lambda c: failed(c.routes["plain"])))
    for route in ("fit", "keras", "alone"):
        lines.append(f"{route}: 20 steps under the cap in " + share(feasible, lambda c: not failed(c.routes[route]))
                     + " feasible cases; refused before any step in "
                     + share(infeasible, lambda c: refused_before_running(c.routes[route])) + " infeasible ones")
    met = [c for c in cases if "memory_cap" in c.routes and not failed(c.routes["memory_cap"])]
    lines.append("memory mode trains 20 steps under the cap in " + share(cases, lambda c: c in met)
                 + " cases; there:")
    for route in ("fit", "keras", "alone"):
        lines.append(f"  {route}: 20 steps under the cap in " + share(met, lambda c: not failed(c.routes[route])))
    lines.append("promise kept (20 steps under the cap, or a BudgetError before any step), every case:")
    for route in ("fit", "keras", "alone"):
        kept = share(cases, lambda c: not failed(c.routes[route]) or refused_before_running(c.routes[route]))
        broken = [f"{c.model} {c.fraction}" for c in cases
                  if failed(c.routes[route]) and not refused_before_running(c.routes[route])]
        lines.append(f"  {route}: {kept}" + (f"; broken: {', '.join(broken)}" if broken else ""))
    for route in ("fit", "keras"):
        probed = [c for c in cases if c.routes[route].get("probed")]
        if probed:
            lines.append(f"{route}: probed the lowest plan in {len(probed)} cases: "
                         + ", ".join(f"{c.model} {c.fraction} ({'trained' if not failed(c.routes[route]) else 'refused'})"
                                     for c in probed))
    fit_used = [c.routes["fit"]["peak"] / c.budget for c in cases
                if not failed(c.routes["fit"]) and c.routes["fit"].get("peak")]
    if fit_used:
        lines.append(f"fit_to_budget's steps under the cap peaked at {statistics.median(fit_used):.3f}x their budget "
                     f"(median; {min(fit_used):.3f}-{max(fit_used):.3f}x)")
    used = [max(c.routes["budget"]["peaks"]) / c.budget for c in feasible if c.routes["budget"].get("peaks")]
    if used:
        lines.append(f"budget= plans measured at {statistics.median(used):.3f}x their budget (median), "
                     f"{min(used):.3f}-{max(used):.3f}x")
    spreads = [(max(p) - min(p)) / max(p) * 100 for c in cases for p in [c.routes["budget"].get("peaks")] if p]
    if spreads:
        lines.append(f"run-to-run spread of budget plans: median {statistics.median(spreads):.2f}%, "
                     f"largest {max(spreads):.2f}%")
    split = [c for c in cases if "split_alone" in c.routes]
    if split:
        lines.append(f"split=\"auto\" budget plans ({', '.join(sorted({c.model for c in split}))}): "
                     f"{sum(1 for c in split if c.split_feasible)} of {len(split)} budgets met by a plan as measured")
        met_split = [c for c in split if c.split_feasible]
        unmet = [c for c in split if not c.split_feasible]
        for route in SPLIT_ROUTES:
            lines.append(f"  {route}: 20 steps under the cap in " + share(met_split, lambda c: not failed(c.routes[route]))
                         + " of those; refused before any step in "
                         + share(unmet, lambda c: refused_before_running(c.routes[route])) + " others")
    ratios = [c.routes["fit"]["calibration_seconds"] / c.routes["probe"]["plain"]["seconds"] for c in cases
              if c.routes["fit"].get("calibration_seconds")]
    if ratios:
        lines.append(f"fit_to_budget calibration: median {statistics.median(ratios):.0f} plain steps "
                     f"({min(ratios):.0f}-{max(ratios):.0f})")
    beyond = [b / c.routes["probe"]["plain"]["seconds"] for c in cases
              if (b := calibration_beyond_first_call(c)) is not None]
    if beyond:
        lines.append(f"  beyond the plain step's first call (trace, first run): median "
                     f"{statistics.median(beyond):.0f} plain steps ({min(beyond):.0f}-{max(beyond):.0f})")
    return lines


def first_calls_again(path: str, print_line=print) -> List[float]:
    """For a sweep's ``hard_limit.json`` written before the probe worker timed
    an unplanned plain first call: time it now, one probe per model, and
    print each calibration beyond it (:func:`calibration_beyond_first_call`)
    in the sweep's plain steps.  A mixed figure (the calibrations from the
    sweep, the first calls from this run); returns the figures."""
    with open(path, encoding="utf-8") as file:
        cases = [CaseResult(**case) for case in json.load(file)]
    firsts: Dict[str, float] = {}
    beyond = []
    for case in cases:
        if not case.routes.get("fit", {}).get("calibration_seconds"):
            continue
        if case.model not in firsts:
            firsts[case.model] = run_worker("probe", case.model, False)["plain_first_call_seconds"]
        probe = case.routes["probe"]
        probe["plain_first_call_seconds"] = firsts[case.model]
        beyond.append(calibration_beyond_first_call(case) / probe["plain"]["seconds"])
        print_line(f"{case.model} {case.fraction}: calibration {case.routes['fit']['calibration_seconds']:.1f} s, "
                   f"unplanned plain first call {firsts[case.model]:.1f} s, plain step {probe['plain']['seconds']:.3f} "
                   f"s: beyond {beyond[-1]:.0f} plain steps")
    if beyond:
        print_line(f"median {statistics.median(beyond):.0f} plain steps ({min(beyond):.0f}-{max(beyond):.0f})")
    return beyond


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: all)")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--quick", action="store_true", help="smaller models: a smoke run")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--allocator", choices=ALLOCATORS, default=ALLOCATORS[0],
                        help="how a capped worker's allocator holds its pool: one region as on a GPU (default), "
                             "or growing region by region as the CPU's does")
    parser.add_argument("--onednn", choices=("on", "off"), default=None,
                        help="off: TF_ENABLE_ONEDNN_OPTS=0 in every worker, so that a capped allocator's failure "
                             "raises ResourceExhaustedError as a GPU's does (default: TensorFlow's, on)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--first-calls-again", metavar="JSON", default=None,
                        help="a sweep's hard_limit.json from before the unplanned first call was timed: "
                             "time it now and print the calibrations beyond it")
    args = parser.parse_args(argv)
    if args.first_calls_again:
        first_calls_again(args.first_calls_again)
        return
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker, args.models, args.quick, args.budget or None)), flush=True)
        return
    from experiments.hard_limit_models import FAMILIES  # pylint: disable=import-outside-toplevel

    names = args.models.split(",") if args.models else list(FAMILIES)
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(FAMILIES)}")
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.onednn is not None:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if args.onednn == "on" else "0"  # workers inherit it
    start = time.perf_counter()
    cases: List[CaseResult] = []

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.0f} s] {message}", flush=True)

    for name in names:
        cases.extend(sweep_model(name, args.quick, fractions, progress, args.allocator))
    write(cases, args.out, args.allocator)


def write(cases: List[CaseResult], out: str, allocator: str = ALLOCATORS[0]) -> None:
    from experiments.report import Table  # pylint: disable=import-outside-toplevel

    table = Table(NAME, "Budgets under a hard memory limit (TF_CPU_BFC_MEM_LIMIT_IN_MB = budget)", COLUMNS)
    for case in cases:
        table.add(*row(case))
    # unset, TensorFlow decides by the CPU: oneDNN where it has AVX-512, its own Eigen kernels otherwise
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    table.notes.append(f"capped workers' allocator: {allocator} (--allocator); TF_ENABLE_ONEDNN_OPTS "
                       f"{'unset (TensorFlow chooses by the CPU)' if onednn is None else '= ' + onednn} (--onednn)")
    table.notes.extend(summary(cases))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{NAME}.md"), "w", encoding="utf-8") as file:
        file.write(table.markdown())
    with open(os.path.join(out, f"{NAME}.json"), "w", encoding="utf-8") as file:
        json.dump([case.__dict__ for case in cases], file, indent=1, default=str)
    print(table.markdown())


if __name__ == "__main__":
    main()
