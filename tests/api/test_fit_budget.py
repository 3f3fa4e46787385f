"""memsaving.fit_to_budget and Keras' calibration: budgets that hold as measured.

The planner meets a budget as *predicted*; these tests run real steps,
measure the allocator's peak, and check that the calibration replans for a
lower budget until the measured peak fits, or says with the measured figures
that it cannot.  ``pytest tests/api/test_fit_budget.py -s`` prints every round.
"""

import gc
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
import memsaving.keras as mkeras
from memsaving.fit_budget import HEADROOM, MEASURED_STEPS, SLACK, TRACES_AHEAD

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
            grads = memsaving.gradients(loss, self.weights, checkpoints="memory", budget=budget)
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


def _lowest_plus_slack(rounds, held_per_trace=0):
    """What BudgetError.smallest_budget must be: the lowest measured peak plus SLACK of it (or
    that round's spread, when larger), plus TRACES_AHEAD times what each trace left on the device
    (fit_to_budget's errors)."""
    lowest = min(rounds, key=lambda r: r.measured_peak)
    return (lowest.measured_peak + max(math.ceil(SLACK * lowest.measured_peak), lowest.spread)
            + TRACES_AHEAD * held_per_trace)


def _show(title, rounds, budget):
    print(f"\n{title}: budget {budget / MiB:.3f} MiB")
    for n, r in enumerate(rounds, 1):
        print(f"  round {n}: planned for {r.planned_for / MiB:.3f} MiB, predicted {r.predicted_peak / MiB:.3f} MiB, "
              f"measured {r.measured_peak / MiB:.3f} MiB")


def _calibrate(mlp, budget, **options):
    """fit_to_budget's outcome: (rounds, the returned step or the BudgetError)."""
    try:
        step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, **options)
        return step.calibration.rounds, step
    except memsaving.BudgetError as error:
        assert error.calibration is not None, "fit_to_budget's BudgetError carries its rounds"
        return error.calibration.rounds, error


_NONE_OVER = ("no budget at {} of the plain activation peak measured above itself in round 1: "
              "the simulator now predicts this step's peak; choose a step whose peak it misses")


def _over_budget(mlp, max_rounds, fractions=(0.7, 0.6, 0.5, 0.4)):
    """The first budget (fractions of the plain activation peak, predicted) whose first plan
    measures above it: the case calibration exists for."""
    plain, resident = mlp.plain_plan()
    for fraction in fractions:
        budget = int(resident + fraction * (plain - resident))
        rounds, outcome = _calibrate(mlp, budget, max_rounds=max_rounds, restore_variables=True)
        if rounds and rounds[0].measured_peak > budget:
            return budget, rounds, outcome
    pytest.fail(_NONE_OVER.format(fractions))


