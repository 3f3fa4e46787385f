"""Does a fixed execution order make a step's peak the same every run?

With TensorFlow's default thread pools the same plan's peak moves from run
to run (up to 14% on the hard-limit benchmark's models), which a budget
must leave room for.  This benchmark measures the run-to-run spread of one
memory-mode training step (``checkpoints="memory"``, Adam) under three
settings, each in processes of its own:

* ``default``: TensorFlow's executor and thread pools;
* ``barrier``: TensorFlow's executor, and the weight gradients handed to
  the optimizer only once all are made (as under ``single+barrier`` below);
* ``single``: the step's function run by TensorFlow's single-threaded
  executor (``tf.experimental.function_executor_type("SINGLE_THREADED_EXECUTOR")``,
  read when the function is called): its ops run one at a time, in one
  topological order, each kernel still using the intra-op pool;
* ``single+barrier``: the same, and the weight gradients handed to the
  optimizer only once all are made (each through an Identity that waits
  for every gradient), so that no update runs inside the backward pass.

Per setting and model it prints the peak's spread ((highest - lowest) /
lowest) within each process over ``--runs`` runs, the peaks' range over
all processes, and the median step time.  A spread left under
``single+barrier``, where every run executes the same ops in the same order,
comes from the allocator's layout, which changes from step to step when
buffers outlive a step: Keras' BatchNormalization assigns its moving
statistics by adopting the freshly computed tensors' buffers, so every step
leaves small chunks at new addresses.  ``--diverge`` shows it: in one process
under ``single+barrier``, the profiler records every allocation of ``--runs``
steps, and each step's events are compared with the first step's: whether
the same requests come in the same order, and the first request of 64 KiB or
more handed a chunk of another size::

    python -m experiments.fixed_order_spread                       # about 10 minutes
    python -m experiments.fixed_order_spread --models resconv --processes 5
    python -m experiments.fixed_order_spread --models resconv --diverge --runs 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

SETTINGS = ("default", "barrier", "single", "single+barrier")
DEFAULT_MODELS = ("mlp", "resconv", "attention", "depthwise", "text", "grouped", "gru")
MIB = 2 ** 20


def training_step(name: str, setting: str):
    """The memory-mode training step of model ``name`` under ``setting``
    (with ``single+barrier``, the gradients wait for each other), its
    arguments, and the executor context its calls run in."""
    import contextlib

    import memsaving  # noqa: F401  (before TensorFlow: the allocator's statistics)
    import keras
    import tensorflow as tf

    from experiments.hard_limit_models import build

    case = build(name)
    model, variables = case.model, case.model.trainable_variables
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(variables)

    @tf.function
    def step(inputs, targets):
        predictions = model(inputs, training=True)
        loss = tf.reduce_mean(tf.square(tf.cast(predictions, tf.float32) - tf.cast(targets, tf.float32)))
        grads = memsaving.gradients(loss, variables, checkpoints="memory", batch_size=case.batch)
        if setting.endswith("barrier"):
            with tf.control_dependencies(grads):
                grads = [tf.identity(g) for g in grads]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    executor = (tf.experimental.function_executor_type("SINGLE_THREADED_EXECUTOR") if setting.startswith("single")
                else contextlib.nullcontext())
    return step, (case.inputs, case.targets), executor


def _worker(name: str, setting: str, runs: int) -> dict:
    import memsaving

    step, args, executor = training_step(name, setting)
    with executor:
        step(*args)
        peaks = [memsaving.measure_peak(step, *args) for _ in range(runs)]
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            step(*args).numpy()
            times.append(time.perf_counter() - start)
    return {"peaks": peaks, "seconds": statistics.median(times)}


def _traced_steps(step, args, runs: int) -> List[list]:
    """Each of ``runs`` calls of ``step`` as the allocator's events, read from the profiler."""
    import glob
    import tempfile

    import tensorflow as tf

    from experiments.allocator_trace import MARK, read_profile

    logdir = tempfile.mkdtemp(prefix="memsaving_fixed_order_")
    tf.profiler.experimental.start(logdir)
    try:
        for k in range(runs):
            with tf.profiler.experimental.Trace(f"{MARK}step{k}"):
                step(*args).numpy()
    finally:
        tf.profiler.experimental.stop()
    events, marks = read_profile(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    return [[e for e in events if marks[f"step{k}"][0] <= e.time_ps <= marks[f"step{k}"][1]] for k in range(runs)]


def first_difference(base: list, other: list, large: int = 64 * 1024) -> str:
    """Where ``other``'s allocator events first differ from ``base``'s: another
    request (order), or a request of at least ``large`` bytes given another chunk."""
    for i, (a, b) in enumerate(zip(base, other)):
        if (a.allocates, a.requested, a.op) != (b.allocates, b.requested, b.op):
            return f"order differs at event {i}: {a.op} {a.requested} B against {b.op} {b.requested} B"
        if a.chunk != b.chunk and max(a.chunk, b.chunk) >= large:
            return f"same order; event {i} ({a.op}, {a.requested} B) got a {b.chunk} B chunk, not {a.chunk} B"
    return "same order, same chunks" if len(base) == len(other) else "one step has more events"


def diverge(name: str, runs: int) -> None:
    """``--diverge``: the steps of one process under ``single+barrier``, event by event."""
    import memsaving

    step, args, executor = training_step(name, "single+barrier")
    with executor:
        for _ in range(3):
            step(*args).numpy()
        peaks = [memsaving.measure_peak(step, *args) for _ in range(runs)]
        steps = _traced_steps(step, args, runs)
    print(f"{name}, single+barrier, peaks MiB: {', '.join(f'{p / MIB:.2f}' for p in peaks)}")
    for k in range(1, runs):
        print(f"  step {k} against step 0: {first_difference(steps[0], steps[k])}")


def run_worker(name: str, setting: str, runs: int, timeout: int = 900) -> dict:
    """One process: ``name`` under ``setting``, ``runs`` measured runs."""
    command = [sys.executable, "-m", "experiments.fixed_order_spread", "--worker", setting, "--models", name,
               "--runs", str(runs)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": (done.stderr or "").strip().splitlines()[-1:]}
    return json.loads(lines[-1][len("RESULT "):])


def spread(peaks: List[int]) -> float:
    """(highest - lowest) / lowest, in percent.

    Examples
    --------
    >>> spread([100, 104, 102])
    4.0
    """
    return 100.0 * (max(peaks) - min(peaks)) / min(peaks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--diverge", action="store_true",
                        help="where the allocator's events of one process's steps first differ (single+barrier)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.diverge:
        for name in args.models.split(","):
            diverge(name, args.runs)
        return
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.models, args.worker, args.runs)))
        return
    print("| model | setting | spread % per process | peaks MiB, all processes | step ms (median) |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        for setting in args.settings.split(","):
            results: List[Dict] = [run_worker(name, setting, args.runs) for _ in range(args.processes)]
            good = [r for r in results if "peaks" in r]
            if not good:
                print(f"| {name} | {setting} | error: {results[0].get('error')} | | |")
                continue
            spreads = ", ".join(f"{spread(r['peaks']):.2f}" for r in good)
            every = [p for r in good for p in r["peaks"]]
            seconds = statistics.median(r["seconds"] for r in good)
            print(f"| {name} | {setting} | {spreads} | {min(every) / MIB:.2f}-{max(every) / MIB:.2f} "
                  f"({spread(every):.1f}%) | {1000 * seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
