"""memsaving.fit_to_budget and Keras' calibration: budgets that hold as measured.

The planner meets a budget as *predicted*; these tests run real steps,
measure the allocator's peak, and check that the calibration replans for a
lower budget until the measured peak fits, or says with the measured figures
that it cannot.  ``pytest tests/api/test_fit_budget.py -s`` prints every round.
"""

import dataclasses
import gc
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
import memsaving.keras as mkeras
from memsaving.calibration import STEADY_CALLS
from memsaving.fit_budget import HEADROOM, MEASURED_STEPS

from helpers import in_a_fresh_process

MiB = 2 ** 20
DEPTH, WIDTH, BATCH = 12, 128, 2048


@pytest.fixture(autouse=True)
def _free_earlier_tensors():
    """Budgets are compared with the allocator's whole peak: free what earlier tests left."""
    gc.collect()
    yield


class MLP:
    """A ReLU MLP of plain variables and its SGD step with a budgeted memsaving.gradients.

    Bias-free MatMul + ReLU layers: their checkpointed steps measure close to
    the prediction, so a lower planned budget lowers the measured peak,
    which calibration needs.  The step also holds a buffer the plan cannot
    see (made from the input, read only after the gradients, as a metric
    would be), so it measures above its prediction by about that buffer: the
    case calibration exists for.
    """

    def __init__(self, seed=0, unseen_copies=2):
        rng = np.random.default_rng(seed)
        self.weights = [tf.Variable(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * WIDTH ** -0.5)
                        for _ in range(DEPTH)]
        self.x = tf.constant(rng.standard_normal((BATCH, WIDTH)).astype(np.float32))
        self.unseen_copies = unseen_copies  # the unseen buffer, in copies of the input batch (1 MiB each)

    def loss(self, x):
        h = x
        for w in self.weights:
            h = tf.nn.relu(tf.matmul(h, w))
        return tf.reduce_mean(h * h)

    def step(self, budget):
        def train_step(x):
            unseen = tf.tile(x, [self.unseen_copies, 1]) * 2.0
            loss = self.loss(x)
            grads = memsaving.gradients(loss, self.weights, checkpoints="memory", budget=budget, multilevel=True)
            for w, g in zip(self.weights, grads):
                w.assign_sub(1e-3 * g)
            with tf.control_dependencies(grads):
                return loss + 0.0 * tf.reduce_min(unseen)
        return train_step

    def plain_plan(self):
        """The plain peak and resident bytes, as predicted."""
        captured = {}

        def capture(x):
            captured["plan"] = memsaving.plan(self.loss(x), self.weights, checkpoints="memory")
            return x

        tf.function(capture).get_concrete_function(self.x)
        return captured["plan"].plain_peak, captured["plan"].resident_bytes


def _show(title, rounds, budget):
    print(f"\n{title}: budget {budget / MiB:.3f} MiB")
    for n, r in enumerate(rounds, 1):
        print(f"  round {n}: {r.describe(budget)}")


def _budget_between(mlp, fraction):
    """A budget ``fraction`` of the way from the resident bytes to the plain peak (predicted)."""
    plain, resident = mlp.plain_plan()
    return int(resident + fraction * (plain - resident))


def _scripted_peaks(monkeypatch, fractions, budget):
    """Make fit_to_budget read ``fractions[k] * budget`` as the peak of round k+1 (every one of
    its measured steps; a tuple gives its steps in turn; ``"oom"`` makes its warm-up run out of
    memory), so that what it does with each peak is tested exactly."""
    import memsaving.fit_budget as fit_budget
    steps, calls = [], []

    def fraction_now():
        fraction = fractions[min(len(steps) - 1, len(fractions) - 1)]
        if isinstance(fraction, tuple):
            fraction = fraction[(len(calls) - 1) % len(fraction)]
        return fraction

    def measure(step, *args, device=None, **kwargs):
        if not steps or steps[-1] is not step:
            steps.append(step)  # a new round's step
            calls.clear()
        calls.append(step)
        step(*args, **kwargs)  # the step runs, as it would (its variables change)
        fraction = fraction_now()
        if fraction == "oom":
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor (scripted)")
        return int(fraction * budget)

    monkeypatch.setattr(fit_budget, "measure_peak", measure)


def test_fit_to_budget_starts_below_the_budget_and_fits():
    """The first plan leaves room for the known error, so the first step measured is under the
    budget (the step holds nothing the plan does not see); the step returned fits it."""
    mlp = MLP(unseen_copies=0)
    budget = _budget_between(mlp, 0.6)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, restore_variables=True)
    report = step.calibration
    _show("fit_to_budget, MLP", report.rounds, budget)
    first = report.rounds[0]
    assert first.planned_for < budget and first.measured_peak <= budget
    assert all(r.predicted_peak <= budget for r in report.rounds)
    assert report.fits and report.measured_peak <= budget - HEADROOM * (budget - report.rounds[report.chosen].resident)
    plan = report.plans[0]
    assert plan.budget == budget
    assert f"measured peak {report.measured_peak / MiB:.1f} MiB (budget {budget / MiB:.1f} MiB)" in report.table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget = None  # a plan is immutable: what its step measured is the calibration's record
    assert report.seconds > 0