def test_fit_to_budget_replans_until_the_measured_peak_fits():
    mlp = MLP()
    budget, rounds, outcome = _over_budget(mlp, max_rounds=4)
    _show("fit_to_budget, MLP", rounds, budget)
    # The margin made the planner plan for less: round 2 planned for the budget minus
    # round 1's measured excess and the slack, and every plan met its lowered budget as predicted.
    assert len(rounds) >= 2 or isinstance(outcome, memsaving.BudgetError)
    if len(rounds) >= 2:
        room = max(math.ceil(HEADROOM * budget), rounds[0].spread)  # the headroom, or the runs' spread
        expected = min(budget - (rounds[0].measured_peak - budget) - room - math.ceil(SLACK * budget),
                       rounds[0].predicted_peak - 1)
        assert rounds[1].planned_for == expected
        assert rounds[1].planned_for < rounds[0].predicted_peak < budget
        assert rounds[1].predicted_peak < rounds[0].predicted_peak  # the planner saw the lower budget
    assert rounds[0].planned_for == budget
    # each plan met its lowered budget as predicted, or no plan did and the planner gave its lowest
    assert all(r.predicted_peak <= r.planned_for or r.lowest for r in rounds)
    assert not any(r.lowest for r in rounds[:-1])  # nothing is lower than the lowest plan: it ends calibration
    assert all(later.planned_for < earlier.planned_for for earlier, later in zip(rounds, rounds[1:]))
    if isinstance(outcome, memsaving.BudgetError):
        message = str(outcome)
        assert "round 1: planned for" in message and "measured" in message
        assert outcome.smallest_budget == _lowest_plus_slack(rounds, outcome.calibration.held_per_trace)
        return
    step = outcome
    report = step.calibration
    returned = rounds[-1 if report.chosen is None else report.chosen]
    assert report.fits and report.measured_peak == returned.measured_peak <= budget
    assert report.margin == budget - returned.planned_for > 0
    plan = report.plans[0]
    assert plan.budget == budget and plan.measured_peak == returned.measured_peak
    assert plan.predicted_peak <= returned.planned_for or returned.lowest
    text = plan.table()
    assert f"measured peak {plan.measured_peak / MiB:.1f} MiB (budget {budget / MiB:.1f} MiB)" in text
    # The returned function is traced: running it again does not replan. Its peak still fits,
    # give or take one activation (a step's peak moves by a tensor or two from run to run).
    again = memsaving.measure_peak(step, mlp.x)
    print(f"  the returned step measured again: {again / MiB:.3f} MiB")
    assert len(report.plans) == 1
    assert again <= budget + BATCH * WIDTH * 4
    # A retrace for another input shape plans with the same margin (and gets the planner's
    # lowest plan, as the returned round did, when nothing is predicted under it: in a long
    # pytest process the allocator holds more before the step, and the lowest plan was returned).
    step(mlp.x[: BATCH // 2])
    assert len(report.plans) == 2
    assert report.plans[1].predicted_peak <= budget - report.margin or returned.lowest


def _scripted_peaks(monkeypatch, fractions, budget):
    """Make fit_to_budget read ``fractions[k] * budget`` as the peak of round k+1 (every one of
    its measured steps; a tuple gives its steps in turn), so what it does with a peak inside the
    headroom is tested exactly."""
    import memsaving.fit_budget as fit_budget
    steps, calls = [], []

    def measure(step, *args, **kwargs):
        if not steps or steps[-1] is not step:
            steps.append(step)  # a new round's step
            calls.clear()
        calls.append(step)
        fraction = fractions[min(len(steps) - 1, len(fractions) - 1)]
        if isinstance(fraction, tuple):
            fraction = fraction[(len(calls) - 1) % len(fraction)]
        return int(fraction * budget)

    monkeypatch.setattr(fit_budget, "measure_peak", measure)


def test_a_peak_within_the_headroom_is_replanned_and_returned_when_nothing_fits_better(monkeypatch):
    """Round 1 fits only within the headroom, round 2 is over: round 1's step is returned."""
    mlp = MLP()
    plain, resident = mlp.plain_plan()
    budget = int(resident + 0.6 * (plain - resident))
    _scripted_peaks(monkeypatch, [1 - HEADROOM / 2, 1.1], budget)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=2)
    report = step.calibration
    assert len(report.rounds) == 2 and report.chosen == 0
    assert report.fits and report.measured_peak == report.rounds[0].measured_peak
    assert report.margin == 0 and report.plans[0].measured_peak == report.rounds[0].measured_peak
    # round 2 aimed below the budget less the headroom
    assert report.rounds[1].planned_for < budget - math.ceil(HEADROOM * budget)


def test_a_round_whose_runs_differ_by_more_than_the_headroom_needs_that_much_room(monkeypatch):
    """Round 1's runs alternate between two peaks 4% of the budget apart: its highest, 2% under
    the budget, fits the headroom but not the spread, so round 2 plans lower and, steady, is
    returned."""
    mlp = MLP()
    plain, resident = mlp.plain_plan()
    budget = int(resident + 0.6 * (plain - resident))
    first = (1 - 6 * HEADROOM, 1 - 2 * HEADROOM)
    _scripted_peaks(monkeypatch, [first, 1 - 8 * HEADROOM], budget)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=3)
    rounds = step.calibration.rounds
    assert len(rounds) == 2 and step.calibration.chosen is None
    assert rounds[0].measured_peak == int(first[1] * budget)
    spread = int(first[1] * budget) - int(first[0] * budget)
    margin = max(rounds[0].measured_peak + spread - budget + math.ceil(SLACK * budget),
                 budget - rounds[0].predicted_peak + 1)
    assert rounds[1].planned_for == budget - margin  # the spread, not the 2% headroom, was taken off


