"""Multi-level recomputation in TensorFlow: gradients equal, memory measured.

A budget below what any single-level plan reaches gets a recursive plan
(inner checkpoints rebuilt during the backward pass); its measured peak must
be near the prediction and well below the lowest single-level plan's.
"""

from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from memsaving.planners.known_error import needed_budget
from helpers import assert_close, in_a_fresh_process

WIDTH, BATCH, DEPTH = 64, 2048, 64


def _mlp(x, ws):
    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_mean(h * h)


def multilevel_figures() -> dict:
    """Build the plans, check the gradients, and measure; run in a fresh
    process (after other tests in one process, memory they left behind
    raised the multi-level step's measured peak by a quarter)."""
    ws = [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=WIDTH ** -0.5, seed=i)) for i in range(DEPTH)]
    plans = {}

    def step(name, **kwargs):
        @tf.function
        def run(x):
            loss = _mlp(x, ws)
            plans[name] = memsaving.plan(loss, ws, **kwargs)
            grads = memsaving.gradients(loss, ws, **kwargs)
            return tf.add_n([tf.reduce_sum(g) for g in grads])

        @tf.function
        def grads(x):
            return memsaving.gradients(_mlp(x, ws), ws, **kwargs)

        return run, grads

    x = tf.random.normal([BATCH, WIDTH], seed=1)
    # Every step is traced before any runs: a step that has run holds constants Grappler folded, which
    # later plans count as in use, and the budget below is set from the first plan's resident bytes.
    memory_run, _ = step("memory", checkpoints="memory")
    memory_run.get_concrete_function(x)
    resident = plans["memory"].resident_bytes
    activations = plans["memory"].plain_peak - resident
    # a budget= plan leaves room for the known error: plan for 12% of the activations
    target = resident + int(0.12 * activations)
    budget = needed_budget(target, resident)
    assert plans["memory"].predicted_peak > target, "the target must be below the single-level plan"

    tight_run, tight_grads = step("tight", budget=budget, multilevel=True)
    tight_run.get_concrete_function(x)
    tight_grads.get_concrete_function(x)
    plan = plans["tight"]
    assert plan.inner_checkpoints, "expected a multi-level plan"
    assert plan.predicted_peak <= target + 1
    assert "inner checkpoints (multi-level)" in plan.table()

    @tf.function
    def plain_grads(x):
        return tf.gradients(_mlp(x, ws), ws)

    assert_close([g.numpy() for g in plain_grads(x)], [g.numpy() for g in tight_grads(x)])

    measured_tight = memsaving.measure_peak_increase(tight_run, x)
    measured_memory = memsaving.measure_peak_increase(memory_run, x)
    predicted = plan.predicted_peak - resident
    return {"predicted": predicted, "measured": measured_tight, "memory": measured_memory}


@pytest.mark.slow  # 20 s: every single-level plan measured against the multi-level one (benchmark-like)
def test_multilevel_plan_measured_below_every_single_level_plan():
    figures = in_a_fresh_process("test_multilevel", "multilevel_figures")
    predicted, measured_tight, measured_memory = figures["predicted"], figures["measured"], figures["memory"]
    print(f"multi-level: predicted {predicted / 2**20:.2f} MiB, measured {measured_tight / 2**20:.2f} MiB; "
          f"single-level 'memory' measured {measured_memory / 2**20:.2f} MiB")
    # Multi-level predictions run low by more than single-level ones: measured 1.13x here at this
    # batch, and 1.22x (one machine) to 1.50x (another) at a batch of 512, where the work buffers
    # the prediction misses weigh more.
    assert measured_tight <= 1.4 * predicted
    assert measured_tight <= 0.7 * measured_memory


def _three_readers_step(inner_of):
    """x -> h -> u, and q, k, v each read u; the planner's proposal is
    replaced by keeping q, k, v with the inner checkpoints ``inner_of``
    (anchor name -> inner names) gives: the builder must follow it."""
    from memsaving.planners import registry as api  # the budget planner the registry calls
    from memsaving.model.proposal import Proposal  # pylint: disable=import-outside-toplevel

    def proposed(model, *args, **kwargs):
        index = model.op_index()
        inner = {index[a]: tuple(index[i] for i in inside) for a, inside in inner_of.items()}
        return Proposal([index["q"], index["k"], index["v"]], 0, 0.0, inner=inner, name="multi-level")

    rng = np.random.default_rng(0)
    ws = [tf.Variable(rng.standard_normal((16, 16)).astype(np.float32) * 0.3) for _ in range(5)]

    @tf.function
    def step(x):
        h = tf.tanh(tf.matmul(x, ws[0]), name="h")
        u = tf.tanh(tf.matmul(h, ws[1]), name="u")
        q, k, v = (tf.matmul(u, w, name=name) for w, name in zip(ws[2:], "qkv"))
        loss = tf.reduce_sum(tf.tanh(q) * tf.sin(k) * tf.cos(v))
        with mock.patch.object(api, "plan_for_budget", proposed):
            ours = memsaving.gradients(loss, ws, budget="1GiB", profile=False)
        return ours, tf.gradients(loss, ws)

    return step, tf.constant(rng.standard_normal((4, 16)).astype(np.float32))


def test_an_inner_checkpoint_of_one_of_three_readers_gives_equal_gradients():
    """u is an inner checkpoint of v's segment; k's and q's segments
    recompute it themselves and pass their gradients through it."""
    step, x = _three_readers_step({"v": ["u"]})
    ours, plain = step(x)
    assert_close([g.numpy() for g in plain], [g.numpy() for g in ours])


def test_an_inner_checkpoint_given_to_several_anchors_is_refused():
    """Built as given, u's sub-segment ran once per anchor, passing on the
    gradient summed so far each time: the first two weights' gradients
    were wrong."""
    step, x = _three_readers_step({"q": ["u"], "k": ["u"], "v": ["u"]})
    with pytest.raises(ValueError, match="two anchors"):
        step.get_concrete_function(x)
