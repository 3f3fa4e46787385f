"""Special cases of the rewrite: stateful calls, nested functions, unconnected or
captured xs, devices, Keras."""

import re

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import assert_close, mlp_weights, tanh_mlp

W = [tf.Variable(tf.ones([4, 4]) * 0.1) for _ in range(3)]


def _loss(x):
    h = tanh_mlp(x, W)
    return tf.reduce_sum(h * h)


def _compare(fn_builder, checkpoints_from="cps"):
    """fn_builder(x) -> (loss, xs, cps); returns (plain, ours) numpy lists."""

    @tf.function
    def step(x):
        loss, xs, cps = fn_builder(x)
        plain = tf.gradients(loss, xs)
        ours = memsaving.gradients(loss, xs, checkpoints=cps)
        return plain, ours

    x = tf.constant(np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32))
    plain, ours = step(x)
    return [p.numpy() for p in plain], [o.numpy() for o in ours], step.get_concrete_function(x).graph


_COPY_NAME = re.compile(r"^memsaving_gradients[^/]*/recompute_\d+/(.*)$")


def _recomputed_ops(graph):
    """The forward copies (not the gradient ops built on them)."""
    return [op for op in graph.get_operations() if _COPY_NAME.match(op.name)]


def test_segments_are_recomputed_with_waits():
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(6)]

    def build(x):
        h, cps = x, []
        for i, v in enumerate(w):
            h = tf.tanh(tf.matmul(h, v))
            if i in (1, 3):
                cps.append(h)
        return tf.reduce_sum(h), w + [x], cps

    plain, ours, graph = _compare(build)
    assert_close(plain, ours)
    copies = _recomputed_ops(graph)
    assert {op.type for op in copies} >= {"MatMul", "Tanh"}
    # every copy whose inputs are all outside its segment waits on a backward op
    copy_set = set(copies)
    roots = [op for op in copies if not any(t.op in copy_set for t in op.inputs)]
    assert roots and all(op.control_inputs for op in roots)


def test_stateful_call_in_the_middle_is_kept_and_runs_once():
    counter = tf.Variable(0.0)
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(4)]

    @tf.function
    def side_effect(h):
        counter.assign_add(1.0)
        return h * 2.0 + tf.random.uniform(tf.shape(h), seed=3)

    def build(x):
        h = tf.tanh(tf.matmul(x, w[0]))
        cp = tf.tanh(tf.matmul(h, w[1]))
        h = side_effect(cp)
        h = tf.sin(tf.matmul(h, w[2]))
        h = tf.tanh(tf.matmul(h, w[3]))
        return tf.reduce_sum(h), w + [x], [cp]

    before = counter.numpy()
    plain, ours, graph = _compare(build)
    assert_close(plain, ours)
    assert counter.numpy() - before == 1.0, "the stateful call ran more than once per step"
    assert not any(op.type == "StatefulPartitionedCall" for op in _recomputed_ops(graph))


def test_nested_stateless_function_is_recomputed():
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(4)]

    @tf.function(autograph=False)
    def activation(h):
        return tf.nn.softplus(h) * 0.5

    def block(h, v):
        return activation(tf.matmul(h, v))

    def build(x):
        h = block(x, w[0])
        cp = block(h, w[1])
        h = block(cp, w[2])
        h = block(h, w[3])
        return tf.reduce_sum(h * h), w + [x], [cp]

    plain, ours, graph = _compare(build)
    assert_close(plain, ours)
    assert any(op.type == "PartitionedCall" for op in _recomputed_ops(graph))


def test_control_inputs_on_forward_ops():
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(3)]

    def build(x):
        h = tf.tanh(tf.matmul(x, w[0]))
        check = tf.debugging.assert_all_finite(h, "finite")
        with tf.control_dependencies([check]):
            h2 = tf.sin(tf.matmul(h, w[1]))
        cp = tf.identity(h2)
        h3 = tf.tanh(tf.matmul(cp, w[2])) + h2
        return tf.reduce_sum(h3), w + [x], [cp]

    plain, ours, _ = _compare(build)
    assert_close(plain, ours)


