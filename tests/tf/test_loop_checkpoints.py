"""Loops checkpointed inside (memsaving.tf.loop_checkpoints): every k-th
iteration's state kept, the iterations between run again in the backward
pass.  Gradients are checked against tf.gradients; memory is measured."""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from memsaving.tf.loop_checkpoints import can_checkpoint, checkpointing_loops

from helpers import smallest_budget

MiB = 2 ** 20

LOOPS = ("While", "StatelessWhile")


def _loops(graph):
    return [op for op in graph.get_operations() if op.type in LOOPS]


def _assert_close(expected, got, rtol=1e-5):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        a, b = tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy()
        scale = max(float(np.abs(a).max()), 1e-6)
        assert float(np.abs(a - b).max()) <= rtol * scale, (a, b)


def _recurrence(steps, batch=4, width=8, seed=1):
    """A tanh recurrence over ``steps`` inputs, every state written to a TensorArray (as Keras'
    RNN writes its outputs) and read back in the loss, with a captured variable."""
    w = tf.Variable(tf.random.stateless_normal([width, width], [seed, 1]) * 0.4)
    x = tf.random.stateless_normal([max(steps, 1), batch, width], [seed, 2])

    def loss(x):
        def body(t, h, written):
            h = tf.tanh(tf.gather(x, t) + h @ w)
            return t + 1, h, written.write(t, h)

        _, h, written = tf.while_loop(lambda t, h, written: t < steps, body,
                                      [0, tf.zeros([batch, width]), tf.TensorArray(tf.float32, size=steps)])
        stacked = written.stack() if steps else tf.zeros([0])
        return tf.reduce_sum(h ** 2) + tf.reduce_sum(tf.sin(stacked))

    return w, x, loss


@pytest.mark.parametrize("every", [None, 1, 3, 10, 25], ids=["sqrt", "1", "3", "all", "more-than-all"])
def test_a_while_loop_with_a_tensor_array_gives_tensorflows_gradient(every):
    """Chunks of any length, the last one short (10 = 3 + 3 + 3 + 1), or one chunk for the whole loop."""
    w, x, loss = _recurrence(10)

    @tf.function(autograph=False)
    def both(x):
        value = loss(x)
        expected = tf.gradients(value, [w, x])
        value = loss(x)
        with checkpointing_loops(_loops(value.graph)[-1:], every=every) as switched:
            got = tf.gradients(value, [w, x])
        return expected, got, switched

    expected, got, switched = both(x)
    assert switched == 1
    _assert_close(expected, got)


def test_a_loop_that_runs_no_iteration_passes_the_gradient_through():
    w = tf.Variable(2.0)

    @tf.function(autograph=False)
    def both(x, n):
        def loss():
            return tf.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, v * w), [0, x])[1] * 3.0

        expected = tf.gradients(loss(), [x, w])
        value = loss()
        with checkpointing_loops(value.graph.get_operations()[-8:]) as switched:
            return expected, tf.gradients(value, [x, w], unconnected_gradients="zero"), switched

    for n in (0, 5):
        expected, got, switched = both(tf.constant(1.5), tf.constant(n))
        assert switched == 1
        _assert_close([expected[0], expected[1] if expected[1] is not None else 0.0], got)


