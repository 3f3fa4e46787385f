"""memsaving.plan against measurement: predicted peaks and budgets that hold.

Activation memory is compared: measured peak minus the memory in use before
the step (other tests' variables live in the same process) against the
predicted peak minus the resident bytes the model counted.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import assert_close, in_a_fresh_process, mlp_weights

BATCH, WIDTH = 512, 128


def _weights(n, seed=0):
    return [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=WIDTH ** -0.5, seed=seed + i)) for i in range(n)]


def mlp(x, ws):
    h, cps = x, []
    for i, w in enumerate(ws):
        h = tf.nn.relu(tf.matmul(h, w))
        if i % 5 == 4:
            cps.append(h)
    return tf.reduce_sum(h * h), cps


def residual(x, ws):
    h, cps = x, []
    for i in range(0, len(ws), 2):
        h = h + tf.matmul(tf.tanh(tf.matmul(h, ws[i])), ws[i + 1])
        if i % 6 == 4:
            cps.append(h)
    return tf.reduce_mean(tf.square(h)), cps


def two_tower(x, ws):
    half = len(ws) // 2
    a, b, cps = x, tf.sin(x), []
    for i in range(half):
        a = tf.nn.relu(tf.matmul(a, ws[i]))
        b = tf.tanh(tf.matmul(b, ws[half + i]))
        if i % 4 == 3:
            cps += [a, b]
    return tf.reduce_sum(a * b), cps


MODELS = [(mlp, 30), (residual, 30), (two_tower, 24)]


def _measure(forward, ws, checkpoints, budget=None):
    captured = {}

    @tf.function
    def step(x):
        loss, cps = forward(x, ws)
        chosen = cps if checkpoints == "model" else checkpoints
        if checkpoints is None:
            captured["plan"] = memsaving.plan(loss, ws, checkpoints=[])
            grads = tf.gradients(loss, ws)
        else:
            captured["plan"] = memsaving.plan(loss, ws, checkpoints=chosen, budget=budget)
            grads = memsaving.gradients(loss, ws, checkpoints=chosen, budget=budget)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    x = tf.random.normal([BATCH, WIDTH], seed=7)
    value = step(x)
    measured = memsaving.measure_peak_increase(step, x)
    plan = captured["plan"]
    return plan, measured, float(value)


CASES = [(m, c) for m in MODELS for c in (None, "model", "memory")]

# Two towers in memory mode measure 2.88-3.33 MiB from one process to the
# next against 2.75 predicted: TensorFlow runs a kept anchor's gradient (it
# reads only kept tensors) as soon as its output gradient exists, while the
# unit before is still running, where the simulator runs units one after
# the other (README, Limits).
TOLERANCE = {("two_tower", "memory"): 0.20}


@pytest.mark.parametrize("model, checkpoints", CASES, ids=[f"{c}-{m[0].__name__}" for m, c in CASES])
def test_predicted_peak_within_15_percent(model, checkpoints):
    forward, depth = model
    ws = _weights(depth)
    plan, measured, _ = _measure(forward, ws, checkpoints)
    predicted_activations = plan.predicted_peak - plan.resident_bytes
    print(f"{forward.__name__} {checkpoints}: predicted {predicted_activations / 2**20:.2f} MiB, "
          f"measured {measured / 2**20:.2f} MiB")
    assert abs(predicted_activations - measured) <= TOLERANCE.get((forward.__name__, checkpoints), 0.15) * measured


def test_budget_plan_fits_when_measured_and_gradients_match():
    ws = _weights(40, seed=100)
    plain_plan, plain_measured, _ = _measure(mlp, ws, None)
    resident = plain_plan.resident_bytes
    budget = resident + int(0.45 * (plain_plan.plain_peak - resident))
    plan, measured, _ = _measure(mlp, ws, "memory", budget=budget)
    assert plan.mode == "budget" and plan.predicted_peak <= budget
    assert measured <= 0.45 * plain_measured * 1.15
    # before `both` runs: a step that has run holds constants Grappler folded, and a later plan counts
    # them as in use, which would leave the looser budget less room than the 0.8 it means
    looser, _, _ = _measure(mlp, ws, "memory", budget=resident + int(0.8 * (plain_plan.plain_peak - resident)))
    assert looser.predicted_compute <= plan.predicted_compute

    @tf.function
    def both(x):
        loss, _ = mlp(x, ws)
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, budget=budget)

    plain_grads, budget_grads = both(tf.random.normal([BATCH, WIDTH], seed=7))
    assert_close([g.numpy() for g in plain_grads], [g.numpy() for g in budget_grads])


def test_infeasible_budget_raises_with_smallest_budget():
    ws = _weights(10, seed=200)

    @tf.function
    def step(x):
        loss, _ = mlp(x, ws)
        return memsaving.gradients(loss, ws, checkpoints="memory", budget="1KiB")

    with pytest.raises(memsaving.BudgetError, match="smallest feasible budget"):
        step.get_concrete_function(tf.TensorSpec([BATCH, WIDTH]))


def test_plan_explain_in_a_traced_function(capsys):
    ws = _weights(12, seed=300)

    @tf.function
    def step(x):
        loss, cps = mlp(x, ws)
        memsaving.plan(loss, ws, checkpoints="memory").explain()
        return loss

    step.get_concrete_function(tf.TensorSpec([BATCH, WIDTH]))
    out = capsys.readouterr().out
    assert "memsaving plan (memory)" in out and "recompute MFLOP" in out


@pytest.mark.parametrize("fraction", [0.72, 1.0])  # planned for 0.5 and 0.69 of the room (known error, headroom)
def test_budget_plans_on_a_residual_net_fit_when_measured(fraction):
    """Budget plans on a residual net, measured against the prediction.

    Found here: per-op plans keep many ops whose segments recompute nothing,
    and nothing then made the backward pass wait for the previous unit's
    weight gradients; with Grappler's arithmetic optimizer on, the executor
    deferred them to the end of the step (7.1 MiB measured against 4.75 MiB
    predicted at 0.6).  Units that wait for nothing now pass the wait on.
    """
    ws = _weights(30, seed=200)
    plain_plan, plain_measured, _ = _measure(residual, ws, None)
    resident = plain_plan.resident_bytes
    budget = resident + int(fraction * (plain_plan.plain_peak - resident))
    plan, measured, _ = _measure(residual, ws, "memory", budget=budget)
    predicted = plan.predicted_peak - resident
    print(f"residual at {fraction}: {len(plan.checkpoints)} checkpoints, predicted {predicted / 2**20:.2f} MiB, "
          f"measured {measured / 2**20:.2f} MiB (plain {plain_measured / 2**20:.2f}), "
          f"compute {plan.predicted_compute:.3f}")
    assert plan.predicted_peak <= budget
    assert abs(measured - predicted) <= 0.15 * measured

    @tf.function
    def both(x):
        loss, _ = residual(x, ws)
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, budget=budget)

    plain_grads, budget_grads = both(tf.random.normal([BATCH, WIDTH], seed=7))
    assert_close([g.numpy() for g in plain_grads], [g.numpy() for g in budget_grads])


def test_memory_the_device_holds_counts_as_resident():
    """A budget limits the allocator's whole peak, so what the process holds
    on the device while the step is planned counts in every prediction."""
    ws = _weights(4, seed=300)
    x = tf.random.normal([BATCH, WIDTH], seed=301)

    def resident_bytes():
        captured = {}

        @tf.function
        def step(x):
            loss, _ = mlp(x, ws)
            captured["plan"] = memsaving.plan(loss, ws, checkpoints=[])
            return loss

        step.get_concrete_function(x)
        return captured["plan"].resident_bytes

    own = 4 * WIDTH * WIDTH * 4 + BATCH * WIDTH * 4  # the weights and the batch the step reads
    before = resident_bytes()
    held = tf.fill([4 * 2 ** 20 // 4], 1.0)  # 4 MiB the step never reads
    after = resident_bytes()
    del held
    assert before >= own
    # the step's own inputs and weights are already allocated, so nothing is counted twice: the
    # held tensor adds its 4 MiB (and whatever else the process allocated in between)
    assert after >= max(own, before - 64 * 1024) + 4 * 2 ** 20, (own, before, after)


def test_the_plan_names_ops_it_never_recomputes():
    """A stateful call between xs and ys (it updates a counter and draws
    random numbers) is kept whole, and the plan says so."""
    ws = mlp_weights(4)
    counter = tf.Variable(0.0)
    captured = {}

    @tf.function
    def side_effect(h):
        counter.assign_add(1.0)
        return h * 2.0 + tf.random.uniform(tf.shape(h), seed=3)

    @tf.function
    def step(x):
        h = tf.tanh(tf.matmul(x, ws[0]))
        h = side_effect(tf.tanh(tf.matmul(h, ws[1])))
        h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, ws[2])), ws[3]))
        loss = tf.reduce_sum(h)
        captured["plan"] = memsaving.plan(loss, ws, checkpoints="memory")
        return memsaving.gradients(loss, ws, checkpoints="memory")

    step(tf.ones([8, 16]))
    plan = captured["plan"]
    assert [name for name in plan.never_recomputed if "StatefulPartitionedCall" in name], plan.never_recomputed
    assert "kept, never recomputed (stateful or random ops)" in plan.table()


def test_a_plan_is_made_once_per_graph_and_arguments():
    """``plan`` then ``gradients`` on one graph, and a second trace of the
    same step, reuse the plan; another budget plans again, as does a new
    trace after ``clear_plan_cache``.  The reused plan's gradients are
    tf.gradients'."""
    ws = _weights(12, seed=400)
    plans = {}

    def step(x, budget=None, tag=""):
        loss, _ = mlp(x, ws)
        plans[tag + "plan"] = memsaving.plan(loss, ws, checkpoints="memory", budget=budget)
        grads, plans[tag + "gradients"] = memsaving.gradients_and_plan(loss, ws, checkpoints="memory",
                                                                       budget=budget)
        plain = tf.gradients(loss, ws)
        return tf.reduce_max([tf.reduce_max(tf.abs(a - b)) for a, b in zip(grads, plain)])

    x = tf.random.normal([BATCH, WIDTH], seed=5)
    assert float(tf.function(step)(x)) == 0.0
    assert not plans["plan"].reused and plans["gradients"].reused
    assert plans["gradients"].kept_ops == plans["plan"].kept_ops
    assert plans["gradients"].planning_seconds == plans["plan"].planning_seconds > 0

    tf.function(step).get_concrete_function(tf.TensorSpec([BATCH, WIDTH]), tag="again ")
    assert plans["again plan"].reused and plans["again plan"].steps == plans["plan"].steps

    budget = (plans["plan"].predicted_peak + plans["plan"].plain_peak) // 2
    tf.function(step).get_concrete_function(tf.TensorSpec([BATCH, WIDTH]), budget=budget, tag="budget ")
    assert not plans["budget plan"].reused and plans["budget gradients"].reused

    memsaving.clear_plan_cache()
    tf.function(step).get_concrete_function(tf.TensorSpec([BATCH, WIDTH]), tag="cleared ")
    assert not plans["cleared plan"].reused