def test_ops_on_two_devices_stay_on_their_device():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) >= 2, "conftest configures two logical CPUs"
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(6)]

    def build(x):
        h, cps = x, []
        for i, v in enumerate(w):
            with tf.device(devices[i % 2]):
                h = tf.tanh(tf.matmul(h, v))
            if i == 2:
                cps.append(h)
        return tf.reduce_sum(h), w + [x], cps

    plain, ours, graph = _compare(build)
    assert_close(plain, ours)
    copies = [op for op in _recomputed_ops(graph) if op.type == "MatMul"]
    assert copies
    originals = {op.name: op.device for op in graph.get_operations()}
    for op in copies:
        original_name = _COPY_NAME.match(op.name).group(1)
        assert op.device == originals[original_name]
    assert len({op.device for op in copies}) == 2


def test_keras_functional_model_with_batchnorm_and_dropout():
    import keras

    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.BatchNormalization()(h)
    mid = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    h = keras.layers.Dropout(0.3)(mid)
    h = keras.layers.Dense(16, activation="relu")(h)
    out = keras.layers.Dense(1)(h)
    model = keras.Model(inp, [out, mid])

    @tf.function
    def step(x):
        out, mid = model(x, training=True)
        loss = tf.reduce_mean(out ** 2)
        plain = tf.gradients(loss, model.trainable_variables)
        ours = memsaving.gradients(loss, model.trainable_variables, checkpoints=[mid])
        return plain, ours

    x = tf.random.normal([5, 8], seed=2)
    plain, ours = step(x)
    assert_close([p.numpy() for p in plain], [o.numpy() for o in ours])


def test_unconnected_gradients_none_and_zero():
    w = tf.Variable(tf.ones([3, 3]))
    unused = tf.Variable(tf.ones([2]))

    @tf.function
    def step(x):
        h = memsaving.checkpoint(tf.tanh(tf.matmul(x, w)))
        loss = tf.reduce_sum(tf.sin(h))
        none = memsaving.gradients(loss, [w, unused])
        zero = memsaving.gradients(loss, [w, unused], unconnected_gradients="zero")
        assert none[1] is None
        return zero

    zero = step(tf.ones([2, 3]))
    np.testing.assert_array_equal(zero[1].numpy(), np.zeros(2))


def test_xs_not_reachable_give_none_and_zeros_like_tf_gradients():
    @tf.function
    def step(x):
        loss = _loss(x)
        unrelated = tf.ones([3]) * 2.0
        return (memsaving.gradients(loss, [unrelated, W[0]], checkpoints="memory"),
                memsaving.gradients(loss, [unrelated], checkpoints="memory", unconnected_gradients="zero"))

    some, zero = step(tf.ones([2, 4]))
    assert some[0] is None and some[1] is not None
    np.testing.assert_array_equal(zero[0].numpy(), np.zeros(3))


def test_xs_that_ys_do_not_depend_on_get_none_like_tf_gradients():
    ws = mlp_weights(3)

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, ws[0])))
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")

    plain, ours = step(tf.ones([4, 16]))
    assert [g is None for g in plain] == [g is None for g in ours] == [False, True, True]


def test_xs_captured_from_an_outer_function_get_their_gradient():
    """A nested tf.function closing over a tensor of the outer function:
    tf.gradients follows the capture; memsaving used to return None."""
    @tf.function
    def outer(x):
        h = tf.tanh(x * 2.0)

        @tf.function
        def inner():
            loss = _loss(h)
            return tf.gradients(loss, [h] + W), memsaving.gradients(loss, [h] + W, checkpoints="memory")

        return inner()

    plain, ours = outer(tf.ones([2, 4]))
    for p, o in zip(plain, ours):
        assert o is not None
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=1e-6)


def test_memory_mode_never_fails_on_a_tiny_graph():
    a = tf.Variable(tf.ones([4, 4]))

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tf.matmul(x, a))
        return tf.gradients(loss, [a])[0], memsaving.gradients(loss, [a], checkpoints="memory")[0]

    plain, ours = step(tf.ones([2, 4]))
    assert (plain.numpy() == ours.numpy()).all()