def test_fit_to_budgets_later_steps_are_watched_and_a_creep_calibrates_again_lower(monkeypatch):
    """The step fit_to_budget returns measures each call: calls that leave the chosen round's room
    change nothing; one whose peak crept into the room (scripted: just under the budget) makes the
    next call calibrate again, from a plan lower than the chosen one, and training goes on."""
    import memsaving.fit_budget as fit_budget

    mlp = MLP(unseen_copies=0)
    budget = _budget_between(mlp, 0.6)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget)
    report = step.calibration
    calibrated = list(report.rounds)
    chosen = report.rounds[report.chosen]
    for _ in range(3):
        step(mlp.x)
    assert step.calibration.rounds == calibrated and step.calibration.chosen is not None
    real_peak = fit_budget.peak_bytes
    monkeypatch.setattr(fit_budget, "peak_bytes", lambda device=None: budget - MiB // 4)
    step(mlp.x)  # crept: judged again
    monkeypatch.setattr(fit_budget, "peak_bytes", real_peak)
    rounds = list(step.calibration.rounds)
    assert rounds[-1].measured_peak == budget - MiB // 4 and not rounds[-1].fits(budget)
    assert step.calibration.chosen is None
    step(mlp.x)  # calibrates again on this call's batch, then runs it
    _show("fit_to_budget, a later step crept into the room", step.calibration.rounds, budget)
    after = step.calibration.rounds[len(rounds):]
    assert after and after[0].planned_for < chosen.planned_for
    assert step.calibration.fits and step.calibration.chosen >= len(rounds)
    assert step.get_concrete_function(mlp.x) is not None  # other attributes are the tf.function's


class _OutOfMemoryOnce:
    """Stands in for a WatchedStep's tf.function: its next call applies part of an update (adds 1 to
    a weight), then fails as a device out of memory does; later calls are the real function's."""

    def __init__(self, function, weight):
        self.function, self.weight, self.raised = function, weight, 0

    def get_concrete_function(self, *args, **kwargs):
        return self.function.get_concrete_function(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not self.raised:
            self.raised += 1
            self.weight.assign_add(tf.ones_like(self.weight))
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor (scripted)")
        return self.function(*args, **kwargs)


def test_a_step_out_of_memory_after_calibration_is_undone_and_run_again_lower():
    """A call of the calibrated step fails with ResourceExhaustedError after applying part of its
    updates (as a device does when the allocator's chunks moved since calibration): the variables
    are put back as before the call, the plan is judged out of memory, the step is calibrated again
    lower on the same batch and run; training goes on with nothing half applied."""
    mlp = MLP(unseen_copies=0)
    budget = _budget_between(mlp, 0.6)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget)
    chosen = step.calibration.rounds[step.calibration.chosen]
    if chosen.lowest:
        pytest.skip("the budget's calibration chose the planner's lowest plan: nothing lower to go to")
    step(mlp.x)
    before = mlp.weights[0].numpy().copy()
    calibrated = len(step.calibration.rounds)
    step.function = _OutOfMemoryOnce(step.function, mlp.weights[0])
    loss = step(mlp.x)
    _show("fit_to_budget, a step after calibration out of memory", step.calibration.rounds, budget)
    assert loss is not None and loss.shape == ()  # the step ran, on the lower plan
    assert np.max(np.abs(mlp.weights[0].numpy() - before)) < 0.5  # the partial +1 was undone
    failed = step.calibration.rounds[calibrated]
    assert failed.out_of_memory and failed.steady
    after = step.calibration.rounds[calibrated + 1:]
    assert after and after[0].planned_for < chosen.planned_for
    assert step.calibration.fits and step.calibration.chosen > calibrated


def test_a_watched_step_stops_copying_the_variables_once_its_peak_is_steady(monkeypatch):
    """The host copies a watched call makes before running stop after STEADY_CALLS calls in a row
    at or under the highest peak since calibration: after that an out-of-memory error propagates."""
    import memsaving.fit_budget as fit_budget

    mlp = MLP(unseen_copies=0)
    budget = _budget_between(mlp, 0.6)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget)
    copies = []
    real_snapshot = fit_budget.snapshot_values
    monkeypatch.setattr(fit_budget, "snapshot_values", lambda variables: copies.append(1) or real_snapshot(variables))
    monkeypatch.setattr(fit_budget, "peak_bytes", lambda device=None: budget // 2)  # steady, well inside the budget
    for _ in range(STEADY_CALLS + 5):
        step(mlp.x)
    assert len(copies) == STEADY_CALLS + 1  # the first call sets the highest peak
    step.function = _OutOfMemoryOnce(step.function, mlp.weights[0])
    with pytest.raises(tf.errors.ResourceExhaustedError):
        step(mlp.x)


def test_a_low_first_round_climbs_to_a_higher_plan(monkeypatch):
    mlp = MLP()
    budget = _budget_between(mlp, 0.7)
    # the second round uses 90% of the budget and leaves the headroom (10% of the room above the
    # resident bytes, at least 10% of the budget here)
    _scripted_peaks(monkeypatch, [0.6, 0.905], budget)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=3)
    rounds = step.calibration.rounds
    _show("climb", rounds, budget)
    assert len(rounds) == 2 and rounds[1].planned_for > rounds[0].planned_for
    assert step.calibration.chosen == 1 and rounds[1].predicted_peak <= budget


def test_a_round_over_the_budget_is_followed_by_a_lower_plan_and_the_best_fitting_is_returned(monkeypatch):
    """A budget with room above the planner's lowest plan: at 0.7 of the way to the plain peak, the
    plan the ratio measured over the budget asks for was the lowest, sometimes predicted just over
    its target, and may not run (the best round was then kept without a third: 1 run in 5)."""
    mlp = MLP()
    budget = _budget_between(mlp, 0.9)
    _scripted_peaks(monkeypatch, [0.6, 1.05, 0.7], budget)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=3)
    rounds = step.calibration.rounds
    _show("scripted: fits, over, fits", rounds, budget)
    assert rounds[1].planned_for > rounds[0].planned_for  # climbed after a low round
    assert len(rounds) == 3 and rounds[2].planned_for < rounds[1].planned_for  # lower after an over one
    assert step.calibration.chosen == 2 and step.calibration.measured_peak == int(0.7 * budget)


def test_a_round_that_runs_out_of_memory_restores_the_variables_and_goes_lower(monkeypatch):
    """Round 1's measured run fails with an out-of-memory error: its runs are undone (the
    counter the step increments goes back to 0), and round 2 plans lower and is returned."""
    mlp = MLP()
    budget = _budget_between(mlp, 0.7)
    _scripted_peaks(monkeypatch, ["oom", 0.92], budget)
    runs = tf.Variable(0)

    def counted(x):
        runs.assign_add(1)
        return mlp.step(budget)(x)

    step = memsaving.fit_to_budget(counted, mlp.x, budget=budget, max_rounds=3)
    rounds = step.calibration.rounds
    assert rounds[0].out_of_memory and not rounds[1].out_of_memory
    assert rounds[1].planned_for < rounds[0].planned_for
    assert step.calibration.chosen == 1
    assert int(runs.numpy()) == 1 + MEASURED_STEPS  # round 2's warm-up and measured runs only


def test_a_budget_below_every_plan_is_refused_before_any_step_runs():
    mlp = MLP(seed=2, unseen_copies=0)
    plain, resident = mlp.plain_plan()
    budget = resident + 1
    runs = tf.Variable(0)

    def counted(x):
        runs.assign_add(1)
        return mlp.step(budget)(x)

    with pytest.raises(memsaving.BudgetError, match="Nothing was run") as caught:
        memsaving.fit_to_budget(counted, mlp.x, budget=budget)
    assert int(runs.numpy()) == 0
    assert caught.value.calibration.rounds == []
    smallest = caught.value.smallest_budget
    assert smallest > budget
    step = memsaving.fit_to_budget(mlp.step(smallest), mlp.x, budget=smallest, restore_variables=True)
    _show("fit_to_budget at the smallest budget of its refusal", step.calibration.rounds, smallest)
    assert step.calibration.fits