def _widening_convolutions(x, ws):
    """Convolutions that widen 16 channels to 64, each averaged back to 16
    by a mean whose gradient reads no value: plain backprop frees every
    wide output as soon as the mean has read it."""
    h = x
    for w in ws:
        h = tf.nn.conv2d(h, w, 1, "SAME")
        shape = tf.shape(h)
        h = tf.reduce_mean(tf.reshape(h, tf.concat([shape[:3], [4, 16]], 0)), axis=3)
    return tf.reduce_sum(h * h)


def above_plain_figures() -> dict:
    """The warnings and measured step peaks of
    :func:`test_a_plan_predicted_above_plain_backprop_warns_and_measures_above_it`
    (run in a process of its own: the kernels are chosen when TensorFlow starts)."""
    rng = np.random.default_rng(0)
    ws = [tf.Variable(rng.standard_normal((3, 3, 16, 64)).astype("float32") * 0.1) for _ in range(4)]
    x = tf.random.stateless_normal([8, 32, 32, 16], seed=(1, 2))
    caught = {}

    def step_for(mode):
        @tf.function
        def step(x):
            loss = _widening_convolutions(x, ws)
            if mode == "plain":
                grads = tf.gradients(loss, ws)
            else:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    grads = memsaving.gradients(loss, ws, checkpoints=mode)
                caught[mode] = [str(w.message) for w in seen if issubclass(w.category, memsaving.PlanWarning)]
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        return step

    peaks = {}
    for mode in ("plain", "speed", "memory"):
        step = step_for(mode)
        step(x)
        peaks[mode] = memsaving.measure_peak_increase(step, x)
    return {"caught": caught, "peaks": peaks}


def test_a_plan_predicted_above_plain_backprop_warns_and_measures_above_it():
    """checkpoints="speed" keeps every convolution output, which plain
    backprop frees at once here: twice plain's peak, which used to pass
    without a word (a PixelCNN-like net measured 1.43x plain).

    Measured with oneDNN's kernels (TensorFlow's default on x86 CPUs with
    AVX-512, asked for elsewhere): Eigen's, the default on CPUs without it,
    hold a ~32 MiB work buffer at which every way of computing this
    gradient peaks, and the kept outputs hide under it."""
    figures = in_a_fresh_process("test_plan", "above_plain_figures", environment={"TF_ENABLE_ONEDNN_OPTS": "1"})
    caught, peaks = figures["caught"], figures["peaks"]
    assert len(caught["speed"]) == 1 and "above plain tf.gradients" in caught["speed"][0]
    assert caught["memory"] == []
    assert peaks["speed"] > 1.3 * peaks["plain"], peaks
