"""memsaving.gradients runs the loops it builds one iteration at a time:
gradients unchanged, the user's forward loop untouched.  That the profiled
and the measured peak of a recurrent step then agree is tested in
tests/tf/test_profiles.py::test_lstm_step."""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from memsaving.tf.loop_pinning import LOOP_TYPES, pin_loop_iterations


def _loops(graph):
    return {op.name: op.get_attr("parallel_iterations") for op in graph.get_operations() if op.type in LOOP_TYPES}


def test_only_the_gradient_loops_are_pinned():
    w = tf.Variable(tf.random.normal([16, 16], seed=1) * 0.3)
    seen = {}

    @tf.function
    def step(x):
        def body(i, h):
            return i + 1, tf.tanh(h @ w)

        h = tf.while_loop(lambda i, h: i < 5, body, [0, x], parallel_iterations=7)[1]
        loss = tf.reduce_sum(h * h)
        forward = _loops(loss.graph)
        grads = memsaving.gradients(loss, [w, x], checkpoints=[], profile=False)
        seen["forward"] = forward
        seen["after"] = _loops(loss.graph)
        return grads

    @tf.function
    def reference(x):
        def body(i, h):
            return i + 1, tf.tanh(h @ w)

        h = tf.while_loop(lambda i, h: i < 5, body, [0, x], parallel_iterations=7)[1]
        return tf.gradients(tf.reduce_sum(h * h), [w, x])

    x = tf.random.normal([4, 16], seed=2)
    ours, plain = step(x), reference(x)
    for a, b in zip(ours, plain):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert set(seen["forward"].values()) == {7}
    gradient_loops = {name: n for name, n in seen["after"].items() if name not in seen["forward"]}
    assert gradient_loops and set(gradient_loops.values()) == {1}
    assert {name: seen["after"][name] for name in seen["forward"]} == seen["forward"]


def test_pin_refuses_zero_iterations():
    with pytest.raises(ValueError, match="at least 1"):
        pin_loop_iterations([], iterations=0)
