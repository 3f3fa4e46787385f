"""What planning costs on large graphs, next to the plain trace it is added to.

For each model, a whole training step (forward, gradients, a scalar of the
gradients) is traced in a ``tf.function``, and CPU seconds (this process,
all threads) are measured side by side in one run:

* ``plain``: the step traced with ``tf.gradients``;
* ``plan(memory)``: ``memsaving.plan(loss, weights, checkpoints="memory")``
  called inside a trace of the forward pass (the call alone is timed);
* ``plan(budget)``: ``memsaving.plan(..., budget=B)`` with ``B`` halfway
  between the memory-mode prediction and the plain one;
* ``BudgetError``: ``plan(..., budget=1)``, which nothing fits: the time
  until the error, which reports the smallest budget found feasible;
* ``near miss``: ``plan(..., budget=)`` 4 MiB under that smallest budget:
  the time until the same error when the budget is not obviously too small
  (the searches for a plan run before the floor is searched).  Budgets are
  set this far from the figures of an earlier trace because the memory in
  use before the step, part of every prediction, moves between traces;
* ``memsaving``: the step traced with ``memsaving.gradients(...,
  checkpoints="memory")``;
* ``retrace``: the same step traced again in a new ``tf.function`` (a new
  ``model.fit`` after ``compile``), which reuses the plan made for the same
  graph and arguments (:mod:`memsaving.planners.cache`).

Every figure but ``retrace`` is measured with no plan remembered
(``memsaving.clear_plan_cache()`` first).

Kernel-temporary profiles are measured once per op signature and cached
(``MEMSAVING_CACHE_DIR``, a fresh folder per run here): a first untimed
``plan(memory)`` fills the cache, and its extra time is printed as
``profiling``.  Ratios are to the plain trace.  Targets (issue 17):
plan(memory) <= 0.3x, plan(budget) and the BudgetError (both columns)
<= 0.5x, the memsaving trace <= 1.5x.

``--repeat N`` measures every column N times per model, in rounds (each
round measures each column once), and prints the medians and each round's
ratios: single figures move by up to a third between measurements on this
machine (a slow spell, a collection of the growing heap), so the targets
are judged on medians.

Each model is measured in a Python process of its own (``--in-process``
measures them all in this one): a user traces one model per process, and
a model measured after four large ones in one process planned 20-60%
slower than the same model measured first (README, "Planning time on
large graphs").  A model's columns are still measured side by side, in
its process.

``--plan-command`` also saves a keras.applications ResNet50V2 (weights=None,
64x64) and times ``memsaving plan`` on it end to end in a new process
(start-up, loading, profiling into an empty cache, tracing, planning;
target: under 30 s).

    python -m experiments.bench_scale [--models resnet152 densenet201 ...] [--batch 2] [--size 64] [--repeat 3]
        [--plan-command] [--in-process]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MEMSAVING_CACHE_DIR", tempfile.mkdtemp(prefix="memsaving-bench-scale-"))

import memsaving  # noqa: E402  (sets up the allocator before TensorFlow)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from memsaving.tools import models  # noqa: E402

MODELS = {
    "resnet152": lambda size: keras.applications.ResNet152(weights=None, input_shape=(size, size, 3), classes=10),
    "densenet201": lambda size: keras.applications.DenseNet201(weights=None, input_shape=(size, size, 3), classes=10),
    "transformer48": lambda size: models.transformer(size=size, layers=48),
    "mlp1600": lambda size: models.mlp(size=size, depth=1600),
    "resnet50": lambda size: keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10),
}


def input_spec(model: keras.Model, batch: int) -> tf.TensorSpec:
    shape = [batch] + list(model.inputs[0].shape[1:])
    return tf.TensorSpec(shape, model.inputs[0].dtype)


def cpu_seconds(fn) -> tuple:
    """``fn()``'s result and the CPU seconds it took (``time.process_time``)."""
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def trace_step(model: keras.Model, spec: tf.TensorSpec, gradients) -> float:
    """CPU seconds to trace a training step whose gradients come from ``gradients(loss, weights)``."""

    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = gradients(loss, model.trainable_variables)
        return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])

    return cpu_seconds(lambda: tf.function(step).get_concrete_function(spec))[1]


