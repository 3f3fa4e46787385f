"""memsaving.function: a tf.function whose tape.gradient and tf.gradients calls memsaving builds.

Weights after a few training steps are compared with the same loop under
``tf.function``; the step's memory is measured (``measure_peak_increase``);
the tape's semantics (persistent tapes, several tapes, watch,
stop_recording, unconnected sources, a used-up tape) are compared with
TensorFlow's on the same function.
"""

import io

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
from memsaving.tools import models

MiB = 2 ** 20


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def _training_step(model, optimizer):
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def _attention():
    keras.utils.set_random_seed(0)
    return models.attention_encoder(size=64, blocks=6, dim=32, heads=4), tf.random.stateless_normal([8, 64, 32],
                                                                                                     [1, 2])


def _residual_convnet():
    keras.utils.set_random_seed(0)
    return (models.residual_convnet(size=64, blocks=32, filters=(16, 32)),
            tf.random.stateless_normal([4, 64, 64, 3], [1, 2]))


def _residual_convnet_without_batch_norm():
    keras.utils.set_random_seed(0)
    return (models.residual_convnet(size=64, blocks=48, filters=(16,), batch_norm=False),
            tf.random.stateless_normal([8, 64, 64, 3], [1, 2]))


def _small_residual_convnet():
    keras.utils.set_random_seed(0)
    return models.residual_convnet(size=16, blocks=4, filters=(8, 16)), tf.random.stateless_normal([4, 16, 16, 3],
                                                                                                    [1, 2])


def _small_attention():
    keras.utils.set_random_seed(0)
    return models.attention_encoder(size=16, blocks=2, dim=16, heads=2), tf.random.stateless_normal([4, 16, 16],
                                                                                                     [1, 2])


def _loop(build, decorate, steps=5):
    model, x = build()
    optimizer = keras.optimizers.Adam(1e-2)
    step = decorate(_training_step(model, optimizer))
    for _ in range(steps):
        step(x)
    return [w.numpy() for w in model.weights], step


# both in the default run, as issue 51 asks (the residual net's run takes about 18 s)
@pytest.mark.parametrize("build", [_small_attention, _small_residual_convnet], ids=["attention", "resconv"])
def test_weights_equal_the_tf_function_loop_after_five_steps(build):
    expected, _ = _loop(build, tf.function)
    got, step = _loop(build, memsaving.function(checkpoints="memory"))
    assert _max_difference(expected, got) <= 1e-5
    assert "tape.gradient: rewritten by memsaving" in step.explain(file=io.StringIO())


# On CPU the convolutions' work buffers are a floor no plan goes below (32 MiB here, the filter
# gradient's), so a residual net needs many blocks of 64x64 activations for its plain step to need twice
# memory mode's.  Without BatchNorm, 16 blocks of one width measured 2.3x with the suite's one inter-op
# thread but 1.41x with TensorFlow's default threads (the plan itself predicts 1.48x: 67 MiB against 45).
# 48 blocks at batch 8 measure 3.4-3.6x with the default threads (python -m
# experiments.bench_function_memory) and trace in 12-16 s; 32 blocks at batch 8 measured 2.27-2.61x,
# too near 2 for a test.  The 32-block net with BatchNorm (2.24x with the default threads) takes 1-2
# minutes on 2 cores, so it runs with the slow tests.
@pytest.mark.parametrize("build", [_attention, _residual_convnet_without_batch_norm,
                                   pytest.param(_residual_convnet, marks=pytest.mark.slow)],
                         ids=["attention-6-blocks", "resconv-48-blocks", "resconv-bn-32-blocks"])
def test_step_memory_at_least_two_times_lower(build):
    peaks = {}
    for name, decorate in (("plain", tf.function), ("memory", memsaving.function(checkpoints="memory"))):
        model, x = build()
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        step = decorate(_training_step(model, optimizer))
        step(x)
        peaks[name] = min(memsaving.measure_peak_increase(step, x) for _ in range(2))
    assert peaks["plain"] >= 2.0 * peaks["memory"], {k: v / MiB for k, v in peaks.items()}


# ----------------------------------------------------------------------------- the tape's semantics


def _chain(w, x, depth=6):
    h = x
    for _ in range(depth):
        h = tf.tanh(h @ w)
    return h


def _both(python_function, *args):
    """The function's results under tf.function and under memsaving.function."""
    ours = memsaving.function(python_function, checkpoints="memory")
    return tf.function(python_function)(*args), ours(*args), ours


def _assert_same(expected, got):
    flat_expected, flat_got = tf.nest.flatten(expected), tf.nest.flatten(got)
    assert len(flat_expected) == len(flat_got)
    for a, b in zip(flat_expected, flat_got):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(), atol=1e-6)


def test_persistent_tape_several_gradients_and_nested_structure():
    w = tf.Variable(tf.fill([8, 8], 0.1))
    v = tf.Variable(tf.fill([8], 0.2))

    def f(x):
        with tf.GradientTape(persistent=True) as tape:
            h = _chain(w, x) + v
            loss = tf.reduce_sum(h * h)
            other = tf.reduce_sum(h)
        return tape.gradient(loss, {"w": w, "v": [v]}), tape.gradient(other, w)

    expected, got, ours = _both(f, tf.ones([4, 8]))
    _assert_same(expected, got)
    assert ours.explain(file=io.StringIO()).count("rewritten by memsaving") == 2