def hard_limit_figures(fraction: float, steps: int = 20) -> dict:
    """fit_to_budget, then training steps up to ``steps``, in a process whose CPU allocator is
    capped at the budget (TF_CPU_BFC_MEM_LIMIT_IN_MB): a step over it fails as on a device."""
    mlp = MLP(seed=3, unseen_copies=0)
    budget = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MiB
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget)
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(steps):
        step(mlp.x).numpy()
    return {"rounds": [r.measured_peak for r in step.calibration.rounds],
            "peak": int(tf.config.experimental.get_memory_info("CPU:0")["peak"]), "budget": budget}


def _capped_budget_mib(fraction: float) -> int:
    """A budget in MiB ``fraction`` of the way from the MLP's resident bytes to its plain peak,
    as measured without a cap in a process of its own."""
    figures = in_a_fresh_process("test_fit_budget", "plain_figures", test_settings=False)
    return int((figures["resident"] + fraction * (figures["plain"] - figures["resident"])) // MiB)


def plain_figures() -> dict:
    mlp = MLP(seed=3, unseen_copies=0)
    plain, resident = mlp.plain_plan()
    return {"plain": plain, "resident": resident}


def test_fit_to_budget_trains_under_a_hard_memory_limit():
    """The allocator is capped at the budget, as a device is: every step of calibration and of
    the training that follows runs under it (a step over it would raise ResourceExhaustedError)."""
    budget_mib = _capped_budget_mib(0.6)
    figures = in_a_fresh_process("test_fit_budget", "hard_limit_figures", 0.6, test_settings=False,
                                 environment={"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(budget_mib)})
    assert figures["peak"] <= figures["budget"]
    assert all(peak <= figures["budget"] for peak in figures["rounds"])


def _probe_budget(mlp) -> int:
    """A budget the 30% prior refuses while the planner's lowest plan meets it as predicted (less
    the headroom): the smallest budget a refusal names leaves room for a step memory 1.3x the
    lowest plan's prediction, so the plan needs 1/1.3 of that room as predicted; this budget is
    between the two (:func:`_midway`)."""
    _, resident = mlp.plain_plan()
    with pytest.raises(memsaving.BudgetError) as caught:
        memsaving.fit_to_budget(mlp.step(resident + 1), mlp.x, budget=resident + 1)
    return _midway(caught.value)


def _midway(refusal) -> int:
    """0.84 of the way from the refusal's bytes in use before the step to its smallest budget: the
    lowest plan's step memory as predicted fits 0.9 of that room with 9% to spare, and the
    prior's first target is 16% of that step memory under it (at 0.885 the planner once found a
    plan under that target, which then ran without a probe)."""
    resident = float(re.search(r"([\d.]+) MiB of it in use before the step", str(refusal)).group(1)) * MiB
    return int(resident + 0.84 * (refusal.smallest_budget - resident))


def test_a_budget_the_prior_refuses_is_probed_where_running_out_of_memory_raises(monkeypatch):
    """Nothing measured yet, the known error forbids every plan, but the lowest plan is predicted
    under the budget less the headroom: on a device where a step that runs out of memory raises
    (a GPU), that plan is measured once, and kept when it fits.  Where it may end the process (the
    CPU with oneDNN under a cap) or the budget is no limit (the CPU without one), the budget is
    refused as before."""
    import memsaving.fit_budget as fit_budget

    mlp = MLP(seed=4, unseen_copies=0)
    budget = _probe_budget(mlp)
    with pytest.raises(memsaving.BudgetError, match="Nothing was run"):
        memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget)
    monkeypatch.setattr(fit_budget, "out_of_memory_raises", lambda device=None: True)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, restore_variables=True)
    rounds = step.calibration.rounds
    _show("fit_to_budget, a probe of the lowest plan", rounds, budget)
    assert rounds[0].probe and rounds[0].lowest and step.calibration.fits
    assert "measured as a probe" in rounds[0].describe(budget)


def test_a_probe_that_runs_out_of_memory_is_undone_and_the_budget_refused(monkeypatch):
    import memsaving.fit_budget as fit_budget

    mlp = MLP(seed=4, unseen_copies=0)
    budget = _probe_budget(mlp)
    monkeypatch.setattr(fit_budget, "out_of_memory_raises", lambda device=None: True)
    _scripted_peaks(monkeypatch, [(0.5, "oom")], budget)  # its first measured run fits, the second fails
    runs = tf.Variable(0)
    before = [w.numpy().copy() for w in mlp.weights]

    def counted(x):
        runs.assign_add(1)
        return mlp.step(budget)(x)

    with pytest.raises(memsaving.BudgetError, match="lowest plan") as caught:
        memsaving.fit_to_budget(counted, mlp.x, budget=budget)
    (probe,) = caught.value.calibration.rounds
    assert probe.probe and probe.out_of_memory
    assert int(runs.numpy()) == 0  # the probe's warm-up and measured runs are undone
    for w, value in zip(mlp.weights, before):
        np.testing.assert_array_equal(w.numpy(), value)


def probe_budget_figures() -> dict:
    """The probe's budget in whole MiB (:func:`_probe_budget`), in a process of its own."""
    return {"budget_mib": round(_probe_budget(MLP(seed=5, unseen_copies=0)) / MiB)}


def capped_probe_figures(steps: int = 20) -> dict:
    """fit_to_budget and ``steps`` training steps under TF_CPU_BFC_MEM_LIMIT_IN_MB, oneDNN off, the
    allocator's pool held as one region as a GPU's is (the CPU's regions of 2, 4, 8... MiB cut an
    8 MiB cap into pieces, and the probe ran out of memory there with 1 MiB of room)."""
    from experiments.bench_hard_limit import pool_as_one_region

    budget = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MiB
    pool_as_one_region(budget)
    mlp = MLP(seed=5, unseen_copies=0)
    try:
        step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget)
        tf.config.experimental.reset_memory_stats("CPU:0")
        for _ in range(steps):
            step(mlp.x).numpy()
    except memsaving.BudgetError as error:  # refused, or the lowest plan ran out of memory at a later step, undone
        return {"error": str(error), "rounds": [r.probe for r in error.calibration.rounds]}
    return {"probes": [r.probe for r in step.calibration.rounds], "budget": budget,
            "peak": int(tf.config.experimental.get_memory_info("CPU:0")["peak"])}


