"""How far a budget plan's measured peak moves from run to run with
TensorFlow's default thread pools, pinned (``follow_order=True``) and not,
and what pinning costs in step time.

Each model of :mod:`experiments.hard_limit_models` gets a budget of its
resident memory plus half of its plain step's own memory, both as
predicted (so that every process plans for the same budget), or 2% above
the smallest budget a plan fits when that is more.  The step is the mean squared
error against zeros, ``memsaving.gradients(loss, weights, budget=B)`` and
the gradients summed to a scalar.  Every model runs in a process of its own
(``--processes`` of them), with TensorFlow's default threads.  Per process:
one warm-up run, then ``--runs`` measured peaks (the allocator's whole peak
during the run) of the setting measured; then the other setting's step is
traced too, and the step times of both are taken in alternating rounds.

    python -m experiments.pinned_order --models mlp,densenet --processes 3
    python -m experiments.pinned_order --worker densenet 1     # one process, prints JSON

Results: one line per model and setting (predicted, measured range,
spread = (max - min) / min over every run of every process) and the step
times (median of the alternating rounds, both settings in one process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

MIB = 2 ** 20
GRAPPLER_FAILURES = ("optimizer failed", "topological sort failed", "couldn't be sorted in topological order",
                     "function optimization failure")
"""What TensorFlow logs when a Grappler pass fails on the step's graph (as tests/helpers.py reads it)."""
MODELS = ("mlp", "resconv", "densenet", "depthwise", "attention", "two_tower", "unet", "lstm", "gpt2")
RUNS = 10
ROUNDS = 7
"""Alternating timing rounds; each times ``TIMED_CALLS`` calls of each step."""
TIMED_CALLS = 3


def worker(name: str, pinned: bool, runs: int = RUNS, rounds: int = ROUNDS, quick: bool = False) -> dict:
    """One model in this process: the budget plan's prediction and measured
    peaks with ``follow_order=pinned``, and the step times of both settings."""
    import memsaving  # noqa: F401  (before TensorFlow: the allocator's statistics)
    import tensorflow as tf

    from experiments.hard_limit_models import build

    case = build(name, quick)
    if case is None:
        return {"skipped": "keras_hub is not installed"}
    model, weights = case.model, case.model.trainable_variables
    captured: Dict[str, object] = {}

    def step_for(budget, follow_order):
        @tf.function
        def step(inputs, targets):
            predictions = model(inputs, training=True)
            loss = tf.reduce_mean(tf.square(tf.cast(predictions, tf.float32) - tf.cast(targets, tf.float32)))
            if budget is None:
                grads = tf.gradients(loss, weights)
            else:
                grads, captured[follow_order] = memsaving.gradients_and_plan(
                    loss, weights, budget=budget, batch_size=case.batch, follow_order=follow_order)
            return tf.add_n([tf.reduce_sum(tf.cast(tf.convert_to_tensor(g), tf.float32)) for g in grads])
        return step

    args = (case.inputs, case.targets)
    budget = _budget(model, weights, case, args)
    steps = {pinned: step_for(budget, pinned)}
    steps[pinned](*args).numpy()  # trace, plan, warm up
    plan = captured[pinned]
    peaks = [memsaving.measure_peak(steps[pinned], *args) for _ in range(runs)]
    # the other setting is traced only now, so that it leaves nothing in the allocator the peaks above see
    steps[not pinned] = step_for(budget, not pinned)
    steps[not pinned](*args).numpy()
    times: Dict[bool, List[float]] = {True: [], False: []}
    for _ in range(rounds):
        for setting, step in steps.items():
            start = time.perf_counter()
            for _ in range(TIMED_CALLS):
                step(*args).numpy()
            times[setting].append((time.perf_counter() - start) / TIMED_CALLS)
    return {"model": name, "pinned": pinned, "budget": budget,
            "predicted": plan.predicted_peak, "planned_resident": plan.resident_bytes, "peaks": peaks,
            "seconds_pinned": statistics.median(times[True]), "seconds_unpinned": statistics.median(times[False])}