def test_smallest_budget_allows_for_the_spread_of_the_lowest_rounds_runs():
    from memsaving.fit_budget import CalibrationRound, smallest_measured_budget
    steady = [CalibrationRound(1000, 990, 2000, spread=10), CalibrationRound(900, 890, 1500, spread=5)]
    assert smallest_measured_budget(steady) == 1500 + 30  # 2% of the lowest peak
    moving = [CalibrationRound(1000, 990, 2000), CalibrationRound(900, 890, 1500, spread=120)]
    assert smallest_measured_budget(moving, held_per_trace=7) == 1500 + 120 + TRACES_AHEAD * 7


def test_a_lower_plan_is_tried_when_the_resident_memory_grew_between_traces():
    """The lowest plan of a later trace can be predicted at the last plan's peak only because the
    device held more when it was traced (a step that keeps memory at each trace): above the resident
    bytes it is lower, and worth measuring.  The same plan again is not."""
    from memsaving.fit_budget import CalibrationRound, nothing_lower_to_try
    last = CalibrationRound(planned_for=10 * MiB, predicted_peak=9 * MiB, measured_peak=11 * MiB, resident=4 * MiB)
    # planned for 8 MiB, predicted 9 MiB: the planner's lowest plan
    assert not nothing_lower_to_try([last], 8 * MiB, 9 * MiB, resident=5 * MiB)
    assert nothing_lower_to_try([last], 8 * MiB, 9 * MiB, resident=4 * MiB)
    assert nothing_lower_to_try([last], 8 * MiB, 10 * MiB, resident=5 * MiB)
    assert not nothing_lower_to_try([], 8 * MiB, 9 * MiB)


def test_room_needed_examples():
    import doctest

    from memsaving import fit_budget as module
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(module) if t.name.endswith("room_needed")]
    runner = doctest.DocTestRunner()
    runner.run(tests[0])
    assert tests[0].examples and runner.failures == 0


def test_a_peak_below_the_headroom_ends_calibration(monkeypatch):
    mlp = MLP()
    plain, resident = mlp.plain_plan()
    budget = int(resident + 0.6 * (plain - resident))
    _scripted_peaks(monkeypatch, [1 - 2 * HEADROOM], budget)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=2)
    assert len(step.calibration.rounds) == 1 and step.calibration.chosen is None


def test_nothing_within_the_budget_still_raises(monkeypatch):
    mlp = MLP()
    plain, resident = mlp.plain_plan()
    budget = int(resident + 0.6 * (plain - resident))
    _scripted_peaks(monkeypatch, [1.1, 1.05], budget)
    with pytest.raises(memsaving.BudgetError) as caught:
        memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=2)
    assert len(caught.value.calibration.rounds) == 2


def test_smallest_budget_of_the_error_fits_when_measured():
    mlp = MLP(seed=1)
    before = [w.numpy() for w in mlp.weights]
    budget, rounds, error = _over_budget(mlp, max_rounds=1)
    _show("fit_to_budget, max_rounds=1", rounds, budget)
    assert isinstance(error, memsaving.BudgetError)
    for w, value in zip(mlp.weights, before):  # restore_variables=True undid the calibration's steps
        np.testing.assert_array_equal(w.numpy(), value)
    smallest = error.smallest_budget
    assert smallest == _lowest_plus_slack(rounds, error.calibration.held_per_trace) > budget
    assert "max_rounds=1" in str(error) and "round 1: planned for" in str(error)
    step = memsaving.fit_to_budget(mlp.step(smallest), mlp.x, budget=smallest, max_rounds=6)
    _show("fit_to_budget at the error's smallest budget", step.calibration.rounds, smallest)
    assert step.calibration.measured_peak <= smallest


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
        grads = memsaving.gradients(mlp.loss(x), mlp.weights, checkpoints="memory", budget=budget)
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