def test_a_probe_under_a_hard_memory_limit_trains_where_the_prior_refused():
    """With oneDNN off, the capped CPU raises ResourceExhaustedError as a GPU does, so a budget the
    prior refuses is probed: the lowest plan measures under it and trains 20 steps under the cap."""
    budget_mib = in_a_fresh_process("test_fit_budget", "probe_budget_figures", test_settings=False)["budget_mib"]
    # With TensorFlow's default threads this step's peak moves by up to a third from run to run (5.1
    # or 6.8 MiB under an 8 MiB cap, on an idle machine); on a loaded one the probe once measured over
    # the room it must leave and was refused, as it should be.  A refused probe (or one whose later
    # step ran out of memory and was undone: a BudgetError, nothing counted) gets a second process;
    # every run must keep the promise, and one must train.
    runs = []
    for _ in range(2):
        figures = in_a_fresh_process("test_fit_budget", "capped_probe_figures", test_settings=False,
                                     environment={"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(budget_mib),
                                                  "TF_ENABLE_ONEDNN_OPTS": "0"})
        runs.append(figures)
        if "error" not in figures:
            break
        assert figures["rounds"][0] and "lowest plan" in figures["error"], figures  # a probe, then refused
    assert "error" not in runs[-1], runs
    assert runs[-1]["probes"][0] and runs[-1]["peak"] <= runs[-1]["budget"], runs


CONV_CAP_MIB = 48
"""A cap for :func:`capped_conv_figures`: its two-convolution step needs about 36 MiB with Eigen's
kernels, 32 of them one convolution gradient's work buffer (24.5 MiB asked for)."""


def _two_convolutions():
    inputs = keras.Input((32, 32, 3))
    hidden = keras.layers.ReLU()(keras.layers.Conv2D(16, 3, padding="same")(inputs))
    model = keras.Model(inputs, keras.layers.Conv2D(16, 3, padding="same")(hidden))
    return model, tf.random.stateless_normal([16, 32, 32, 3], seed=(1, 2))


def _conv_train_step(model, budget):
    weights = model.trainable_variables

    def train_step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = memsaving.gradients(loss, weights, budget=budget)
        for w, g in zip(weights, grads):
            w.assign_sub(1e-3 * g)
        return loss
    return train_step


def conv_profiles() -> dict:
    """Profile the two-convolution step's kernels into the cache, with no cap (a profile taken in a
    nearly full pool reads chunks handed whole: see the test)."""
    model, x = _two_convolutions()

    def profiled(x):
        return memsaving.gradients(tf.reduce_mean(tf.square(model(x, training=True))), model.trainable_variables,
                                   checkpoints="memory")

    tf.function(profiled).get_concrete_function(x)
    return {}


def capped_conv_figures(steps: int = 10) -> dict:
    """fit_to_budget of the two-convolution step and ``steps`` steps under a CONV_CAP_MIB cap, Eigen's
    kernels, the pool held as one region: how its rounds read and whether the steps ran."""
    from experiments.bench_hard_limit import pool_as_one_region

    budget = CONV_CAP_MIB * MiB
    pool_as_one_region(budget)
    model, x = _two_convolutions()
    try:
        step = memsaving.fit_to_budget(_conv_train_step(model, budget), x, budget=budget)
    except memsaving.BudgetError as error:
        return {"error": str(error)}
    for _ in range(steps):
        step(x).numpy()
    rounds = step.calibration.rounds
    return {"rounds": [r.describe(budget) for r in rounds], "fits": step.calibration.fits,
            "measured": [r.measured_peak for r in rounds], "room": rounds[0].room(budget), "budget": budget}


def test_a_round_under_a_hard_limit_is_measured_with_its_room_held(tmp_path):
    """Under a cap that is the budget, the allocator's peak reads near the cap whenever a large
    request finds little free: it hands a chunk of up to twice the request whole (Eigen's 24.5 MiB
    work buffer, in a 48 MiB pool).  Read as the step's need, that refused a budget the step runs
    under.  Where running out of memory raises, the rounds run with the room they must leave held,
    so the device's limit judges: the plan fits and trains, and each round's reading leaves the
    room.  (The kernels are profiled first with no cap, as by an earlier run: profiled in the
    nearly full pool, a temporary reads the whole chunk it was handed.)"""
    settings = {"TF_ENABLE_ONEDNN_OPTS": "0", "MEMSAVING_CACHE_DIR": str(tmp_path)}
    in_a_fresh_process("test_fit_budget", "conv_profiles", test_settings=False, environment=settings)
    figures = in_a_fresh_process("test_fit_budget", "capped_conv_figures", test_settings=False,
                                 environment={**settings, "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(CONV_CAP_MIB)})
    assert "error" not in figures, figures
    print("\n".join(figures["rounds"]))
    assert figures["fits"]
    assert all(m <= figures["budget"] - figures["room"] for m in figures["measured"]), figures


def _buffer_address(variable) -> int:
    """Where the variable's buffer is: a CPU tensor's numpy view shares its memory."""
    value = variable.read_value()
    address = np.asarray(value).__array_interface__["data"][0]
    del value
    return address


def _in_use() -> int:
    return tf.config.experimental.get_memory_info("CPU:0")["current"]


@pytest.mark.parametrize("case", ["finite", "negative zero", "infinite now", "int32"])
def test_restore_variable_puts_back_the_exact_value_in_the_same_buffer(case):
    from memsaving.fit_budget import restore_variable
    rng = np.random.default_rng(0)
    dtype = np.int32 if case == "int32" else np.float32
    saved = (rng.standard_normal((512, 1024)) * 1e4).astype(dtype)
    if case == "negative zero":
        saved[0, :8] = -0.0
    variable = tf.Variable(tf.zeros(saved.shape, dtype))
    variable.assign_add(saved)  # the variable's buffer is an allocator chunk, as after a layer's initializer
    update = (rng.standard_normal(saved.shape) * 3).astype(dtype)
    variable.assign_add(update)  # a training step, in place
    if case == "infinite now":
        variable.assign_add(np.where(np.arange(saved.size).reshape(saved.shape) == 5, np.inf, 0).astype(dtype))
    gc.collect()
    address, in_use = _buffer_address(variable), _in_use()
    restore_variable(variable, saved)
    gc.collect()
    restored = variable.numpy()
    assert restored.tobytes() == saved.tobytes(), "the restore must be bit-exact (signs of zeros included)"
    if case == "finite":  # the exact in-place path: the same buffer, the same memory in use
        assert _buffer_address(variable) == address
        assert _in_use() == in_use


def test_fit_to_budget_restore_leaves_the_memory_in_use_as_calibration_measured_it():
    """A step that leaves its weights alone (it sums their gradients, as the benchmark's steps do)
    and counts its runs: restoring must not give the weights new buffers, which the allocator
    would count afresh, and must put the counter back."""
    mlp = MLP(seed=2)
    plain, resident = mlp.plain_plan()
    budget = int(resident + 0.6 * (plain - resident))
    runs = tf.Variable(0.0)

    def step(x):
        grads = memsaving.gradients(mlp.loss(x), mlp.weights, checkpoints="memory", budget=budget,
                                    multilevel=True)
        runs.assign_add(1.0)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    for w in mlp.weights:  # out of the host arrays they were made from, into allocator chunks as Keras' are
        w.assign(w * 1.0)
    gc.collect()
    addresses, in_use = [_buffer_address(w) for w in mlp.weights], _in_use()
    try:
        memsaving.fit_to_budget(step, mlp.x, budget=budget, max_rounds=2, restore_variables=True)
    except memsaving.BudgetError:
        pass  # the restore runs either way
    gc.collect()
    assert runs.numpy() == 0.0
    assert [_buffer_address(w) for w in mlp.weights] == addresses
    # Traced functions hold a few small constants; the weights (768 KiB here) did not move or grow.
    assert abs(_in_use() - in_use) < 64 * 1024


# Keras: enable(budget=...) calibrates by itself during fit.

def _keras_mlp(use_bias):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,))]
                             + [keras.layers.Dense(256, activation="relu", use_bias=use_bias) for _ in range(10)]
                             + [keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


KERAS_BATCH = 2048


def _keras_data(rows=2 * KERAS_BATCH):
    rng = np.random.default_rng(0)
    return rng.standard_normal((rows, 16)).astype("float32"), rng.integers(0, 4, rows)


class StepPeaks(keras.callbacks.Callback):
    """The allocator's peak during each training step (reset before it, read after)."""

    def __init__(self):
        super().__init__()
        self.peaks = []

    def on_train_batch_begin(self, batch, logs=None):
        tf.config.experimental.reset_memory_stats("CPU:0")

    def on_train_batch_end(self, batch, logs=None):
        self.peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])


