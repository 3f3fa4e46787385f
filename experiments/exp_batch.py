"""The largest batch that fits a fixed memory budget (the TFLMS / Checkmate table).

For each built-in model (``memsaving.tools.models``) the budget is 1.1x the
measured peak of one plain training step at a base batch (the gradients reduced to a
scalar in the step; memory in use before the step is not counted).  Then,
for each method, the batch is doubled while the measured peak fits and
bisected between the last fit and the first miss:

* ``plain``: ``tf.gradients``; its peak moves from one trace to the next
  (the executor's order of ready ops differs between traces of the same
  step), so a batch fits plain when the lowest of :data:`PLAIN_TRACES`
  traces fits: generous to the baseline, so the gain column is a lower bound;
* ``memory``: ``memsaving.gradients(checkpoints="memory")`` (sqrt(n)-style);
* ``budget``: ``memsaving.gradients(budget=...)`` planned for 80% of the
  budget (:data:`HEADROOM`);
* ``hybrid (predicted)``: the plan of ``swap="auto"`` under the budget,
  judged by its *predicted* peak only: this machine has no GPU, so moving
  tensors to host memory cannot be measured here.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import keras
import tensorflow as tf

import memsaving
from experiments.report import Table, plot_bars, progress
from memsaving.tools.models import build

METHODS = ("plain", "memory", "budget", "hybrid (predicted)")
HEADROOM = 0.8
"""The budget method plans for this fraction of the budget: the simulator
predicts Keras conv nets' peaks 10-25% low (kernel temporaries it does not
see), so a plan for the whole budget would measure above it."""
SLACK = 1.10
"""The budget is this multiple of the plain peak measured at the base batch
(the highest of :data:`PLAIN_TRACES` traces)."""
PLAIN_TRACES = 3
"""Traces of the plain step measured per batch (see the module docstring)."""


def _inputs(model: keras.Model, batch: int):
    shape = [batch] + list(model.inputs[0].shape[1:])
    if model.inputs[0].dtype in ("int32", "int64", tf.int32, tf.int64):
        return tf.random.uniform(shape, 0, 1000, dtype=tf.int32, seed=1)
    return tf.random.normal(shape, seed=1)


def _step(model: keras.Model, method: str, budget: int, captured: dict) -> Callable:
    ws = model.trainable_variables

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
        if method == "plain":
            grads = tf.gradients(loss, ws)
        else:
            plain = memsaving.plan(loss, ws, checkpoints=[])
            total = plain.resident_bytes + budget
            if method == "memory":
                grads = memsaving.gradients(loss, ws, checkpoints="memory")
            elif method == "budget":
                grads = memsaving.gradients(loss, ws, budget=plain.resident_bytes + int(HEADROOM * budget))
            else:
                captured["plan"] = memsaving.plan(loss, ws, budget=total, swap="auto")
                return tf.constant(0.0)
        return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])

    return step


def fits(model: keras.Model, method: str, batch: int, budget: int) -> bool:
    """Whether one step at ``batch`` fits ``budget`` (measured; predicted for the hybrid)."""
    if method == "plain":
        return min(plain_peak(model, batch) for _ in range(PLAIN_TRACES)) <= budget
    captured: dict = {}
    step = _step(model, method, budget, captured)
    x = _inputs(model, batch)
    try:
        step(x)
    except memsaving.BudgetError:
        return False
    if method.startswith("hybrid"):
        plan = captured["plan"]
        return plan.predicted_peak - plan.resident_bytes <= budget
    return memsaving.measure_peak_increase(step, x) <= budget


def largest_batch(model: keras.Model, method: str, budget: int, start: int, cap: int,
                  bisect_steps: int, name: str) -> Optional[int]:
    """Doubling from ``start`` up to ``cap``, then ``bisect_steps`` bisections."""
    if not fits(model, method, start, budget):
        progress("largest_batch", f"{name} {method}: batch {start} does not fit")
        return None
    good, bad = start, None
    while good * 2 <= cap:
        if fits(model, method, good * 2, budget):
            good *= 2
            progress("largest_batch", f"{name} {method}: batch {good} fits")
        else:
            bad = good * 2
            progress("largest_batch", f"{name} {method}: batch {bad} does not fit")
            break
    for _ in range(bisect_steps):
        if bad is None or bad - good <= 1:
            break
        middle = (good + bad) // 2
        if fits(model, method, middle, budget):
            good = middle
        else:
            bad = middle
    return good


def run(out_dir: str, models: List[str], size: int, base_batch: int, cap: int, bisect_steps: int,
        methods=METHODS) -> Dict[str, Dict[str, Optional[int]]]:
    table = Table("largest_batch", f"Largest batch under a fixed memory budget (inputs {size}, budget = "
                  f"{SLACK}x the highest plain peak of {PLAIN_TRACES} traces at batch {base_batch})",
                  ["model", "budget MiB"] + [f"{m} batch" for m in methods] + ["best memsaving / plain"])
    results: Dict[str, Dict[str, Optional[int]]] = {}
    for name in models:
        keras.utils.set_random_seed(0)
        model = build(name, size)
        budget = int(SLACK * max(plain_peak(model, base_batch) for _ in range(PLAIN_TRACES)))
        progress("largest_batch", f"{name}: budget {budget / 2**20:.1f} MiB (plain peak at batch {base_batch})")
        found = {m: largest_batch(model, m, budget, base_batch, cap, bisect_steps, name) for m in methods}
        results[name] = found
        measured = [found[m] for m in ("memory", "budget") if found.get(m)]
        gain = max(measured) / found["plain"] if measured and found.get("plain") else None
        table.add(name, round(budget / 2**20, 1), *[found[m] for m in methods], round(gain, 2) if gain else None)
    table.notes.append(f"Batches searched by doubling from {base_batch} up to {cap}, then {bisect_steps} "
                       "bisection step(s); a batch at the cap may not be the largest. The hybrid column is "
                       "predicted (no GPU here), the others measured.")
    files = table.write(out_dir)
    files.append(plot_bars(f"{out_dir}/largest_batch.png", "Largest batch under a fixed budget", "batch",
                           models, {m: [results[n][m] for n in models] for m in methods}))
    return {"results": results, "files": files}


def plain_peak(model: keras.Model, batch: int) -> int:
    """The measured peak increase of one new trace of the plain step at ``batch``."""
    step, x = _step(model, "plain", 0, {}), _inputs(model, batch)
    step(x)
    return memsaving.measure_peak_increase(step, x)
