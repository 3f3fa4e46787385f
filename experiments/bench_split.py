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
* ``split, budget``: ``split="auto"`` with a budget that leaves the step,
  above the memory it starts with (weights, inputs), 0.95 of a third (GPT:
  3x below, with 5% for the measured peak to exceed the prediction) or 0.8
  (U-Net) of what the lower of the two unsplit peaks *measured* adds: the
  planner splits what stops that budget from fitting, in as few pieces as
  fit.

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

Each model is measured in a Python process of its own (the allocator
keeps memory a model measured before left behind).  ``--quick`` shrinks both (vocabulary 4,000, 128 tokens; U-Net 128x128) to
check the script in a minute.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time

import memsaving  # noqa: F401  (sets up the allocator before TensorFlow)
import keras
import numpy as np
import tensorflow as tf

from memsaving.tf.measure import bytes_in_use, default_device
from memsaving.tools import models


def gpt_case(quick: bool):
    vocab, size = (4000, 128) if quick else (32000, 256)
    model = models.gpt(size=size, layers=4, dim=256, heads=4, vocab=vocab)
    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.integers(0, vocab, (8, size + 1)).astype(np.int32))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(inputs, targets):
        logits = model(inputs, training=True)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True))

    return model, (inputs, targets), loss_fn, 0.95 / 3


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

    return backbone, (inputs, targets), loss_fn, 0.95 / 3


def unet_case(quick: bool):
    size = 128 if quick else 256
    model = models.unet(size)
    x = tf.random.stateless_normal((8, size, size, 3), seed=(0, 1))
    y = tf.random.stateless_normal((8, size, size, 1), seed=(0, 2))

    def loss_fn(x, y):
        return tf.reduce_mean(tf.square(model(x, training=True) - y))

    return model, (x, y), loss_fn, 0.8


CASES = {"gpt": gpt_case, "gpt2": gpt2_case, "unet": unet_case}


def run(model, args, loss_fn, gradients, repeat: int):
    """Trace and run the step with ``gradients(loss, variables)``; return the
    plan it recorded, the measured peak, the median step time, the
    gradients themselves and what the step's function holds from its first
    run on, with the part of it allocated while the step was traced."""
    plans = []

    @tf.function
    def step(*args):
        loss = loss_fn(*args)
        grads, plan = gradients(loss, model.trainable_variables)
        plans.append(plan)
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in grads])

    gc.collect()  # what earlier rows left behind goes first
    before = bytes_in_use(default_device())
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

    @tf.function
    def values(*args):
        return gradients(loss_fn(*args), model.trainable_variables)[0]

    # copies: an array viewing a tensor's buffer keeps it in the allocator
    grads = [np.array(tf.convert_to_tensor(g).numpy(), copy=True) for g in values(*args)]
    return plans[-1], peak, statistics.median(times), grads, (held, traced)


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


def measure(name: str, quick: bool, repeat: int, timeline_units: int = 0) -> list:
    model, args, loss_fn, fraction = CASES[name](quick)
    mib = 2 ** 20
    rows = []
    plan, peak, seconds, reference, held_traced = run(model, args, loss_fn, plain_gradients, repeat)
    rows.append(("plain tf.gradients", plan.plain_peak, peak, seconds, 0.0, *held_traced, ""))
    unsplit = []
    for label, kwargs in (("memory", {"checkpoints": "memory"}),
                          ("floor (budget, no split)", {"checkpoints": "memory",
                                                        "budget": smallest_budget(model, args, loss_fn)})):
        plan, peak, seconds, grads, held_traced = run(model, args, loss_fn, memsaving_gradients(**kwargs), repeat)
        rows.append((label, plan.predicted_peak, peak, seconds, max_relative_difference(grads, reference), *held_traced,
                     ""))
        unsplit.append(peak)
    best = min(unsplit)
    # a fraction of the best unsplit plan's memory above what the step
    # starts with (weights and inputs, the same in every plan)
    resident = plan.resident_bytes
    budget = int(resident + fraction * (best - resident))
    for label, kwargs in (("split (lowest)", {}), (f"split, budget {budget / mib:.0f} MiB", {"budget": budget})):
        try:
            gradients = memsaving_gradients(checkpoints="memory", split="auto", **kwargs)
            plan, peak, seconds, grads, held_traced = run(model, args, loss_fn, gradients, repeat)
        except memsaving.BudgetError as error:
            print(f"{label}: BudgetError, smallest budget found {error.smallest_budget / mib:.1f} MiB")
            continue
        regions = ", ".join(f"{r.name} ({len(r.ops)} ops, {r.chunks} pieces of {r.rows} rows)" for r in plan.splits)
        rows.append((label, plan.predicted_peak, peak, seconds, max_relative_difference(grads, reference), *held_traced,
                     regions))
    print(f"\n{name}: {model.count_params():,} parameters; peaks include the {resident / mib:.1f} MiB the step starts "
          "with (weights, inputs); 'above' ratios leave it out")
    print(f"{'strategy':30} {'predicted MiB':>13} {'measured MiB':>13} {'best unsplit / it':>18} {'above':>7} "
          f"{'step s':>7} {'grad rel diff':>13} {'held MiB':>8} {'traced':>6}")
    for label, predicted, measured, step_seconds, diff, held, traced, note in rows:
        above = (best - resident) / max(measured - resident, 1)
        print(f"{label:30} {predicted / mib:>13.1f} {measured / mib:>13.1f} {best / measured:>17.2f}x {above:>6.2f}x "
              f"{step_seconds:>7.2f} {diff:>13.1e} {held / mib:>8.1f} {traced / mib:>6.1f}")
    for label, *_, note in rows:
        if note:
            print(f"  {label}: {note}")
    if timeline_units:
        print_timeline(model, args, loss_fn, timeline_units)
    keras.backend.clear_session()
    return rows


def print_timeline(model, args, loss_fn, units: int) -> None:
    """Where the lowest split's memory goes: the ``units`` backward units
    (or the forward pass) of largest measured peak, above the memory in use
    before the step (:func:`memsaving.tools.memory_timeline.timeline`)."""
    from memsaving.tools.memory_timeline import timeline  # pylint: disable=import-outside-toplevel

    mib = 2 ** 20
    line = timeline(loss_fn, model.trainable_variables, args, checkpoints="memory", split="auto")
    print(f"\nsplit (lowest): the {units} units of largest measured peak, above the {line.baseline / mib:.1f} MiB "
          f"in use before the step (the plan predicts a peak {line.predicted_peak / mib:.1f} MiB above "
          f"{line.plan.resident_bytes / mib:.1f}; the simulator's own timeline leaves work buffers out, so no "
          "prediction per unit is printed)")
    ranked = sorted(range(len(line.measured)), key=lambda k: -line.measured[k][2])[:units]
    for k in sorted(ranked):
        label, _, peak = line.measured[k]
        print(f"  {label[:70]:70} {peak / mib:>8.1f} MiB")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "unet"], choices=list(CASES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeline", type=int, default=0, metavar="UNITS",
                        help="also print the UNITS backward units of the lowest split with the largest measured "
                             "peaks")
    args = parser.parse_args(argv)
    if len(args.models) == 1:
        measure(args.models[0], args.quick, args.repeat, args.timeline)
        return
    for name in args.models:  # each in a process of its own: the allocator keeps what a model left
        subprocess.run([sys.executable, "-m", "experiments.bench_split", "--models", name, "--repeat",
                        str(args.repeat), "--timeline", str(args.timeline)] + (["--quick"] if args.quick else []),
                       check=True)


if __name__ == "__main__":
    main()
