"""Robustness: control flow, dtypes and mixed precision, tf.distribute.

Gradients are compared with tf.gradients computed in the same function.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import assert_close

MODES = [dict(checkpoints="memory"), dict(checkpoints="speed"), dict(checkpoints=[])]


def _mlp_weights(n, width=16, dtype=tf.float32, seed=0):
    rng = np.random.RandomState(seed)
    return [tf.Variable((rng.randn(width, width) / np.sqrt(width)).astype(dtype.as_numpy_dtype)) for _ in range(n)]


def _compare(loss_fn, ws, x, rtol=1e-5, **kwargs):
    @tf.function
    def both(x):
        loss = loss_fn(x)
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, **kwargs)

    plain, ours = both(x)
    assert_close([p.numpy() for p in plain], [o.numpy() for o in ours], rtol=rtol)


@pytest.mark.parametrize("kwargs", MODES + [dict(budget="fraction")], ids=lambda k: str(list(k.values())[0]))
def test_cond_and_while_loop_in_the_forward_pass(kwargs):
    ws = _mlp_weights(8)

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
            _compare(loss_fn, ws, x, **kwargs)
        except memsaving.BudgetError as error:  # a fixed fraction may be infeasible: use the floor
            _compare(loss_fn, ws, x, budget=error.smallest_budget)
        return
    _compare(loss_fn, ws, x, **kwargs)


def test_control_flow_ops_are_never_cut_inside():
    """The cond and the loop are single ops of the outer graph: a plan may
    keep or recompute them whole, and the plan lists only outer-graph ops."""
    ws = _mlp_weights(4)
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


@pytest.mark.parametrize("dtype, rtol", [(tf.float64, 1e-10), (tf.float16, 2e-2), (tf.bfloat16, 5e-2)])
def test_other_float_dtypes(dtype, rtol):
    ws = _mlp_weights(6, dtype=tf.float32)
    cast = [tf.Variable(tf.cast(w, dtype)) for w in ws]

    def loss_fn(x):
        h = x
        for w in cast:
            h = tf.tanh(tf.matmul(h, w))
        return tf.reduce_sum(tf.cast(h, tf.float32) ** 2)

    x = tf.cast(tf.random.normal([16, 16], seed=3), dtype)

    @tf.function
    def both(x):
        loss = loss_fn(x)
        return tf.gradients(loss, cast), memsaving.gradients(loss, cast, checkpoints="memory")

    plain, ours = both(x)
    for p, o in zip(plain, ours):
        np.testing.assert_allclose(tf.cast(o, tf.float64).numpy(), tf.cast(p, tf.float64).numpy(),
                                   rtol=rtol, atol=rtol)


def test_simulated_sizes_use_the_real_dtype():
    """The same net in float16 is predicted at half the float32 activation bytes."""
    predicted = {}
    for dtype in (tf.float32, tf.float16):
        ws = [tf.Variable(tf.cast(w, dtype)) for w in _mlp_weights(6)]

        @tf.function
        def step(x):
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.cast(tf.reduce_sum(h), tf.float32)
            plan = memsaving.plan(loss, ws, checkpoints=[], profile=False)  # the size model alone
            predicted[dtype] = plan.plain_peak - plan.resident_bytes
            return loss

        step(tf.cast(tf.random.normal([256, 16]), dtype))
    assert predicted[tf.float16] == pytest.approx(predicted[tf.float32] / 2, rel=0.05)


@pytest.mark.parametrize("policy, tolerance", [("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)])
def test_keras_mixed_precision_policies(policy, tolerance):
    import keras

    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(4)
        inp = keras.Input((16,))
        h = inp
        for _ in range(6):
            h = keras.layers.Dense(32, activation="relu")(h)
        out = keras.layers.Dense(1, dtype="float32")(h)
        model = keras.Model(inp, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    @tf.function
    def both(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        ws = model.trainable_variables
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")

    plain, ours = both(tf.random.normal([8, 16], seed=5))
    for p, o in zip(plain, ours):
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=tolerance, atol=tolerance / 10)


def test_integer_and_bool_tensors_and_casts():
    ws = _mlp_weights(4)

    def loss_fn(x):
        h = tf.tanh(tf.matmul(x, ws[0]))
        mask = h > 0  # bool
        count = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1, keepdims=True)  # int
        h = tf.where(mask, h, -h) * tf.cast(count, tf.float32)
        h = tf.tanh(tf.matmul(h, ws[1]))
        idx = tf.argmax(h, axis=1)  # int64
        h = h + tf.cast(tf.one_hot(idx, 16), tf.float32)
        h = tf.tanh(tf.matmul(h, ws[2]))
        return tf.reduce_sum(tf.matmul(h, ws[3]) ** 2)

    for kwargs in MODES:
        _compare(loss_fn, ws, tf.random.normal([16, 16], seed=6), **kwargs)


def test_mirrored_strategy_over_two_devices():
    devices = ["/CPU:0", "/CPU:1"]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        ws = [tf.Variable(w) for w in _mlp_weights(6)]
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


def test_tf1_control_flow_is_refused_with_advice():
    from tensorflow.python.ops import control_flow_v2_toggles

    graph = tf.Graph()
    control_flow_v2_toggles.disable_control_flow_v2()
    try:
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4, 4])
            w = tf.compat.v1.Variable(np.eye(4, dtype=np.float32), use_resource=True)
            h = tf.compat.v1.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, w), lambda: tf.tanh(x))
            loss = tf.reduce_sum(h * h)
            with pytest.raises(memsaving.UnsupportedGraphError, match="control flow v2"):
                memsaving.gradients(loss, [w], checkpoints="memory")
    finally:
        control_flow_v2_toggles.enable_control_flow_v2()


@pytest.mark.parametrize("budget, message", [("lots", "512MiB"), (-5, "positive"), ("12 parsecs", "2GiB"),
                                             (3.5j, "int number of bytes")])
def test_bad_budgets_say_what_to_pass(budget, message):
    ws = _mlp_weights(2)

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(x, ws[0])), ws[1]))
        return memsaving.gradients(loss, ws, budget=budget)

    with pytest.raises((ValueError, TypeError), match=message):
        step(tf.ones([4, 16]))


def test_xs_that_ys_do_not_depend_on_get_none_like_tf_gradients():
    ws = _mlp_weights(3)

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, ws[0])))
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")

    plain, ours = step(tf.ones([4, 16]))
    assert [g is None for g in plain] == [g is None for g in ours] == [False, True, True]


def test_the_plan_names_ops_it_never_recomputes():
    """A stateful call between xs and ys (it updates a counter and draws
    random numbers) is kept whole, and the plan says so."""
    ws = _mlp_weights(4)
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
