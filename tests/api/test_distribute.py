"""tf.distribute.MirroredStrategy over the two logical CPUs.

memsaving.gradients inside strategy.run (gradients equal tf.gradients' under
the same strategy, and each replica's recomputed ops sit on its own device),
and memsaving.keras.enable + model.fit under strategy.scope().
"""

import gc

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import mlp_weights

DEVICES = ["/CPU:0", "/CPU:1"]


def _model():
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="tanh")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(8, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(1)(h))


@pytest.mark.parametrize("checkpoints", ["memory", "speed", "budget"])
def test_strategy_run_with_keras_model_and_optimizer(checkpoints):
    import keras

    # ReductionToOneDevice: no collective ops, whose instance keys would
    # collide with other MirroredStrategy objects of the same process
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 8, 8, 2)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    results, graphs = {}, []
    for use_memsaving in (False, True):
        # Free the previous step's model now. Collected during the trace, between the budget's plan()
        # and the gradients call, it would lower the memory in use the second call counts as resident,
        # and the budget would then fit plain backprop on replica 0.
        model = optimizer = step = None
        gc.collect()
        with strategy.scope():
            model = _model()
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)

        def replica_step(xb, yb):
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2) / strategy.num_replicas_in_sync
            ws = model.trainable_variables
            if not use_memsaving:
                grads = tf.gradients(loss, ws)
            elif checkpoints == "budget":
                # a budget memory mode's plan may run under: feasible, and below plain, so something is
                # recomputed (a BudgetError's smallest_budget can be plain's when the search finds little)
                budget = memsaving.plan(loss, ws, checkpoints="memory").needed_budget
                grads = memsaving.gradients(loss, ws, budget=budget, checkpoints="memory")
            else:
                grads = memsaving.gradients(loss, ws, checkpoints=checkpoints)
            graphs.append(loss.graph)
            optimizer.apply_gradients(zip(grads, ws))
            return loss

        @tf.function
        def step(batch):
            losses = strategy.run(replica_step, args=batch)
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        loss = step(next(iter(strategy.experimental_distribute_dataset(dataset))))
        results[use_memsaving] = (float(loss), [v.numpy() for v in model.weights])
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-6)
    for a, b in zip(results[False][1], results[True][1]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)

    graph = graphs[-1]
    copies = [op for op in graph.get_operations() if "/recompute" in op.name]
    assert copies, "something was recomputed"
    by_replica = {}
    for op in copies:
        replica = 1 if "replica_1" in op.name else 0
        index = tf.DeviceSpec.from_string(op.device).device_index if op.device else None
        by_replica.setdefault(replica, set()).add(index)
    assert by_replica == {0: {0}, 1: {1}}, by_replica


def test_mirrored_strategy_over_two_devices():
    devices = ["/CPU:0", "/CPU:1"]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        ws = [tf.Variable(w) for w in mlp_weights(6)]
    graphs = []

    @tf.function
    def step(x):
        def replica(x):
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h * h)
            graphs.append(loss.graph)
            return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")
        return strategy.run(replica, args=(x,))

    x = tf.random.normal([16, 16], seed=7)
    plain, ours = step(x)
    for p, o in zip(plain, ours):
        for pv, ov in zip(strategy.experimental_local_results(p), strategy.experimental_local_results(o)):
            np.testing.assert_allclose(ov.numpy(), pv.numpy(), rtol=1e-5, atol=1e-6)
    # each replica's recomputed copies stay on its own device
    graph = graphs[0]
    copies = [op for op in graph.get_operations() if "recompute" in op.name and op.type == "MatMul"]
    assert copies, "memory mode recomputed something"
    by_replica = {}
    for op in copies:
        replica = 1 if "replica_1" in op.name else 0
        by_replica.setdefault(replica, set()).add(tf.DeviceSpec.from_string(op.device).device_index)
    assert set(by_replica) == {0, 1}
    assert by_replica[0] == {0} and by_replica[1] == {1}, by_replica


def test_keras_fit_under_mirrored_strategy():
    """memsaving.keras.enable inside MirroredStrategy.scope(): fit gives the
    losses and weights of plain Keras under the same strategy; BatchNorm's
    moving statistics (updated in the forward pass, never recomputed) too."""
    import keras

    import memsaving.keras as mkeras

    strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype("float32")
    y = rng.integers(0, 4, 64)

    def train(enabled):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            inp = keras.Input((16,))
            h = inp
            for _ in range(6):
                h = keras.layers.Dense(32, activation="tanh")(h)
                h = keras.layers.BatchNormalization()(h)
            model = keras.Model(inp, keras.layers.Dense(4)(h))
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if enabled:
            mkeras.enable(model, checkpoints="memory", verbose=False)
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model, history.history["loss"]

    plain_model, plain_loss = train(False)
    ours_model, ours_loss = train(True)
    assert mkeras.plan_of(ours_model) is not None, "the step ran through memsaving"
    np.testing.assert_allclose(ours_loss, plain_loss, rtol=1e-4)
    for a, b in zip(plain_model.get_weights(), ours_model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