def test_collection_marking_and_shorthands():
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(5)]

    @tf.function
    def step(x):
        h = x
        for i, v in enumerate(w):
            h = tf.nn.relu(tf.matmul(h, v))
            if i == 2:
                h = memsaving.checkpoint(h)
        loss = tf.reduce_sum(h)
        plain = tf.gradients(loss, w)
        return (plain, memsaving.gradients_collection(loss, w), memsaving.gradients_speed(loss, w),
                memsaving.gradients_memory(loss, w), memsaving.gradients(loss, w))

    x = tf.random.normal([4, 8], seed=9)
    plain, *others = step(x)
    for ours in others:
        assert_close([p.numpy() for p in plain], [o.numpy() for o in ours])


def test_checkpoint_is_identity_in_eager_mode():
    t = tf.ones([2])
    assert memsaving.checkpoint(t) is t


def test_grad_ys_are_chained():
    w = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(4)]

    @tf.function
    def step(x):
        h, cps = x, []
        for i, v in enumerate(w):
            h = tf.tanh(tf.matmul(h, v))
            cps.append(h)
        gy = tf.random.normal(tf.shape(h), seed=5)
        return tf.gradients(h, w, grad_ys=gy), memsaving.gradients(h, w, grad_ys=gy, checkpoints=cps[1:3])

    plain, ours = step(tf.random.normal([3, 8], seed=4))
    assert_close([p.numpy() for p in plain], [o.numpy() for o in ours])


def test_xla_function_warns():
    w = tf.Variable(tf.ones([3, 3]))

    @tf.function(jit_compile=True)
    def step(x):
        h = memsaving.checkpoint(tf.tanh(tf.matmul(x, w)))
        return memsaving.gradients(tf.reduce_sum(tf.sin(h)), [w])

    with pytest.warns(UserWarning, match="XLA"):
        step.get_concrete_function(tf.TensorSpec([2, 3]))


def _keras_case(model, x, mode):
    @tf.function
    def step(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        return tf.gradients(loss, model.trainable_variables), memsaving.gradients(
            loss, model.trainable_variables, checkpoints=mode)

    plain, ours = step(x)
    scale = max(float(np.max(np.abs(p.numpy()))) for p in plain)
    worst = max(float(np.max(np.abs(p.numpy() - o.numpy()))) for p, o in zip(plain, ours))
    assert worst <= 1e-5 * scale, f"max difference {worst:.3g} for gradient scale {scale:.3g}"


@pytest.mark.parametrize("mode", ["speed", "memory"])
def test_keras_conv_net_with_checkpoints_between_conv_and_bias(mode):
    """'speed' keeps conv outputs, so a conv and its BiasAdd fall in two
    segments; oneDNN fuses their gradients, which once made a cycle."""
    import keras

    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3))
    h = inp
    for filters in (8, 8, 16, 16):
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        if filters == 8:
            continue
        h = keras.layers.MaxPooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    _keras_case(model, tf.random.normal([4, 16, 16, 3], seed=1), mode)


@pytest.mark.parametrize("unroll", [False, True])
def test_keras_recurrent_layers(unroll):
    import keras

    keras.utils.set_random_seed(4)
    inp = keras.Input((6, 5))
    h = keras.layers.LSTM(8, return_sequences=True, unroll=unroll)(inp)
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.GRU(4, unroll=unroll)(h)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    _keras_case(model, tf.random.normal([3, 6, 5], seed=2), "memory")


def test_keras_attention_block():
    import keras

    keras.utils.set_random_seed(5)
    inp = keras.Input((8, 16))
    a = keras.layers.MultiHeadAttention(2, 8)(inp, inp)
    h = keras.layers.LayerNormalization()(inp + a)
    h = keras.layers.Dense(32, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(keras.layers.Dense(16)(h) + inp)
    model = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(h))
    for mode in ("memory", "speed"):
        _keras_case(model, tf.random.normal([2, 8, 16], seed=3), mode)