def timed_plan(model: keras.Model, spec: tf.TensorSpec, **plan_kwargs) -> tuple:
    """The plan (or the BudgetError) and the CPU seconds ``memsaving.plan`` took inside a trace."""
    found = {}
    memsaving.clear_plan_cache()

    def forward(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        start = time.process_time()
        try:
            found["result"] = memsaving.plan(loss, model.trainable_variables, **plan_kwargs)
        except memsaving.BudgetError as error:
            found["result"] = error
        found["seconds"] = time.process_time() - start
        return loss

    tf.function(forward).get_concrete_function(spec)
    return found["result"], found["seconds"]


def count_forward_ops(model: keras.Model, spec: tf.TensorSpec) -> int:
    graph = tf.function(lambda x: model(x, training=True)).get_concrete_function(spec).graph
    return len(graph.get_operations())


def measure(name: str, batch: int, size: int, repeat: int = 1) -> dict:
    """Every column for one model: the median of ``repeat`` rounds, each
    round measuring every column once (so a slow spell of the machine
    touches one sample of several columns, not every sample of one)."""
    model = MODELS[name](size)
    spec = input_spec(model, batch)
    figures = {"model": name, "ops": count_forward_ops(model, spec),
               "budget_fits": True, "error_raised": True, "near_miss_raised": True}
    _, cold = timed_plan(model, spec, checkpoints="memory")
    samples = {}
    for _ in range(repeat):
        for column, seconds in measure_round(name, model, spec, figures).items():
            samples.setdefault(column, []).append(seconds)
    for column, values in samples.items():
        figures[column] = statistics.median(values)
        figures[f"{column} samples"] = values
    figures["profiling"] = max(0.0, cold - figures["plan(memory)"])
    return figures


def measure_round(name: str, model: keras.Model, spec: tf.TensorSpec, figures: dict) -> dict:
    """CPU seconds of every column, measured once; ``figures``' flags are
    cleared when a plan that should be found is not, or an error that should
    be raised is not."""
    seconds = {"plain": trace_step(model, spec, tf.gradients)}
    memory_plan, seconds["plan(memory)"] = timed_plan(model, spec, checkpoints="memory")
    budget = int(memory_plan.predicted_peak + 0.5 * (memory_plan.plain_peak - memory_plan.predicted_peak))
    budget_plan, seconds["plan(budget)"] = timed_plan(model, spec, checkpoints="memory", budget=budget)
    if isinstance(budget_plan, Exception):
        figures["budget_fits"] = False
        print(f"  {name}: plan(budget={budget}) raised {type(budget_plan).__name__}: {budget_plan}", flush=True)
    error, seconds["BudgetError"] = timed_plan(model, spec, checkpoints="memory", budget=1)
    raised = isinstance(error, memsaving.BudgetError)
    figures["error_raised"] &= raised
    floor = error.smallest_budget if raised else None
    near = max(1, floor - NEAR_MISS_BYTES) if floor else 1
    miss, seconds["near miss"] = timed_plan(model, spec, checkpoints="memory", budget=near)
    figures["near_miss_raised"] &= isinstance(miss, memsaving.BudgetError)
    memsaving.clear_plan_cache()
    ours = lambda loss, xs: memsaving.gradients(loss, xs, checkpoints="memory")  # noqa: E731
    seconds["memsaving"] = trace_step(model, spec, ours)
    seconds["retrace"] = trace_step(model, spec, ours)
    return seconds


NEAR_MISS_BYTES = 4 << 20
"""How far under the reported smallest budget the near miss asks."""

COLUMNS = [("plan(memory)", 0.3), ("plan(budget)", 0.5), ("BudgetError", 0.5), ("near miss", 0.5),
           ("memsaving", 1.5)]


def report(rows) -> None:
    head = f"{'model':<14}{'ops':>7}{'plain s':>9}" + "".join(f"{c + ' s':>16}{'x':>7}" for c, _ in COLUMNS)
    print(head + f"{'retrace s':>11}{'x':>6}{'profiling s':>13}")
    for r in rows:
        line = f"{r['model']:<14}{r['ops']:>7}{r['plain']:>9.1f}"
        for column, target in COLUMNS:
            ratio = r[column] / r["plain"]
            line += f"{r[column]:>16.1f}{ratio:>6.2f}{'' if ratio <= target else '!'}"
        line += f"{r['retrace']:>11.1f}{r['retrace'] / r['plain']:>6.2f}"
        print(line + f"{r['profiling']:>13.1f}")
        if len(r["plain samples"]) > 1:
            print("  ratios of each round: " + "; ".join(
                f"{column} " + " ".join(f"{value / plain:.2f}" for value, plain in zip(r[f"{column} samples"],
                                                                                     r["plain samples"]))
                for column, _ in COLUMNS))
        if not (r["budget_fits"] and r["error_raised"] and r["near_miss_raised"]):
            print(f"  (budget plan found: {r['budget_fits']}; BudgetError raised: {r['error_raised']}; "
                  f"near miss raised it: {r['near_miss_raised']})")
    print("targets: " + ", ".join(f"{c} <= {t}x plain" for c, t in COLUMNS) + "; '!' marks a miss")


def measure_in_new_process(name: str, args: argparse.Namespace) -> dict:
    """:func:`measure` of one model in a new Python process (this module
    run with that model alone), its figures read back from a JSON file."""
    out = pathlib.Path(tempfile.mkdtemp(prefix="memsaving-bench-scale-")) / "figures.json"
    subprocess.run([sys.executable, "-m", "experiments.bench_scale", "--models", name, "--batch", str(args.batch),
                    "--size", str(args.size), "--repeat", str(args.repeat), "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())[0]


def time_plan_command(batch: int = 8, size: int = 64) -> tuple:
    """Wall and CPU seconds of ``memsaving plan`` on a saved ResNet50V2, run
    in a new process with an empty kernel-profile cache."""
    folder = tempfile.mkdtemp(prefix="memsaving-bench-plan-")
    path = os.path.join(folder, "resnet50v2.keras")
    keras.applications.ResNet50V2(weights=None, input_shape=(size, size, 3), classes=10).save(path)
    env = dict(os.environ, MEMSAVING_CACHE_DIR=os.path.join(folder, "profiles"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "memsaving", "plan", path, "--batch", str(batch)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds per model; each column is the median of its rounds (default 1)")
    parser.add_argument("--plan-command", action="store_true",
                        help="also time `memsaving plan` on a saved ResNet50V2 (batch 8, 64x64) end to end")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every model in this process (default: each in a new process)")
    parser.add_argument("--json", type=pathlib.Path, help=argparse.SUPPRESS)  # a child's figures, for its parent
    args = parser.parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))  # Keras walks a 1,600-layer model recursively
    rows = []
    for name in args.models:
        if args.in_process or len(args.models) == 1:
            rows.append(measure(name, args.batch, args.size, args.repeat))
            keras.backend.clear_session()
        else:
            rows.append(measure_in_new_process(name, args))
        print(f"measured {name}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows))
    report(rows)
    if args.plan_command:
        wall, cpu = time_plan_command()
        print(f"memsaving plan resnet50v2.keras --batch 8 (new process, empty profile cache): {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU (target: under 30 s){'' if wall < 30 else ' !'}")


if __name__ == "__main__":
    main()