def test_two_tapes_stop_recording_and_ops_before_the_tape():
    w = tf.Variable(tf.fill([8, 8], 0.1))

    def f(x):
        before = tf.tanh(x @ w)  # not recorded: a constant for the tape
        with tf.GradientTape() as first, tf.GradientTape() as second:
            h = _chain(w, before)
            with first.stop_recording():
                hidden = tf.sin(h @ w)  # the first tape does not see this use of w
            loss = tf.reduce_sum(h * hidden)
        return first.gradient(loss, w), second.gradient(loss, w)

    expected, got, _ = _both(f, tf.ones([4, 8]))
    _assert_same(expected, got)
    assert not np.allclose(expected[0].numpy(), expected[1].numpy())  # the tapes really differ


def test_watched_tensor_unwatched_variable_and_unconnected_sources():
    w = tf.Variable(tf.fill([8, 8], 0.1))
    unused = tf.Variable(tf.ones([3]))

    def f(x):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(x)
            loss = tf.reduce_sum(_chain(w, x))
        return tape.gradient(loss, [x, w, unused])

    expected, got, _ = _both(f, tf.ones([4, 8]))
    _assert_same(expected, got)
    assert got[1] is None and got[2] is None

    def zero(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_chain(w, x))
        return tape.gradient(loss, [w, unused], unconnected_gradients=tf.UnconnectedGradients.ZERO)

    expected, got, _ = _both(zero, tf.ones([4, 8]))
    _assert_same(expected, got)


def test_output_gradients_are_used():
    w = tf.Variable(tf.fill([8, 8], 0.1))

    def f(x):
        with tf.GradientTape() as tape:
            h = _chain(w, x)
        return tape.gradient(h, w, output_gradients=tf.fill([4, 8], 2.0))

    expected, got, _ = _both(f, tf.ones([4, 8]))
    _assert_same(expected, got)


def test_a_used_non_persistent_tape_raises_as_tensorflow_does():
    w = tf.Variable(tf.fill([8, 8], 0.1))

    @memsaving.function
    def f(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_chain(w, x))
        tape.gradient(loss, w)
        return tape.gradient(loss, w)

    with pytest.raises(RuntimeError, match="non-persistent GradientTape"):
        f(tf.ones([4, 8]))


def test_what_is_not_rewritten_is_computed_by_tensorflow_and_explained():
    w = tf.Variable(tf.fill([4, 4], 0.1))

    def f(x):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                y = tf.reduce_sum(_chain(w, x, depth=3))
            g = inner.gradient(y, w)  # recorded by the outer tape: second order
            s = tf.reduce_sum(g * g)
        with tf.GradientTape() as tape:
            z = tf.constant(2.0) * tf.reduce_sum(x)  # x is not watched: no gradient for it
        return outer.gradient(s, w), tape.gradient(z, x)

    expected, got, ours = _both(f, tf.ones([2, 4]))
    _assert_same(expected, got)
    text = ours.explain(file=io.StringIO())
    assert "higher-order gradients" in text
    assert "a tensor source the tape was not told to watch" in text


def test_jacobian_is_left_to_tensorflow():
    w = tf.Variable(tf.fill([3, 3], 0.1))

    def f(x):
        with tf.GradientTape() as tape:
            j = tf.tanh(x @ w)
        return tape.jacobian(j, w)

    expected, got, ours = _both(f, tf.ones([2, 3]))
    _assert_same(expected, got)
    assert "jacobians are not rewritten" in ours.explain(file=io.StringIO())


def test_tf_gradients_inside_is_rewritten_too():
    w = tf.Variable(tf.fill([8, 8], 0.1))

    def f(x):
        return tf.gradients(tf.reduce_sum(_chain(w, x)), [w])

    expected, got, _ = _both(f, tf.ones([4, 8]))
    _assert_same(expected, got)


def test_the_tape_is_tensorflows_own_again_after_tracing():
    original = tf.GradientTape.gradient
    w = tf.Variable(tf.fill([4, 4], 0.1))

    @memsaving.function(checkpoints="memory")
    def f(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_chain(w, x, depth=2))
        return tape.gradient(loss, w)

    f(tf.ones([2, 4]))
    assert tf.GradientTape.gradient is original
    with tf.GradientTape() as tape:  # eager tapes are untouched
        loss = tf.reduce_sum(w * w)
    np.testing.assert_allclose(tape.gradient(loss, w).numpy(), 2 * w.numpy())


def test_jit_compile_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="XLA"):
        memsaving.function(lambda x: x, jit_compile=True)


def test_bad_checkpoints_and_budget_fail_at_decoration():
    with pytest.raises(memsaving.CheckpointError):
        memsaving.function(lambda x: x, checkpoints="fastest")
    with pytest.raises(ValueError):
        memsaving.function(lambda x: x, budget="lots")


def test_with_a_budget_the_first_call_calibrates_and_the_loop_trains_as_tf_function():
    def build():
        keras.utils.set_random_seed(0)
        return models.mlp(size=32, depth=8, width=64), tf.random.stateless_normal([64, 32], [1, 2])

    expected, _ = _loop(build, tf.function, steps=3)
    got, step = _loop(build, memsaving.function(checkpoints="memory", budget="1GiB"), steps=3)
    assert step.calibration is not None and step.calibration.fits
    assert _max_difference(expected, got) <= 1e-5