def _budget(model, weights, case, args) -> int:
    """Resident bytes plus half of the plain step's predicted memory above
    them (predicted, so that every process plans for the same budget), or
    2% above the smallest budget a plan fits when that is more."""
    import memsaving
    import tensorflow as tf

    plans = []

    @tf.function
    def plain(inputs, targets):
        predictions = model(inputs, training=True)
        loss = tf.reduce_mean(tf.square(tf.cast(predictions, tf.float32) - tf.cast(targets, tf.float32)))
        plans.append(memsaving.plan(loss, weights, checkpoints=[], batch_size=case.batch))
        try:
            memsaving.plan(loss, weights, budget=1, batch_size=case.batch)
        except memsaving.BudgetError as error:
            plans.append(error.smallest_budget)
        return loss

    plain.get_concrete_function(*args)
    plan, smallest = plans
    return max(int(plan.resident_bytes + 0.5 * (plan.plain_peak - plan.resident_bytes)), int(1.02 * smallest))


def _in_a_process(name: str, pinned: bool, runs: int, quick: bool) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MEMSAVING_CACHE_DIR=tempfile.mkdtemp(prefix="memsaving-order-"))
    command = [sys.executable, "-m", "experiments.pinned_order", "--worker", name, str(int(pinned)),
               "--runs", str(runs)] + (["--quick"] if quick else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"model": name, "pinned": pinned, "error": done.stderr[-2000:]}
    result = json.loads(lines[-1][len("RESULT "):])
    result["grappler_failures"] = [line[-200:] for line in done.stderr.splitlines()
                                   if any(key in line for key in GRAPPLER_FAILURES)]
    return result


def spread(peaks: List[int]) -> float:
    """How far ``peaks`` move: (max - min) / min."""
    return (max(peaks) - min(peaks)) / min(peaks)


def summary(results: List[dict]) -> str:
    """One line per model and setting."""
    lines = []
    for result in results:
        if "peaks" not in result:
            lines.append(f"{result.get('model')}: {result.get('skipped') or result.get('error', '')[-300:]}")
            continue
        peaks = result["peaks"]
        within = max(spread(p) for p in result.get("process_peaks", [peaks]))
        lines.append(f"{result['model']:10s} pinned={result['pinned']!s:5s} predicted {result['predicted'] / MIB:7.2f} "
                     f"measured {min(peaks) / MIB:7.2f}-{max(peaks) / MIB:7.2f} MiB "
                     f"spread {100 * spread(peaks):5.2f}% (in one process up to {100 * within:5.2f}%) "
                     f"step {1e3 * result['seconds_pinned']:.1f} ms pinned, {1e3 * result['seconds_unpinned']:.1f} "
                     "unpinned" + (f"; GRAPPLER FAILURES: {result['grappler_failures'][:2]}"
                                   if result.get("grappler_failures") else ""))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--settings", default="1,0", help="follow_order settings to measure: 1 pinned, 0 not")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "PINNED"))
    parser.add_argument("--out", help="JSON file for every process's figures")
    args = parser.parse_args(argv)
    if args.worker:
        name, pinned = args.worker
        print("RESULT", json.dumps(worker(name, bool(int(pinned)), args.runs, quick=args.quick)), flush=True)
        return
    results = []
    for name in args.models.split(","):
        for setting in (bool(int(s)) for s in args.settings.split(",")):
            done = [_in_a_process(name, setting, args.runs, args.quick) for _ in range(args.processes)]
            merged = dict(done[0])
            if all("peaks" in d for d in done):
                merged["peaks"] = [p for d in done for p in d["peaks"]]
                merged["process_peaks"] = [d["peaks"] for d in done]
            results.append(merged)
            print(summary([merged]), flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