def _keras_budget(fraction):
    """A budget between the memory-mode prediction and the plain one (predicted, batch KERAS_BATCH)."""
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, verbose=False)
    x, y = _keras_data(KERAS_BATCH)
    model.train_on_batch(x, y)
    plan = mkeras.plan_of(model)
    return int(plan.resident_bytes + fraction * (plan.plain_peak - plan.resident_bytes))


class HoldAfterFirstStep(keras.callbacks.Callback):
    """Holds a tensor of ``nbytes`` during the second training step, as a cache or a metric that
    grows once training runs would: memory that was not there when the first plan was made (at
    the first step's trace), so the first plan, judged on its first steps, measures above its
    prediction by about that much, whatever the simulator predicts (calibration exists for
    this case).  Later steps, and the retrace after the round, run without it."""

    def __init__(self, nbytes: int = 4 * MiB):
        super().__init__()
        self.steps = 0
        self.held = None
        self.nbytes = nbytes

    def on_train_batch_begin(self, batch, logs=None):
        if self.steps == 1:
            self.held = tf.ones([self.nbytes // 4], tf.float32)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        self.held = None


def keras_calibration_figures() -> dict:
    """Keras ``fit`` under a budget: the rounds, what was printed, the plan's record, and the
    peaks of the steps of one more epoch after calibration (for the test below)."""
    import contextlib
    import io

    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=True, multilevel=True)
    x, y = _keras_data()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=3, shuffle=False, verbose=0)
    report = mkeras.calibration_of(model)
    _show("keras fit", report.rounds, budget)
    plan = mkeras.plan_of(model)
    figures = {"budget": budget, "printed": printed.getvalue(), "fits": report.fits, "chosen": report.chosen,
               "rounds": [{"planned_for": r.planned_for, "predicted": r.predicted_peak, "measured": r.measured_peak}
                          for r in report.rounds],
               "plan_budget": plan.budget, "plan_recorded": plan in report.plans,
               "measured_peak": report.measured_peak, "table": report.table()}
    # After calibration, training steps are not replanned and stay within the budget as measured.
    peaks = StepPeaks()
    model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[peaks])
    print("  later steps measured: " + ", ".join(f"{p / MiB:.3f}" for p in peaks.peaks) + " MiB")
    figures.update(later_peaks=peaks.peaks,
                   planned_after=[r.planned_for for r in mkeras.calibration_of(model).rounds])
    return figures


def test_keras_enable_budget_calibrates_from_below_during_fit():
    """Run in a process of its own, so that no tensor an earlier test left behind moves the peaks.
    A later step may still measure inside the room calibration keeps (one did in a full run, with
    other tests' processes beside it): then calibration starts again, lower, as it is built to."""
    figures = in_a_fresh_process("test_fit_budget", "keras_calibration_figures")
    budget, rounds = figures["budget"], figures["rounds"]
    assert figures["printed"].count("calibration round") == len(rounds) >= 1
    assert rounds[0]["planned_for"] < budget and rounds[0]["measured"] <= budget
    assert all(r["predicted"] <= budget for r in rounds)
    assert figures["fits"] and figures["chosen"] is not None
    assert figures["plan_budget"] == budget and figures["plan_recorded"]
    assert f"measured peak {figures['measured_peak'] / MiB:.1f} MiB" in figures["table"]
    planned_after = figures["planned_after"]
    assert planned_after[:len(rounds)] == [r["planned_for"] for r in rounds]
    # a creep is recorded as a round of the chosen plan, and the next trace plans lower
    chosen = rounds[figures["chosen"]]["planned_for"]
    assert all(later <= chosen for later in planned_after[len(rounds):]), \
        "a later step replanned, but not lower"
    assert max(figures["later_peaks"]) <= budget


def test_a_keras_budget_error_after_rounds_leaves_the_model_as_fit_found_it(monkeypatch):
    """Every step measures twice the budget: round 1 is over, and the error measured leaves no
    plan that may run.  fit raises a BudgetError, and the steps round 1 ran are undone: the
    weights and the optimizer's step counter are as before fit (before, 3 steps stayed applied)."""
    import memsaving.keras.calibration as keras_module  # the module that reads the allocator

    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    x, y = _keras_data()
    monkeypatch.setattr(keras_module, "peak_bytes", lambda device=None: 2 * budget)
    model.optimizer.build(model.trainable_variables)
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(memsaving.BudgetError):
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    for w, value in zip(model.weights, before):
        np.testing.assert_array_equal(w.numpy(), value)