def test_a_budget_below_every_plan_as_predicted_measures_the_lowest_plan():
    """No plan fits even as predicted: the lowest plan is measured anyway, and the error's
    smallest budget is that measured figure, which holds when it is passed back.  The step holds
    no unseen buffer here: when the executor makes that buffer varies from trace to trace
    (the lowest plan measured 9.2 to 11.1 MiB), and the measured smallest budget is one
    trace's figure plus 2%."""
    mlp = MLP(seed=2, unseen_copies=0)
    plain, resident = mlp.plain_plan()
    budget = resident + 1
    with pytest.raises(memsaving.BudgetError, match="even as predicted") as caught:
        memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, restore_variables=True)
    rounds = caught.value.calibration.rounds
    _show("fit_to_budget below every plan", rounds, budget)
    assert len(rounds) == 1, "the lowest plan was measured, and nothing lower is left to try"
    assert rounds[0].lowest and rounds[0].planned_for == budget < rounds[0].predicted_peak
    assert "measures above it" in str(caught.value)
    smallest = caught.value.smallest_budget
    assert smallest == _lowest_plus_slack(rounds, caught.value.calibration.held_per_trace)
    step = memsaving.fit_to_budget(mlp.step(smallest), mlp.x, budget=smallest, max_rounds=6,
                                   restore_variables=True)
    _show("fit_to_budget at that smallest budget", step.calibration.rounds, smallest)
    assert step.calibration.measured_peak <= smallest


