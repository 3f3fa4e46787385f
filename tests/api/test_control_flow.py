"""Control flow in the forward pass: tf.cond, tf.while_loop and Keras RNN
layers (control flow v2).

Each If / While op is one op of the outer graph, kept whole (never copied,
never cut inside; listed in ``plan.never_recomputed``) and differentiated
with TensorFlow's own gradient.
"""

from functools import partial

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import MODE_KWARGS as MODES, compare_gradients, mlp_weights, smallest_budget

CONTROL_FLOW = ("If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase")

_weights = partial(mlp_weights, width=12)


def _assert_never_cut_inside(plan, graph):
    """Every control-flow op of the forward pass is planned as one op of the
    outer graph, kept (never recomputed), and no copy of it exists."""
    ops = {op.name: op for op in graph.get_operations()}
    kept = set(plan.kept_ops)
    flow = [name for name in plan.never_recomputed if ops[name].type in CONTROL_FLOW]
    assert flow, "the plan lists the loop / cond among the ops it never recomputes"
    assert set(flow) <= kept
    for kind, anchor, names in plan.steps:
        assert all(name in ops for name in names), "plans name only ops of the outer graph"
        if kind in ("segment", "advance"):
            recomputed = [n for n in names if ops[n].type in CONTROL_FLOW]
            assert not recomputed, f"a {kind} recomputes control flow {recomputed}"
    copies = [op for op in graph.get_operations() if "/recompute" in op.name and op.type in CONTROL_FLOW]
    assert not copies, f"control flow was copied: {[op.name for op in copies]}"
    return flow


def _forward(ws, x):
    """MLP with a cond (both branches differentiable), a while loop that
    multiplies by a weight, and a cond that draws random numbers (stateful If)."""
    h = tf.tanh(tf.matmul(x, ws[0]))
    h = tf.cond(tf.reduce_mean(h) > -10.0, lambda: tf.sin(h) * 2.0, lambda: tf.square(h))
    h = tf.tanh(tf.matmul(h, ws[1]))
    h = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, tf.tanh(tf.matmul(v, ws[2])) + 0.5 * v), (0, h))[1]
    h = tf.nn.relu(tf.matmul(h, ws[3]))
    h = tf.cond(tf.reduce_sum(x) > 1e9, lambda: h, lambda: h * tf.random.uniform(tf.shape(h), 0.5, 1.5, seed=3))
    h = tf.tanh(tf.matmul(h, ws[4]))
    return tf.reduce_sum(tf.tanh(tf.matmul(h, ws[5])) ** 2), h


@pytest.mark.parametrize("kwargs", MODES + [dict(budget="fraction")], ids=lambda k: str(list(k.values())[0]))
def test_cond_and_while_loop_in_the_forward_pass(kwargs):
    ws = mlp_weights(8)

    def loss_fn(x):
        h = x
        for i, w in enumerate(ws):
            h = tf.tanh(tf.matmul(h, w))
            if i == 2:
                h = tf.cond(tf.reduce_sum(h) > 0, lambda: h * 2.0, lambda: tf.sin(h))
            if i == 5:
                h = tf.while_loop(lambda k, v: k < 3, lambda k, v: (k + 1, tf.tanh(v) + 0.1 * v), (0, h))[1]
        return tf.reduce_sum(h * h)

    x = tf.random.normal([32, 16], seed=1)
    if "budget" in kwargs:
        @tf.function
        def budget_of(x):
            base = memsaving.plan(loss_fn(x), ws, checkpoints=[])
            return base.resident_bytes + int(0.7 * (base.plain_peak - base.resident_bytes))
        kwargs = dict(budget=int(budget_of(x)))
        try:
            compare_gradients(loss_fn, ws, x, **kwargs)
        except memsaving.BudgetError as error:  # a fixed fraction may be infeasible: use the floor
            compare_gradients(loss_fn, ws, x, budget=error.smallest_budget)
        return
    compare_gradients(loss_fn, ws, x, **kwargs)


def test_control_flow_ops_are_never_cut_inside():
    """The cond and the loop are single ops of the outer graph: a plan may
    keep or recompute them whole, and the plan lists only outer-graph ops."""
    ws = mlp_weights(4)
    captured = {}

    @tf.function
    def step(x):
        h = tf.tanh(tf.matmul(x, ws[0]))
        h = tf.while_loop(lambda k, v: k < 4, lambda k, v: (k + 1, tf.tanh(tf.matmul(v, ws[1]))), (0, h))[1]
        h = tf.cond(tf.reduce_sum(h) > 0, lambda: tf.matmul(h, ws[2]), lambda: h)
        loss = tf.reduce_sum(tf.square(tf.matmul(h, ws[3])))
        captured["plan"] = memsaving.plan(loss, ws, checkpoints="memory")
        captured["graph"] = loss.graph
        return memsaving.gradients(loss, ws, checkpoints="memory")

    step(tf.random.normal([8, 16], seed=2))
    ops = {op.name: op for op in captured["graph"].get_operations()}
    planned = {name for _, anchor, names in captured["plan"].steps for name in names + (anchor,) if name}
    assert planned <= set(ops), "every planned op is an op of the outer graph"
    loops = [name for name in planned if ops[name].type in ("While", "StatelessWhile", "If", "StatelessIf")]
    assert loops, "the loop and the cond are planned as single ops"