def test_keras_goes_back_to_a_measured_plan_when_no_lower_plan_may_run(monkeypatch, capsys):
    """Round 1 measures well under the budget and the calibration climbs; round 2 measures twice the
    budget, so the error measured leaves no lower plan that may run.  A plan measured under the
    budget exists (round 1's): the next trace plans it again and training goes on, as
    fit_to_budget keeps its best measured step (before, fit raised a BudgetError here)."""
    import memsaving.keras.calibration as keras_module  # the module that reads the allocator

    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=True, multilevel=True)
    x, y = _keras_data()
    calls = []

    def peak(device=None):
        calls.append(None)
        return 2 * budget if len(calls) == MEASURED_STEPS + 1 else int(0.7 * budget)

    monkeypatch.setattr(keras_module, "peak_bytes", peak)
    model.fit(x, y, batch_size=KERAS_BATCH, epochs=5, shuffle=False, verbose=0)
    printed = capsys.readouterr().out
    report = mkeras.calibration_of(model)
    _show("keras fit, round 2 at twice the budget", report.rounds, budget)
    assert len(report.rounds) == 2 and report.rounds[0].fits(budget) and not report.rounds[1].fits(budget)
    assert report.chosen == 0 and report.fits
    assert "back to the plan of round 1" in printed
    assert int(model.optimizer.iterations.numpy()) == 5 * 2


def test_keras_goes_lower_when_a_round_measures_over_the_budget():
    """Memory the first plan did not see (a tensor of half the budget held during the second
    step) puts its round over the budget: the next trace plans lower, or, when the error measured
    says no lower plan would fit, fit stops with a BudgetError listing the round."""
    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    x, y = _keras_data()
    hold = HoldAfterFirstStep(MiB * (budget // MiB // 2))
    error = None
    try:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[hold])
    except memsaving.BudgetError as raised:
        error = raised
    rounds = mkeras.calibration_of(model).rounds
    _show("keras fit, a tensor held during step 2", rounds, budget)
    assert not rounds[0].fits(budget)
    if error is None:
        assert len(rounds) >= 2 and rounds[1].planned_for < rounds[0].planned_for
    else:
        assert "error measured so far" in str(error) and "round 1:" in str(error)


def test_keras_calibration_raises_with_the_measured_figures():
    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=True)
    mkeras.enable(model, budget=budget, verbose=False, calibration_rounds=1, multilevel=True)
    x, y = _keras_data()
    with pytest.raises(memsaving.BudgetError) as caught:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[HoldAfterFirstStep(MiB * (budget // MiB // 4))])
    report = mkeras.calibration_of(model)
    _show("keras fit, calibration_rounds=1", report.rounds, budget)
    message = str(caught.value)
    assert "round 1: planned for" in message
    assert caught.value.smallest_budget > budget


def _calibrator_of(model):
    return model.__dict__["_memsaving_settings"]["calibrator"]


def creeping_keras_figures() -> dict:
    """Keras ``fit`` where the first step of the chosen plan measures a quarter MiB into the room
    the chosen round keeps free; returns the rounds and the step count for the test below."""
    import memsaving.keras.calibration as keras_module  # the module that reads the allocator

    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    x, y = _keras_data()
    calibrator = _calibrator_of(model)
    real_peak = keras_module.peak_bytes
    crept = []

    def peak(device=None):
        if calibrator.final and not calibrator.plans and not crept:  # a step of the chosen plan, not a retrace
            # a quarter MiB into the room the chosen round keeps: a creep to just under the budget
            # itself made the measured error refuse every lower plan, and fit raised instead
            engine = calibrator.engine
            crept.append(budget - engine.rounds[engine.best].room(budget) + MiB // 4)
            return crept[0]
        return real_peak(device)

    keras_module.peak_bytes = peak
    try:
        # enough steps for two climbing rounds, a return to the first plan, the creep and a lower round
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=10, shuffle=False, verbose=0)
    finally:
        keras_module.peak_bytes = real_peak
    rounds = mkeras.calibration_of(model).rounds
    _show("keras fit, a step after calibration measured just under the budget", rounds, budget)
    return {"budget": budget, "crept": crept, "steps": int(model.optimizer.iterations.numpy()),
            "rounds": [{"measured": r.measured_peak, "planned_for": r.planned_for, "fits": r.fits(budget)}
                       for r in rounds]}


def test_a_keras_step_that_creeps_into_the_room_after_calibration_sends_the_next_plan_lower():
    """After calibration every step is still measured: one whose peak crept into the room it keeps
    free under the budget (where the next creep is an out-of-memory error on a device) is
    judged again, and the next trace plans lower; training goes on.  Before, such steps went
    unwatched until one ran out of memory (EfficientNetB0 under a 98 MiB cap, step 20).

    Run in a process of its own: in a worker where earlier tests left tensors and free chunks
    behind, the same plan measured 37.2 MiB in one round and 42.5 in the next, and the rounds
    this test reads were moved by that rather than by the creep."""
    figures = in_a_fresh_process("test_fit_budget", "creeping_keras_figures")
    rounds, crept = figures["rounds"], figures["crept"]
    assert crept, "no step of the chosen plan was measured after calibration"
    steady = next(i for i, r in enumerate(rounds) if r["measured"] == crept[0])
    assert not rounds[steady]["fits"] and rounds[steady]["measured"] <= figures["budget"]
    assert len(rounds) > steady + 1, "the next trace was measured as a round"
    assert rounds[steady + 1]["planned_for"] < rounds[steady]["planned_for"]
    assert figures["steps"] == 10 * 2  # no step lost or repeated


def test_a_keras_step_out_of_memory_after_calibration_reruns_fit_on_a_lower_plan():
    """A step of the chosen plan raises ResourceExhaustedError (as a device does when the allocator's
    chunks moved since calibration): the variables are put back as fit found them, the plan is
    judged out of memory, and fit runs again on a lower plan, to the end.  When the chosen plan is
    the planner's lowest (the budget's rounds decide, and they vary from run to run), nothing lower
    exists: fit raises a BudgetError with no step counted."""
    budget = _keras_budget(0.8)
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    x, y = _keras_data()
    calibrator = _calibrator_of(model)

    class OutOfMemoryOnce(keras.callbacks.Callback):
        raised = 0
        on_lowest = None

        def on_train_batch_begin(self, batch, logs=None):
            if calibrator.final and not OutOfMemoryOnce.raised:
                OutOfMemoryOnce.raised += 1
                OutOfMemoryOnce.on_lowest = calibrator.engine.rounds[calibrator.engine.best].lowest
                raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor (scripted)")

    try:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=5, shuffle=False, verbose=0, callbacks=[OutOfMemoryOnce()])
    except memsaving.BudgetError as error:
        assert int(model.optimizer.iterations.numpy()) == 0
        if OutOfMemoryOnce.on_lowest:
            assert "lowest plan ran out of memory after calibration" in str(error)
            return
        # No lower plan may run: either the planner's plan for the lower target is predicted no lower
        # than the plan that ran out of memory (an MLP's plans lie within a few hundred KiB), or the
        # out-of-memory step, counted as measured at the budget, raised the error ratio so far that
        # the lowest plan no longer fits with room for it (the error then names a higher budget).
        failed = next(r for r in error.calibration.rounds if r.out_of_memory)
        lowest = re.search(r"the lowest plan found is predicted at ([\d,]+) bytes", str(error))
        no_lower_plan = bool(lowest) and int(lowest.group(1).replace(",", "")) >= failed.predicted_peak
        no_room = error.smallest_budget is not None and error.smallest_budget > budget
        assert no_lower_plan or no_room, f"a BudgetError though a lower plan fits: {error}"
        return
    rounds = mkeras.calibration_of(model).rounds
    _show("keras fit, a step after calibration out of memory", rounds, budget)
    assert OutOfMemoryOnce.raised == 1 and not OutOfMemoryOnce.on_lowest
    failed = next(i for i, r in enumerate(rounds) if r.out_of_memory)
    assert rounds[failed + 1].planned_for < rounds[failed].planned_for
    assert mkeras.calibration_of(model).fits
    assert int(model.optimizer.iterations.numpy()) == 5 * 2  # the steps before the error were undone


def _keras_probe_budget(model, x, y) -> int:
    """A budget Keras' calibration refuses ``model`` on the 30% prior while the lowest plan meets
    it as predicted (:func:`_midway`), as :func:`_probe_budget`: from a refusal of the same model,
    so that the memory in use before its step is the same (a model refused before, and not yet
    collected, moved it by a MiB, and the prior then admitted a plan)."""
    mkeras.enable(model, budget=_keras_budget(0.0), verbose=False, multilevel=True)
    with pytest.raises(memsaving.BudgetError) as caught:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0)
    return _midway(caught.value)


def test_keras_probes_a_budget_the_prior_refuses_where_running_out_of_memory_raises(monkeypatch):
    """As fit_to_budget: on a device whose out-of-memory errors raise, the lowest plan the prior
    forbids is measured once.  Keras' steps measure up to a quarter above their predictions, so
    the probe may fit (fit trains every step) or not (a BudgetError, its steps undone): either
    way it ran, and no step of a refused budget counts."""
    import memsaving.keras.calibration as keras_module  # the module that reads the allocator

    monkeypatch.setattr(keras_module, "out_of_memory_raises", lambda device=None: True)
    x, y = _keras_data()
    model = _keras_mlp(use_bias=False)
    budget = _keras_probe_budget(model, x, y)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    try:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=3, shuffle=False, verbose=0)
    except memsaving.BudgetError as error:
        assert "lowest plan measures over the budget" in str(error)
        assert mkeras.calibration_of(model).rounds[0].probe
        assert int(model.optimizer.iterations.numpy()) == 0
        return
    report = mkeras.calibration_of(model)
    _show("keras fit, a probe of the lowest plan", report.rounds, budget)
    assert report.rounds[0].probe and report.fits
    assert int(model.optimizer.iterations.numpy()) == 3 * 2