def per_trace_figures() -> dict:
    """The calibrations of :func:`test_memory_each_trace_leaves_on_the_device_is_in_the_smallest_budget`,
    run in a fresh process: what the device holds after earlier tests of one pytest process (a first
    calibration of a model leaves 316 or 852 KiB once; other tests leave their own) moved the
    passed-back step above its smallest budget in one full run, by more than a trace's tensor."""
    mlp = MLP(seed=2, unseen_copies=0)
    kept = []

    def keeps_a_tensor_per_trace(budget):
        body = mlp.step(budget)

        def step(x):
            with tf.init_scope():  # made eagerly at trace time, and held by the Python list
                kept.append(tf.ones([MiB // 4], tf.float32))
            return body(x)
        return step

    plain, resident = mlp.plain_plan()
    budget = resident + 1
    figures = {}
    # The same calibration without the kept tensor first: the device keeps some memory once, after
    # a first calibration of a model, which one trace cannot tell from memory kept per trace.
    try:
        memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, restore_variables=True)
        figures["first_refused"] = False
    except memsaving.BudgetError:
        figures["first_refused"] = True
    try:
        memsaving.fit_to_budget(keeps_a_tensor_per_trace(budget), mlp.x, budget=budget, restore_variables=True)
        return dict(figures, second_refused=False)
    except memsaving.BudgetError as error:
        rounds = error.calibration.rounds
        _show("fit_to_budget, a step keeping 1 MiB per trace", rounds, budget)
        held = error.calibration.held_per_trace
        figures.update(second_refused=True, says_per_trace="more per trace of the step" in str(error),
                       rounds=len(rounds), kept=len(kept), held=held, smallest=error.smallest_budget,
                       lowest_plus_slack=_lowest_plus_slack(rounds, held))
    try:
        step = memsaving.fit_to_budget(keeps_a_tensor_per_trace(figures["smallest"]), mlp.x,
                                       budget=figures["smallest"], max_rounds=6, restore_variables=True)
    except memsaving.BudgetError as error:
        _show("fit_to_budget at that smallest budget", error.calibration.rounds, figures["smallest"])
        lowest_runs = [r.measured_peak - r.spread for r in error.calibration.rounds]
        return dict(figures, passed_back_error=str(error), lowest_runs=lowest_runs)
    _show("fit_to_budget at that smallest budget", step.calibration.rounds, figures["smallest"])
    return dict(figures, passed_back_error="", kept_after=len(kept), measured=step.calibration.measured_peak)


def test_memory_each_trace_leaves_on_the_device_is_in_the_smallest_budget():
    """A step that keeps a 1 MiB tensor at each trace (some models cache tensors per trace) measures
    1 MiB higher at each calibration: the error's smallest budget allows for two more traces, and
    fits when passed back.

    In some processes the runs of one step measure up to an activation (1 MiB) apart (the order of
    ready ops varies), more than the 2% the budget allows for a step's variation, and the passed-back
    calibration can measure over with its highest run.  Its lowest run must still fit: without the
    allowance for the kept tensors it would be over by a tensor."""
    f = in_a_fresh_process("test_fit_budget", "per_trace_figures")
    assert f["first_refused"] and f["second_refused"] and f["says_per_trace"]
    assert f["kept"] == f["rounds"] == 1
    # the tensor, give or take what stays once (up to 852 KiB) or was freed meanwhile (64 KiB seen)
    assert MiB - 256 * 1024 <= f["held"] <= 2 * MiB
    assert f["smallest"] == f["lowest_plus_slack"]
    if f["passed_back_error"]:
        assert min(f["lowest_runs"]) <= f["smallest"], f["passed_back_error"]
    else:
        assert f["kept_after"] > 1 and f["measured"] <= f["smallest"]


def test_the_lowest_plan_is_returned_when_it_fits_as_measured_though_not_as_predicted(monkeypatch):
    mlp = MLP()
    plain, resident = mlp.plain_plan()
    budget = resident + 1
    _scripted_peaks(monkeypatch, [1 - 2 * HEADROOM], budget)
    step = memsaving.fit_to_budget(mlp.step(budget), mlp.x, budget=budget, max_rounds=2)
    report = step.calibration
    assert len(report.rounds) == 1 and report.fits and report.rounds[0].lowest
    assert report.margin == 0 and report.rounds[0].planned_for == budget
    assert report.plans[0].predicted_peak > budget  # above the budget as predicted, under it as measured


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
    """Holds a 4 MiB tensor during the second training step, as a cache or a metric that grows
    once training runs would: memory that was not there when the first plan was made (at the
    first step's trace), so the first plan, judged on its first two steps, measures above its
    prediction by about that much, whatever the simulator predicts (calibration exists for
    this case).  Later steps, and the retrace at the third, run without it."""

    def __init__(self):
        super().__init__()
        self.steps = 0
        self.held = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.steps == 1:
            self.held = tf.ones([MiB], tf.float32)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        self.held = None


def _keras_fit_over_budget(capsys, fractions=(0.75, 0.65, 0.55, 0.45)):
    """The first budget (fractions of the plain activation peak, predicted) whose first
    Keras training plan measures above it: (model, data, budget, error, printed output)."""
    for fraction in fractions:
        budget = _keras_budget(fraction)
        model = _keras_mlp(use_bias=False)
        mkeras.enable(model, budget=budget, verbose=True)
        x, y = _keras_data()
        try:
            model.fit(x, y, batch_size=KERAS_BATCH, epochs=3, shuffle=False, verbose=0,
                      callbacks=[HoldAfterFirstStep()])
            error = None
        except memsaving.BudgetError as raised:  # allowed, if it says what was measured
            error = raised
        printed = capsys.readouterr().out
        rounds = mkeras.calibration_of(model).rounds
        if rounds and rounds[0].measured_peak > budget:
            return model, (x, y), budget, error, printed
    pytest.fail(_NONE_OVER.format(fractions))


def test_keras_enable_budget_calibrates_during_fit(capsys):
    model, (x, y), budget, error, printed = _keras_fit_over_budget(capsys)
    report = mkeras.calibration_of(model)
    with capsys.disabled():
        _show("keras fit" + (" (BudgetError)" if error else ""), report.rounds, budget)
    rounds = report.rounds
    assert printed.count("calibration round") == len(rounds) >= 1
    assert rounds[0].planned_for == budget < rounds[0].measured_peak
    # Every retrace planned for less, and the planner met the lowered budget as predicted, or gave
    # its lowest plan, and only when that one is lower than the plan measured before it (above their
    # resident bytes, which include what the device held at each trace).  A plan that meets its
    # lowered budget may still sit higher above its resident bytes than the last one did, when the
    # device held less at its trace: budgets are about the whole peak.
    assert all(r.predicted_peak <= r.planned_for or r.lowest for r in rounds)
    assert all(later.planned_for < earlier.planned_for for earlier, later in zip(rounds, rounds[1:]))
    assert all(later.predicted_peak - later.resident < earlier.predicted_peak - earlier.resident
               for earlier, later in zip(rounds, rounds[1:]) if later.lowest)
    if error is not None:
        assert "round 1: planned for" in str(error)
        assert error.smallest_budget == _lowest_plus_slack(rounds)
        return
    assert report.fits and rounds[-1].measured_peak <= budget
    plan = mkeras.plan_of(model)
    assert plan.measured_peak == report.rounds[-1].measured_peak and plan.budget == budget
    assert "measured peak" in plan.table()
    # After calibration, training steps are not replanned and stay within the budget as measured,
    # give or take one activation (a step's peak moves by a tensor or two from run to run).
    peaks = StepPeaks()
    model.fit(x, y, batch_size=KERAS_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[peaks])
    with capsys.disabled():
        print("  later steps measured: " + ", ".join(f"{p / MiB:.3f}" for p in peaks.peaks) + " MiB")
    assert len(report.rounds) == len(mkeras.calibration_of(model).rounds)
    assert max(peaks.peaks) <= budget + KERAS_BATCH * 256 * 4


def test_keras_calibration_raises_with_the_measured_figures():
    budget = _keras_budget(0.6)
    model = _keras_mlp(use_bias=True)
    mkeras.enable(model, budget=budget, verbose=False, calibration_rounds=1)
    x, y = _keras_data()
    with pytest.raises(memsaving.BudgetError) as caught:
        model.fit(x, y, batch_size=KERAS_BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[HoldAfterFirstStep()])
    report = mkeras.calibration_of(model)
    _show("keras fit, calibration_rounds=1", report.rounds, budget)
    message = str(caught.value)
    assert "round 1: planned for" in message and "calibration_rounds=1" in message
    assert caught.value.smallest_budget == _lowest_plus_slack(report.rounds) > budget


def test_train_on_batch_is_measured_once_per_trace():
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget="1GiB", verbose=False)
    x, y = _keras_data(256)
    for _ in range(MEASURED_STEPS + 1):  # one step more than a round measures
        model.train_on_batch(x, y)
    report = mkeras.calibration_of(model)
    assert len(report.rounds) == 1 and report.fits and report.margin == 0
    mkeras.enable(model, budget="1GiB", calibration_rounds=0, verbose=False)
    assert mkeras.calibration_of(model) is None


def test_keras_judges_a_trace_on_its_highest_step_and_records_the_spread(monkeypatch):
    """The allocator's peaks after each measured step are scripted: the round is judged on the
    highest of its MEASURED_STEPS steps, and its spread (highest less lowest) is recorded, which
    a BudgetError's smallest_budget adds when above 2%."""
    scripted = [100 * MiB, 140 * MiB, 120 * MiB, 110 * MiB] + [999 * MiB] * 4
    assert len(scripted) > MEASURED_STEPS >= 2
    read = iter(scripted)
    monkeypatch.setattr(mkeras, "peak_bytes", lambda device=None: next(read))
    model = _keras_mlp(use_bias=False)
    mkeras.enable(model, budget="1GiB", verbose=False)
    x, y = _keras_data(256)
    for _ in range(MEASURED_STEPS + 1):
        model.train_on_batch(x, y)
    (round_,) = mkeras.calibration_of(model).rounds
    steps = scripted[:MEASURED_STEPS]
    assert round_.measured_peak == max(steps) and round_.spread == max(steps) - min(steps)


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
    budget = 64 * MiB  # fits at once
    step = memsaving.fit_to_budget(tf.function(mlp.step(budget)), mlp.x, budget=budget)
    assert len(step.calibration.rounds) == 1 and step.calibration.plans
