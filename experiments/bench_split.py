"""Splitting against the best plans without it: measured peaks, side by side.

For each model, one training step (forward, gradients, the gradients
reduced to a scalar in the step, as in the other benchmarks) is traced and
run with:

* ``plain``: ``tf.gradients``;
* ``memory``: ``memsaving.gradients(checkpoints="memory")``, the plan of
  lowest predicted peak the sqrt(n)-style search finds;
* ``floor``: ``budget=`` the smallest budget the planner finds feasible
  without splitting (its BudgetError for ``budget=1`` names it), plus 2%
  and 2 MiB for the memory in use, which moves between traces: the lowest
  unsplit plan, multi-level plans included;
* ``split (lowest)``: ``split="auto"`` without a budget: the split of
  lowest predicted peak;
* ``split, budget``: ``split="auto"`` with a budget, which the plan meets
  as predicted: for the GPTs, 0.97 of a third of the lower of the two
  unsplit peaks *measured* (the issue's 3x below, with 3% for the measured
  peak to exceed the prediction); for the U-Net, one that leaves the step,
  above the memory it starts with (weights, inputs), 0.8 of what that
  unsplit peak adds.  The planner splits what stops that budget from
  fitting, in as few pieces as fit;
* ``split, fit_to_budget``: the same step made by
  :func:`memsaving.fit_to_budget`, which measures its peak and plans again
  until the *measured* peak fits: for the GPTs, a third of the lowest
  unsplit peak; for the U-Net, the budget above.

Every row prints the predicted peak next to the measured one (the CPU's
BFC allocator, weights and inputs included), the step time (median of
``--repeat`` runs) and the largest relative difference of the gradients
from ``tf.gradients``' (:func:`max_relative_difference`).  The ratio column is the lowest unsplit measured
peak over the row's.

Models: ``gpt``, a GPT-style causal language model
(:func:`memsaving.tools.models.gpt`: 4 blocks of width 256, 4 heads,
vocabulary 32,000, 256 tokens, batch 8; its logits are 262 MB), trained on
next-token cross-entropy; ``unet``, :func:`memsaving.tools.models.unet` at
256x256, batch 8, on a mean-squared loss; ``gpt2`` (not run by default;
needs keras_hub, the ``bench`` extra), keras_hub's GPT2 backbone of the
same shape, its output layer the token embedding (tied weights).

    python -m experiments.bench_split [--models gpt unet gpt2] [--repeat 3] [--quick] [--timeline UNITS]

``--timeline UNITS`` also prints where the lowest split's memory goes: the
backward units with the largest measured peaks.  Every row also prints
what the step's function holds from its first run on (``held``: bytes in
use after the first run less before it, outputs aside), which the
prediction, made from the memory in use when planning, does not see, and
how much of it was allocated while the step was traced, before it ran
(``traced``).

Each row is measured in a Python process of its own, as a user would run
the step: in one process, a row would count what the rows before it left in
use (their functions, the allocator's state) in its peak and against its
budget.  Every process builds the same weights (a fixed seed).  The
gradients are computed for the comparison in one more process per row
(traced after the measured step had run, they would be planned with the
memory that step holds in use) and compared with the plain row's, passed
on in a file.

``--quick`` shrinks both (vocabulary 4,000, 128 tokens; U-Net 128x128) to
check the script in a minute.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import tempfile
import time

import memsaving  # noqa: F401  (sets up the allocator before TensorFlow)
import keras
import numpy as np
import tensorflow as tf

from memsaving.tf.measure import bytes_in_use, default_device
from memsaving.tools import models


def a_third_below(best: int, resident: int) -> int:
    """0.97 of a third of ``best`` (the lowest unsplit peak measured)."""
    return int(0.97 * best / 3)


def gpt_case(quick: bool):
    vocab, size = (4000, 128) if quick else (32000, 256)
    model = models.gpt(size=size, layers=4, dim=256, heads=4, vocab=vocab)
    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.integers(0, vocab, (8, size + 1)).astype(np.int32))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(inputs, targets):
        logits = model(inputs, training=True)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True))

    return model, (inputs, targets), loss_fn


def gpt2_case(quick: bool):
    """keras_hub's GPT2 backbone built from its constructor arguments (no
    preset), the issue's shape: its output layer is the token embedding
    read in reverse (tied weights), as in GPT-2."""
    import keras_hub

    vocab, size = (4000, 128) if quick else (32000, 256)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=4, num_heads=4, hidden_dim=256,
                                             intermediate_dim=1024, dropout=0.0, max_sequence_length=size)
    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.integers(0, vocab, (8, size + 1)).astype(np.int32))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = tf.ones_like(inputs)

    def loss_fn(inputs, targets):
        hidden = backbone({"token_ids": inputs, "padding_mask": mask}, training=True)
        logits = backbone.token_embedding(hidden, reverse=True)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True))

    return backbone, (inputs, targets), loss_fn


def unet_case(quick: bool):
    size = 128 if quick else 256
    model = models.unet(size)
    x = tf.random.stateless_normal((8, size, size, 3), seed=(0, 1))
    y = tf.random.stateless_normal((8, size, size, 1), seed=(0, 2))

    def loss_fn(x, y):
        return tf.reduce_mean(tf.square(model(x, training=True) - y))

    return model, (x, y), loss_fn


def a_fifth_off_the_step(best: int, resident: int) -> int:
    """The memory the step starts with (weights, inputs) and 0.8 of what the
    lowest unsplit peak measured adds to it."""
    return int(resident + 0.8 * (best - resident))


CASES = {"gpt": gpt_case, "gpt2": gpt2_case, "unet": unet_case}
def a_third(best: int, resident: int) -> int:
    """A third of ``best`` (the lowest unsplit peak measured)."""
    return int(best / 3)


_THIRDS = {"split budget": a_third_below, "split fit": a_third}
BUDGETS = {"gpt": _THIRDS, "gpt2": _THIRDS,
           "unet": {"split budget": a_fifth_off_the_step, "split fit": a_fifth_off_the_step}}
"""The budget of each budget row, from the lowest unsplit peak measured and
the memory the step starts with."""


def run(model, args, loss_fn, gradients, repeat: int, fit: int = 0):
    """Trace and run the step with ``gradients(loss, variables)``; return the
    plan it recorded, the measured peak, the median step time, what the
    step's function holds from its first run on with the part of it
    allocated while the step was traced, and the calibration's margin.
    With ``fit``, the step is made by :func:`memsaving.fit_to_budget` for
    that budget, its plans made for the budget less the margin; what it
    holds is then what the whole calibration left in use, and nothing is
    said to be traced."""
    plans = []

    def step_fn(*args):
        loss = loss_fn(*args)
        grads, plan = gradients(loss, model.trainable_variables)
        plans.append(plan)
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in grads])

    gc.collect()  # what building the model left behind goes first
    before = bytes_in_use(default_device())
    if fit:
        step = memsaving.fit_to_budget(step_fn, *args, budget=fit)
        traced = None
        plans[:] = step.calibration.plans
    else:
        step = tf.function(step_fn)
        step.get_concrete_function(*args)
        traced = bytes_in_use(default_device()) - before
    step(*args)  # warm up
    held = bytes_in_use(default_device()) - before
    peak = memsaving.measure_peak(step, *args)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step(*args).numpy()
        times.append(time.perf_counter() - start)
    margin = step.calibration.margin if fit else 0
    return plans[-1], peak, statistics.median(times), (held, traced), margin


def gradient_values(model, args, loss_fn, gradients) -> list:
    """The gradients themselves, as arrays."""

    @tf.function
    def values(*args):
        return gradients(loss_fn(*args), model.trainable_variables)[0]

    # copies: an array viewing a tensor's buffer keeps it in the allocator
    return [np.array(tf.convert_to_tensor(g).numpy(), copy=True) for g in values(*args)]


def plain_gradients(loss, xs):
    return tf.gradients(loss, xs), memsaving.plan(loss, xs, checkpoints=[])


def memsaving_gradients(**kwargs):
    return lambda loss, xs: memsaving.gradients_and_plan(loss, xs, **kwargs)


def smallest_budget(model, args, loss_fn) -> int:
    """The smallest budget the planner finds feasible without splitting."""
    found = {}

    @tf.function
    def probe(*args):
        try:
            memsaving.plan(loss_fn(*args), model.trainable_variables, checkpoints="memory", budget=1)
        except memsaving.BudgetError as error:
            found["floor"] = error.smallest_budget
        return tf.constant(0)

    probe.get_concrete_function(*args)
    # the memory in use before the step, part of every prediction, moves
    # between traces by up to a few MiB: the budget leaves that room
    return int(found["floor"] * 1.02) + 2 * 2 ** 20


def max_relative_difference(ours, plain) -> float:
    """The largest difference of a gradient from ``tf.gradients``', relative
    to that gradient's largest value, or to a thousandth of the largest
    value of all gradients when that is larger: gradients that are zero in
    exact arithmetic (an attention key's bias) hold rounding noise only."""
    floor = 1e-3 * max(float(np.abs(b).max()) for b in plain)
    worst = 0.0
    for a, b in zip(ours, plain):
        worst = max(worst, float(np.abs(a - b).max()) / max(float(np.abs(b).max()), floor, 1e-30))
    return worst


ROWS = ("plain", "memory", "floor", "split", "split budget", "split fit")
"""The rows: ``split budget`` meets its budget as predicted (``budget=``),
``split fit`` as measured (:func:`memsaving.fit_to_budget`)."""


def row_gradients(row: str, model, args, loss_fn, budget: int):
    """The gradient function of ``row`` (one of :data:`ROWS`), its label
    and its budget (``floor`` finds its own when ``budget`` is 0)."""
    mib = 2 ** 20
    if row == "plain":
        return plain_gradients, "plain tf.gradients", 0
    if row == "memory":
        return memsaving_gradients(checkpoints="memory"), "memory", 0
    if row == "floor":
        budget = budget or smallest_budget(model, args, loss_fn)
        return memsaving_gradients(checkpoints="memory", budget=budget), "floor (budget, no split)", budget
    if row == "split":
        return memsaving_gradients(checkpoints="memory", split="auto"), "split (lowest)", 0
    if row == "split budget":
        return (memsaving_gradients(checkpoints="memory", split="auto", budget=budget),
                f"split, budget {budget / mib:.0f} MiB", budget)
    return (memsaving_gradients(checkpoints="memory", split="auto", budget=budget),
            f"split, fit_to_budget {budget / mib:.0f} MiB", budget)


def measure_row(name: str, quick: bool, repeat: int, row: str, budget: int = 0, timeline_units: int = 0) -> tuple:
    """Build the model and measure one row's step, in the calling process.
    Returns the row (label, predicted peak, measured peak, step time, held,
    traced, regions; the peaks None and the regions an explanation on a
    BudgetError), the budget it was given or found, the bytes the step
    starts with, the model's parameter count and the timeline's lines if
    asked."""
    keras.utils.set_random_seed(0)  # the same weights in every row's process
    model, args, loss_fn = CASES[name](quick)
    gradients, label, budget = row_gradients(row, model, args, loss_fn, budget)
    try:
        plan, peak, seconds, (held, traced), margin = run(model, args, loss_fn, gradients, repeat,
                                                          fit=budget if row == "split fit" else 0)
    except memsaving.BudgetError as error:
        return ((label, None, None, None, None, None,
                 f"BudgetError, smallest budget found {error.smallest_budget / 2 ** 20:.1f} MiB"),
                budget, 0, model.count_params(), [])
    predicted = plan.plain_peak if row == "plain" else plan.predicted_peak
    regions = ", ".join(f"{r.name} ({len(r.ops)} ops, {r.chunks} pieces of {r.rows} rows)"
                        for r in getattr(plan, "splits", ()))
    if row == "split fit":
        regions = f"planned for {(budget - margin) / 2 ** 20:.1f} MiB after calibrating; {regions}"
        budget -= margin  # what its gradients are compared at
    lines = timeline_lines(model, args, loss_fn, timeline_units) if timeline_units else []
    return ((label, predicted, peak, seconds, held, traced, regions), budget, plan.resident_bytes,
            model.count_params(), lines)


def compare_row(name: str, quick: bool, row: str, budget: int, reference_file: str) -> float:
    """The largest relative difference of ``row``'s gradients from the plain
    ones saved in ``reference_file`` (the ``plain`` row saves them there),
    computed in the calling process.  Apart from the step that is measured:
    a second function traced after the step has run would be planned with
    the memory that step holds in use, and a budget plan then differs."""
    keras.utils.set_random_seed(0)
    model, args, loss_fn = CASES[name](quick)
    if row == "split fit":  # planned for the calibrated budget, or else the lowest plan, as the calibration does
        try:
            grads = gradient_values(model, args, loss_fn, row_gradients("split budget", model, args, loss_fn,
                                                                        budget)[0])
        except memsaving.BudgetError:
            grads = gradient_values(model, args, loss_fn, row_gradients("split", model, args, loss_fn, 0)[0])
    else:
        grads = gradient_values(model, args, loss_fn, row_gradients(row, model, args, loss_fn, budget)[0])
    if row == "plain":
        np.savez(reference_file, *grads)
        return 0.0
    with np.load(reference_file) as saved:
        return max_relative_difference(grads, [saved[f"arr_{k}"] for k in range(len(grads))])


def in_own_process(function, *arguments):
    """``function(*arguments)`` in a fresh Python process: a row measured
    after others in one process would count what they left in use
    (functions, the allocator's own state) against its budget and in its
    peak."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(function, arguments)


def measure(name: str, quick: bool, repeat: int, timeline_units: int = 0) -> list:
    """Measure every row of one model, each step and each comparison of
    gradients in a process of its own, print them side by side and return
    them: (label, predicted, measured, step time, gradient difference,
    held, traced, regions), the peaks None for a budget that fails."""
    mib = 2 ** 20
    rows = []
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        reference = os.path.join(folder, "plain.npz")
        resident, parameters, best = 0, 0, 0
        for row in ROWS:
            if row == "split budget":
                best = min(rows[1][2], rows[2][2])  # the unsplit plans' measured peaks
            budget = BUDGETS[name][row](best, resident) if row in ("split budget", "split fit") else 0
            measured, budget, start, parameters, timeline = in_own_process(
                measure_row, name, quick, repeat, row, budget, timeline_units if row == "split" else 0)
            resident = start or resident
            lines += timeline
            label, predicted, peak, seconds, held, traced, note = measured
            difference = None if peak is None else in_own_process(compare_row, name, quick, row, budget,
                                                                  reference)
            rows.append((label, predicted, peak, seconds, difference, held, traced, note))
    print(f"\n{name}: {parameters:,} parameters; peaks include the {resident / mib:.1f} MiB the step starts with "
          "(weights, inputs); 'above' ratios leave it out; every row measured in a Python process of its own")
    print(f"{'strategy':30} {'predicted MiB':>13} {'measured MiB':>13} {'best unsplit / it':>18} {'above':>7} "
          f"{'step s':>7} {'grad rel diff':>13} {'held MiB':>8} {'traced':>6}")
    for label, predicted, peak, step_seconds, diff, held, traced, note in rows:
        if peak is None:
            print(f"{label:30} {note}")
            continue
        above = (best - resident) / max(peak - resident, 1)
        print(f"{label:30} {predicted / mib:>13.1f} {peak / mib:>13.1f} {best / peak:>17.2f}x {above:>6.2f}x "
              f"{step_seconds:>7.2f} {diff:>13.1e} {held / mib:>8.1f} "
              f"{'-' if traced is None else f'{traced / mib:.1f}':>6}")
    for label, _, peak, *_, note in rows:
        if note and peak is not None:
            print(f"  {label}: {note}")
    for line in lines:
        print(line)
    return rows


def timeline_lines(model, args, loss_fn, units: int) -> list:
    """Where the lowest split's memory goes: the ``units`` backward units
    (or the forward pass) of largest measured peak, above the memory in use
    before the step (:func:`memsaving.tools.memory_timeline.timeline`)."""
    from memsaving.tools.memory_timeline import timeline  # pylint: disable=import-outside-toplevel

    mib = 2 ** 20
    line = timeline(loss_fn, model.trainable_variables, args, checkpoints="memory", split="auto")
    lines = [f"\nsplit (lowest): the {units} units of largest measured peak, above the {line.baseline / mib:.1f} MiB "
             f"in use before the step (the plan predicts a peak {line.predicted_peak / mib:.1f} MiB above "
             f"{line.plan.resident_bytes / mib:.1f}; the simulator's own timeline leaves work buffers out, so no "
             "prediction per unit is printed)"]
    ranked = sorted(range(len(line.measured)), key=lambda k: -line.measured[k][2])[:units]
    for k in sorted(ranked):
        label, _, peak = line.measured[k]
        lines.append(f"  {label[:70]:70} {peak / mib:>8.1f} MiB")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "unet"], choices=list(CASES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeline", type=int, default=0, metavar="UNITS",
                        help="also print the UNITS backward units of the lowest split with the largest measured "
                             "peaks")
    args = parser.parse_args(argv)
    for name in args.models:
        measure(name, args.quick, args.repeat, args.timeline)


if __name__ == "__main__":
    main()