def test_a_keras_probe_that_runs_out_of_memory_counts_no_step(monkeypatch):
    import memsaving.keras.calibration as keras_module  # the module that reads the allocator

    monkeypatch.setattr(keras_module, "out_of_memory_raises", lambda device=None: True)

    class OutOfMemory(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor (scripted)")

    x, y = _keras_data()
    model = _keras_mlp(use_bias=False)
    budget = _keras_probe_budget(model, x, y)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    with pytest.raises(memsaving.BudgetError, match="lowest plan measures over the budget"):
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[OutOfMemory()])
    (probe,) = mkeras.calibration_of(model).rounds
    assert probe.probe and probe.out_of_memory
    assert int(model.optimizer.iterations.numpy()) == 0


def test_keras_refuses_a_budget_below_every_plan_before_the_first_step():
    plan_budget = _keras_budget(0.0)  # the resident bytes: no plan fits
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=plan_budget, verbose=False, multilevel=True)
    x, y = _keras_data()
    with pytest.raises(memsaving.BudgetError, match="Nothing was run"):
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def keras_hard_limit_figures(steps: int = 20) -> dict:
    """``enable(model, budget=...)`` and ``fit`` for ``steps`` steps, the CPU allocator capped at the
    budget (TF_CPU_BFC_MEM_LIMIT_IN_MB); a BudgetError is returned as its first line."""
    budget = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MiB
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget=budget, verbose=False, multilevel=True)
    x, y = _keras_data(steps * KERAS_BATCH)
    tf.config.experimental.reset_memory_stats("CPU:0")
    refused = None
    try:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0)
    except memsaving.BudgetError as error:
        refused = str(error).splitlines()[0]
    return {"steps": int(model.optimizer.iterations.numpy()), "budget": budget,
            "peak": int(tf.config.experimental.get_memory_info("CPU:0")["peak"]),
            "rounds": [r.describe(budget) for r in mkeras.calibration_of(model).rounds], "refused": refused}


def keras_budget_figures(fraction: float) -> int:
    return _keras_budget(fraction)