@pytest.mark.parametrize("mode", ["memory", "speed", "list", "smallest_budget", "collection"])
def test_cond_and_loop_gradients_equal_and_never_cut_inside(mode):
    ws = _weights(6)
    captured = {}

    @tf.function
    def step(x):
        loss, late = _forward(ws, x)
        kwargs = {"checkpoints": mode}
        if mode == "list":
            kwargs["checkpoints"] = [late]
        elif mode == "collection":
            memsaving.checkpoint(late)
        elif mode == "smallest_budget":
            kwargs = {"checkpoints": "memory", "budget": smallest_budget(loss, ws, checkpoints="memory")}
        captured["plan"] = memsaving.plan(loss, ws, **kwargs)
        captured["graph"] = loss.graph
        # memsaving first: building any gradient of a cond / loop adds its
        # intermediates as outputs of the forward op, which changes the plan
        # (see test_smallest_budget_after_tf_gradients_built_the_loop_gradient)
        ours = memsaving.gradients(loss, ws, **kwargs)
        return tf.gradients(loss, ws), ours

    plain, ours = step(tf.random.normal([8, 12], seed=1))
    for p, o in zip(plain, ours):
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=1e-5, atol=1e-6)
    flow = _assert_never_cut_inside(captured["plan"], captured["graph"])
    types = {captured["graph"].get_operation_by_name(n).type for n in flow}
    assert types & {"While", "StatelessWhile"} and types & {"If", "StatelessIf"}, types
    assert "kept, never recomputed" in captured["plan"].explain(file=_Sink())


def test_smallest_budget_after_tf_gradients_built_the_loop_gradient():
    """TensorFlow's cond/while gradient adds the branch/body intermediates as new
    outputs of the forward If/While op when a gradient is first built; the graph
    model sees them only afterwards.  The smallest budget found before
    tf.gradients ran still fits here because a BudgetError's smallest budget
    leaves a slack (memsaving.errors.feasible_budget) larger than this loop's
    intermediates; larger ones can exceed it (README, Limits)."""
    ws = _weights(6)

    @tf.function
    def step(x):
        loss, _ = _forward(ws, x)
        smallest = smallest_budget(loss, ws, checkpoints="memory")
        plain = tf.gradients(loss, ws)  # rewrites the forward If/While ops
        return plain, memsaving.gradients(loss, ws, checkpoints="memory", budget=smallest)

    step.get_concrete_function(tf.TensorSpec([8, 12]))


class _Sink:
    def write(self, text):
        return len(text)


def test_loop_with_a_variable_update_runs_once_per_step():
    """A while loop whose body updates a variable is stateful: kept, its body
    runs once per step however many segments are recomputed."""
    ws = _weights(4)
    counter = tf.Variable(0.0)

    @tf.function
    def step(x):
        h = tf.tanh(tf.matmul(x, ws[0]))

        def body(i, v):
            counter.assign_add(1.0)
            return i + 1, tf.tanh(tf.matmul(v, ws[1]))

        h = tf.while_loop(lambda i, v: i < 3, body, (0, h))[1]
        h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, ws[2])), ws[3]))
        return memsaving.gradients(tf.reduce_sum(h * h), ws, checkpoints="memory")

    step(tf.ones([4, 12]))
    assert counter.numpy() == 3.0


@pytest.mark.parametrize("unroll", [False, True])
# LSTM and GRU (8-12 s each) with -m slow: test_gradients_cases.test_keras_recurrent_layers
# checks their gradients, looped and unrolled
@pytest.mark.parametrize("cell", [pytest.param("LSTM", marks=pytest.mark.slow),
                                  pytest.param("GRU", marks=pytest.mark.slow), "SimpleRNN"])
def test_keras_rnn_layers(cell, unroll):
    import keras

    keras.utils.set_random_seed(2)
    layer = getattr(keras.layers, cell)
    inp = keras.Input((5, 6))
    h = layer(8, return_sequences=True, unroll=unroll)(inp)
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = layer(6, unroll=unroll, go_backwards=True)(h)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    captured = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        ws = model.trainable_variables
        captured["plan"] = memsaving.plan(loss, ws, checkpoints="memory")
        captured["graph"] = loss.graph
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")

    plain, ours = step(tf.random.normal([3, 5, 6], seed=4))
    for p, o in zip(plain, ours):
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=1e-5, atol=1e-6)
    graph = captured["graph"]
    loops = [op for op in graph.get_operations()  # forward loops, not their gradient loops
             if op.type in ("While", "StatelessWhile") and "gradients" not in op.name]
    if unroll:
        assert not loops, "unroll=True builds the steps as plain ops"
        assert captured["plan"].segments, "and they are ordinary ops to plan"
    else:
        assert len(loops) == 2
        flow = _assert_never_cut_inside(captured["plan"], graph)
        assert sorted(flow) == sorted(op.name for op in loops)