def test_a_loop_drawing_random_numbers_keeps_tensorflows_gradient():
    """Run again, its body would draw other numbers: it is never switched."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4])
        tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * tf.random.uniform([4])), [0, x])
        tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), [0, x])
    random_loop, plain_loop = _loops(g)
    assert not can_checkpoint(random_loop) and can_checkpoint(plain_loop)
    with checkpointing_loops(g.get_operations()) as switched:
        assert switched == 1
        assert plain_loop._gradient_function is not None
    assert plain_loop._gradient_function is None, "the loop's own gradient function is put back"


def _memory_mode_against_tensorflow(build, x, smallest=False):
    """memsaving.gradients(checkpoints="memory") and tf.gradients of the same model on ``x``:
    both results, and the memory mode plan; ``smallest``: under the smallest budget instead."""
    model = build()
    captured = {}

    @tf.function
    def plain(x):
        return tf.gradients(tf.reduce_sum(tf.square(model(x, training=True))), model.trainable_variables + [x])

    @tf.function
    def ours(x):
        loss = tf.reduce_sum(tf.square(model(x, training=True)))
        xs = model.trainable_variables + [x]
        budget = smallest_budget(loss, xs, checkpoints="memory") if smallest else None
        grads, captured["plan"] = memsaving.gradients_and_plan(loss, xs, checkpoints="memory", budget=budget)
        return grads

    return plain, ours, captured


def _gru():
    import keras

    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((24, 6)), keras.layers.GRU(8), keras.layers.Dense(2)])


def _scan():
    """A tf.scan of a two-layer cell: each step saves its 64-wide hidden layer, more than the
    6-wide state the checkpointed gradient stores (a tanh of one product would save too little
    for the planner to checkpoint it inside)."""
    import keras

    keras.utils.set_random_seed(4)
    w1 = tf.Variable(tf.random.stateless_normal([12, 64], [4, 4]) * 0.3)
    w2 = tf.Variable(tf.random.stateless_normal([64, 6], [5, 5]) * 0.3)

    def cell(h, xt):
        return tf.tanh(tf.nn.relu(tf.concat([xt, h], 1) @ w1) @ w2)

    class Scan(keras.Model):
        def call(self, x, training=False):
            states = tf.scan(cell, tf.transpose(x, [1, 0, 2]), initializer=x[:, 0] * 0)
            return tf.reduce_mean(states, axis=0)

    model = Scan()
    model.w1, model.w2 = w1, w2
    return model


def _masked_lstm():
    """Masking before an LSTM: the loop's inputs are made by ops whose own inputs are made by
    others, which the profiler rebuilds; it names two such copies alike and fails, and the
    unprofiled loop is kept whole."""
    import keras

    keras.utils.set_random_seed(6)
    return keras.Sequential([keras.Input((24, 6)), keras.layers.Masking(), keras.layers.LSTM(16),
                             keras.layers.Dense(2)])


# under a budget (16 s) with the slow tests: tests/model/test_loops.py checks that budget plans name the loop
# the masked LSTM's loop is not profiled yet (memsaving.tf.profiles._Builder's setup names), so not
# checkpointed inside: xfail until that is fixed
@pytest.mark.parametrize("build,smallest", [(_gru, False), (_scan, False),
                                            pytest.param(_masked_lstm, False, marks=pytest.mark.xfail(
                                                strict=True, reason="loops behind Masking are not profiled")),
                                            pytest.param(_gru, True, marks=pytest.mark.slow)],
                         ids=["gru", "scan", "masked-lstm", "gru-smallest-budget"])
def test_memory_mode_gradients_of_recurrent_models_equal_tensorflows(build, smallest):
    x = tf.random.stateless_normal([4, 24, 6], [5, 5])
    plain, ours, captured = _memory_mode_against_tensorflow(build, x, smallest)
    _assert_close(plain(x), ours(x))
    assert len(captured["plan"].checkpointed_loops) == 1, "the loop is checkpointed inside"


def _lstm_step_memory(steps, batch, units, features=32):
    """The step's own memory of an LSTM(units) over ``steps`` steps, both ways (bytes)."""
    import keras

    keras.utils.set_random_seed(0)
    layer = keras.layers.LSTM(units)
    x = tf.random.stateless_normal([batch, steps, features], [1, 2])
    layer(x)
    variables = layer.trainable_variables

    def loss(x):
        return tf.reduce_sum(tf.square(layer(x, training=True)))

    captured = {}
    plain = tf.function(lambda x: tf.gradients(loss(x), variables + [x]))

    @tf.function
    def ours(x):
        grads, captured["plan"] = memsaving.gradients_and_plan(loss(x), variables + [x], checkpoints="memory")
        return grads

    _assert_close(plain(x), ours(x))
    plan = captured["plan"]
    print(f"\nLSTM({units}) over {steps} steps, batch {batch}: predicted step memory "
          f"{(plan.plain_peak - plan.resident_bytes) / MiB:.2f} MiB plain, "
          f"{(plan.predicted_peak - plan.resident_bytes) / MiB:.2f} MiB memory mode")
    return (min(memsaving.measure_peak_increase(plain, x) for _ in range(2)),
            min(memsaving.measure_peak_increase(ours, x) for _ in range(2)), plan)


def test_memory_mode_keeps_a_few_lstm_states_not_every_one():
    """LSTM(32) over 256 steps, batch 16: sqrt(256) = 16 states kept and one chunk of 16 steps run
    again, where TensorFlow's gradient keeps all 256 steps' intermediates.  Measured 5.3 MiB against
    1.8 (3.0x): at this size the input and its gradient are a third of memory mode's step."""
    plain, ours, plan = _lstm_step_memory(256, 16, 32)
    assert plan.checkpointed_loops and "1 loops checkpointed inside" in plan.table()
    assert plain >= 2.5 * ours, {"plain MiB": plain / MiB, "memory MiB": ours / MiB}
    predicted = plan.predicted_peak - plan.resident_bytes
    assert 0.7 * ours <= predicted <= 1.4 * ours, {"predicted MiB": predicted / MiB, "measured MiB": ours / MiB}


@pytest.mark.slow  # about a minute on 2 cores
def test_lstm_128_over_512_steps_three_times_lower():
    """The issue's figure: LSTM(128) over 512 steps, batch 32 (measured 61 MiB against 9-12)."""
    plain, ours, _ = _lstm_step_memory(512, 32, 128)
    assert plain >= 3 * ours, {"plain MiB": plain / MiB, "memory MiB": ours / MiB}


def test_the_modules_examples_run():
    import doctest

    import memsaving.tf.loop_checkpoints as module

    failed, tried = doctest.testmod(module, extraglobs={"tf": tf})
    assert tried >= 4 and not failed