def test_keras_fit_under_a_hard_memory_limit_trains_or_refuses_with_its_state_intact():
    """Under the cap ``fit`` never crashes and never loses the training state: it trains every
    step, or a step runs out of memory during calibration, the variables go back as ``fit``
    began, and it either trains on a lower plan or raises a BudgetError with no step counted.

    Which of these happens varies from run to run: Keras' steps measure up to a quarter above
    their plans' predictions (predicted 15.9 MiB, measured 19.9), more than the known error, so the
    first round can run out of memory under the cap; in one fresh run out of four no lower plan
    was left that the error measured allowed, and ``fit`` raised."""
    budget = in_a_fresh_process("test_fit_budget", "keras_budget_figures", 0.8, test_settings=False)
    figures = in_a_fresh_process("test_fit_budget", "keras_hard_limit_figures", test_settings=False,
                                 environment={"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(budget // MiB)})
    print(f"keras under a {budget // MiB} MiB cap: {figures['steps']} steps, rounds {figures['rounds']}, "
          f"refused: {figures['refused']}")
    assert figures["peak"] <= figures["budget"]
    if figures["refused"] is None:
        assert figures["steps"] == 20
    else:
        assert figures["steps"] == 0 and "out of memory" in " ".join(figures["rounds"])


def test_train_on_batch_is_measured_once_per_trace():
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget="1GiB", verbose=False)
    x, y = _keras_data(256)
    for _ in range(MEASURED_STEPS + 1):  # one step more than a round measures
        model.train_on_batch(x, y)
    report = mkeras.calibration_of(model)
    assert len(report.rounds) == 1 and report.fits and report.chosen == 0
    mkeras.enable(model, budget="1GiB", calibration_rounds=0, verbose=False)
    assert mkeras.calibration_of(model) is None


def test_keras_judges_a_trace_on_its_highest_step_and_records_the_spread(monkeypatch):
    """The allocator's peaks after each measured step are scripted: the round is judged on the
    highest of its MEASURED_STEPS steps, and its spread (highest less lowest of the steps after
    the first, the graph's first run, which also allocates once-only buffers) is recorded, which
    a BudgetError's smallest_budget adds when above 2%."""
    scripted = [100 * MiB, 140 * MiB, 120 * MiB, 110 * MiB] + [999 * MiB] * 4
    assert len(scripted) > MEASURED_STEPS >= 2
    read = iter(scripted)
    import memsaving.keras.calibration as keras_module  # the module that reads the allocator

    monkeypatch.setattr(keras_module, "peak_bytes", lambda device=None: next(read))
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget="1GiB", verbose=False)
    x, y = _keras_data(256)
    for _ in range(MEASURED_STEPS + 1):
        model.train_on_batch(x, y)
    (round_,) = mkeras.calibration_of(model).rounds
    steps = scripted[:MEASURED_STEPS]
    assert round_.measured_peak == max(steps) and round_.spread == max(steps[1:]) - min(steps[1:])


# Bad input.

def test_bad_input_errors():
    mlp = MLP()
    with pytest.raises(TypeError, match="budget"):
        memsaving.fit_to_budget(mlp.step("8MiB"), mlp.x)  # pylint: disable=missing-kwoa
    with pytest.raises(ValueError, match="needs budget="):
        memsaving.fit_to_budget(mlp.step("8MiB"), mlp.x, budget=None)
    with pytest.raises(ValueError, match="cannot read memory budget"):
        memsaving.fit_to_budget(mlp.step("8MiB"), mlp.x, budget="8 megs")
    with pytest.raises(TypeError, match="step_fn must be the training step"):
        memsaving.fit_to_budget("train_step", mlp.x, budget="8MiB")
    with pytest.raises(ValueError, match="max_rounds"):
        memsaving.fit_to_budget(mlp.step("8MiB"), mlp.x, budget="8MiB", max_rounds=0)

    def no_budget(x):
        return tf.add_n(memsaving.gradients(mlp.loss(x), mlp.weights, checkpoints="memory"))

    with pytest.raises(ValueError, match=r"must call memsaving.gradients\(\.\.\., budget=\.\.\.\)") as caught:
        memsaving.fit_to_budget(no_budget, mlp.x, budget="8MiB")
    assert "none with budget=" in str(caught.value)

    def no_memsaving(x):
        return tf.add_n(tf.gradients(mlp.loss(x), mlp.weights))

    with pytest.raises(ValueError, match="made no memsaving.gradients call"):
        memsaving.fit_to_budget(no_memsaving, mlp.x, budget="8MiB")
    with pytest.raises(ValueError, match="calibration_rounds"):
        mkeras.enable(_keras_mlp(False), budget="8MiB", calibration_rounds=-1)
    with pytest.raises(ValueError, match="cannot read memory budget"):
        mkeras.enable(_keras_mlp(False), budget="8 megs")


def test_a_tf_function_step_is_traced_again_each_round():
    mlp = MLP()
    budget = 64 * MiB  # fits in a round or two: the first measures within a few KiB of 90% of it
    step = memsaving.fit_to_budget(tf.function(mlp.step(budget)), mlp.x, budget=budget)
    # a round after the first plans only if the tf.function was unwrapped (else a ValueError says so)
    assert step.calibration.fits and step.calibration.plans
    assert all(plan.budget == budget for plan in step.calibration.plans)


# ----------------------------------------------------------------------------- memsaving.function(budget=)


def _tape_step(mlp, budget):
    """The MLP's training step written with a GradientTape, under memsaving.function(budget=)."""
    @memsaving.function(checkpoints="memory", budget=budget)
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = mlp.loss(x)
        for w, g in zip(mlp.weights, tape.gradient(loss, mlp.weights)):
            w.assign_sub(1e-3 * g)
        return loss
    return train_step


def function_hard_limit_figures(steps: int = 20) -> dict:
    """memsaving.function(budget=) on a tape step: its first call calibrates, then ``steps`` calls,
    in a process whose CPU allocator is capped at the budget."""
    mlp = MLP(seed=3, unseen_copies=0)
    budget = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"]) * MiB
    step = _tape_step(mlp, budget)
    for _ in range(steps):
        step(mlp.x).numpy()
    return {"rounds": [r.measured_peak for r in step.calibration.rounds],
            "peak": int(tf.config.experimental.get_memory_info("CPU:0")["peak"]), "budget": budget}


def test_memsaving_function_with_a_budget_trains_under_a_hard_memory_limit():
    """A tape loop switched with @memsaving.function(budget=...) keeps the budget as fit_to_budget
    does: every call, the first one's calibration included, runs under the capped allocator.  (At 0.6
    of the step's memory this MLP needs a multi-level plan, which memsaving.function does not offer.)"""
    budget_mib = _capped_budget_mib(0.8)
    figures = in_a_fresh_process("test_fit_budget", "function_hard_limit_figures", test_settings=False,
                                 environment={"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(budget_mib)})
    assert figures["rounds"]
    assert figures["peak"] <= figures["budget"]
    assert all(peak <= figures["budget"] for peak in figures["rounds"])


def test_memsaving_function_refuses_a_budget_below_every_plan_before_any_step():
    mlp = MLP(seed=2, unseen_copies=0)
    _, resident = mlp.plain_plan()
    before = [w.numpy() for w in mlp.weights]
    step = _tape_step(mlp, resident + 1)
    with pytest.raises(memsaving.BudgetError, match="Nothing was run") as refused:
        step(mlp.x)
    assert str(refused.value).startswith("memsaving.function (train_step): ")  # the entry point the user called
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, mlp.weights))
