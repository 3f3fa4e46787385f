"""BatchNorm in training mode, dropout and stateful random ops.

Stateful ops (random draws, variable reads, assignments) are never copied:
their outputs are kept from the forward pass, so gradients are bit-for-bit
those of tf.gradients, and moving averages are updated once per step.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import smallest_budget

RANDOM_OPS = ("RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt",
              "StatelessRandomUniformV2", "StatelessRandomGetKeyCounter", "AssignVariableOp",
              "AssignAddVariableOp", "AssignSubVariableOp")


@pytest.mark.parametrize("mode", ["memory", "speed", "smallest_budget"])
def test_stateful_random_ops_are_kept_and_gradients_are_exact(mode):
    ws = [tf.Variable(tf.random.normal([16, 16], seed=i) * 0.3) for i in range(6)]
    gen = tf.random.Generator.from_seed(5)
    captured = {}

    @tf.function
    def step(x):
        h = x
        for i, w in enumerate(ws):
            h = tf.nn.relu(tf.matmul(h, w))
            if i == 0:
                h = tf.nn.dropout(h, rate=0.4, seed=1)  # RandomUniform
            elif i == 2:
                h = h * tf.random.uniform(tf.shape(h), 0.5, 1.5, seed=2) + tf.random.normal(tf.shape(h), seed=3)
            elif i == 3:
                h = h + gen.normal(tf.shape(h)) * 0.1  # stateful generator (variable update)
            elif i == 4:
                h = h * tf.random.stateless_uniform(tf.shape(h), seed=[1, 2])  # stateless: copyable
        loss = tf.reduce_sum(h * h)
        kwargs = {"checkpoints": mode}
        if mode == "smallest_budget":
            kwargs = {"checkpoints": "memory", "budget": smallest_budget(loss, ws, checkpoints="memory")}
        captured["plan"] = memsaving.plan(loss, ws, **kwargs)
        captured["graph"] = loss.graph
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, **kwargs)

    plain, ours = step(tf.random.normal([8, 16], seed=4))
    for p, o in zip(plain, ours):
        np.testing.assert_array_equal(o.numpy(), p.numpy())
    graph = captured["graph"]
    copied = [op for op in graph.get_operations() if "/recompute" in op.name and op.op_def.is_stateful]
    assert not copied, [op.name for op in copied]
    random = [op for op in graph.get_operations()
              if op.type in ("RandomUniform", "RandomStandardNormal") and "/recompute" not in op.name]
    assert len(random) == 3, "the draws exist once, in the forward pass"


def _bn_model():
    import keras

    keras.utils.set_random_seed(7)
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(6, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2D(6, 3, padding="same")(h)
    h = keras.layers.BatchNormalization(momentum=0.5)(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Dropout(0.5)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.Dropout(0.3)(h)
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("checkpoints", ["memory", "speed"])
def test_batchnorm_moving_statistics_update_once_per_step(checkpoints):
    """After one train_on_batch, every weight (moving mean/variance and the
    dropout seed state included) equals plain Keras; the moving mean moved by
    exactly one momentum step from its initial zeros."""
    import memsaving.keras as mkeras

    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 6, 6, 3)).astype("float32") + 1.0
    y = rng.integers(0, 2, 8)
    models = []
    for enabled in (False, True):
        model = _bn_model()
        if enabled:
            mkeras.enable(model, checkpoints=checkpoints, verbose=False)
        model.train_on_batch(x, y)
        models.append(model)
    plain, ours = models
    assert mkeras.plan_of(ours) is not None
    for v, a, b in zip(plain.weights, plain.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(b, a, err_msg=v.path)
    bn = [layer for layer in ours.layers if "batch_normalization" in layer.name][0]
    conv = [layer for layer in ours.layers if "conv2d" in layer.name][0]
    # the batch mean of the first conv, from the weights before the step
    fresh = _bn_model()
    batch_mean = tf.reduce_mean(fresh.layers[1](x), axis=[0, 1, 2]).numpy()
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * batch_mean, rtol=1e-5, atol=1e-6)
    assert conv is not None


def test_batchnorm_updates_are_not_copied_into_recomputation():
    """memsaving.gradients in a custom step (one forward pass, both gradient
    methods): gradients equal exactly, the AssignMovingAvg ops exist once,
    outside memsaving's scope, and the moving mean took one momentum step."""
    model = _bn_model()
    x = tf.random.normal([4, 6, 6, 3], seed=8) + 1.0
    batch_mean = tf.reduce_mean(model.layers[1](x), axis=[0, 1, 2]).numpy()

    @tf.function
    def step(x):
        loss = tf.reduce_mean(model(x, training=True) ** 2)
        ws = model.trainable_variables
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")

    plain, ours = step(x)
    for a, b in zip(plain, ours):
        np.testing.assert_array_equal(b.numpy(), a.numpy())
    graph = step.get_concrete_function(x).graph
    assigns = [op for op in graph.get_operations() if op.type.startswith("Assign")]
    assert assigns and not [op.name for op in assigns if "memsaving" in op.name]
    bn = [layer for layer in model.layers if "batch_normalization" in layer.name][0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * batch_mean, rtol=1e-5, atol=1e-6)
