"""Parameters versus data: graphs fed from constants and variables.

A graph whose input is ``tf.ones``, a learned input (a variable) or
``tf.ones * variable`` is computed from constants and variables alone, yet
its activations are data that ``"memory"`` must checkpoint, while a weight's
reshape, cast or transpose stays a parameter (rule:
:func:`memsaving.model.parameters.parameter_ops`).

The first tests use hand-built neutral models (no TensorFlow graph); the
others trace real steps and measure peaks with the CPU BFC allocator
(conftest sets it up).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
from memsaving.candidates import cuts as candidates
from memsaving.model import parameters
from memsaving.tf.extract import graph_model
from memsaving.tf.forward import forward_graph
from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, validate_model

F32 = 4


class Builder:
    """A neutral model written op by op; ``*_flops`` costs as extract gives them."""

    def __init__(self):
        self.tensors, self.ops = {}, []

    def external(self, name, nbytes, constant=False, variable=False):
        t = len(self.tensors)
        self.tensors[t] = TensorInfo(name, 0 if variable else nbytes, -1, constant=constant or variable,
                                     value_bytes=nbytes if variable else None)
        return t

    def op(self, name, kind, inputs, nbytes, cost=None, forward=True, view=False, copyable=True):
        t = len(self.tensors)
        self.tensors[t] = TensorInfo(name, 0 if view else nbytes, len(self.ops),
                                     value_bytes=nbytes if view else None)
        self.ops.append(OpInfo(name, kind, tuple(inputs), (t,), forward=forward, copyable=copyable,
                               grad_reads=tuple(inputs), cost=float(nbytes // F32 if cost is None else cost)))
        return t

    def read(self, handle, nbytes, forward=True):
        return self.op(f"read_{self.tensors[handle].name}", "ReadVariableOp", [handle], nbytes,
                       forward=forward, view=True)

    def matmul(self, a, w, rows, k, cols, name):
        return self.op(name, "MatMul", [a, w], rows * cols * F32, cost=2 * rows * k * cols)

    def model(self, xs, y):
        model = GraphModel(self.ops, self.tensors, xs=xs, ys=[y])
        validate_model(model)
        return model

    def index(self, name):
        return next(i for i, op in enumerate(self.ops) if op.name == name)


BATCH, WIDTH = 128, 64


def _tanh_chain(b, h, depth, xs, start=0):
    """``depth`` layers h = tanh(h @ w_i); returns the last tensor."""
    for i in range(start, start + depth):
        w = b.external(f"w{i}", WIDTH * WIDTH * F32, variable=True)
        xs.append(w)
        h = b.matmul(h, b.read(w, WIDTH * WIDTH * F32), BATCH, WIDTH, WIDTH, f"matmul{i}")
        h = b.op(f"tanh{i}", "Tanh", [h], BATCH * WIDTH * F32)
    return h


def _fill(b):
    """``tf.ones([BATCH, WIDTH])``: a Fill from a shape and a scalar constant."""
    shape = b.external("shape", 8, constant=True)
    one = b.external("one", 4, constant=True)
    return b.op("ones", "Fill", [shape, one], BATCH * WIDTH * F32, forward=False)


def test_weight_reshape_cast_and_transpose_are_parameters():
    b = Builder()
    gamma = b.external("gamma", WIDTH * F32, variable=True)
    emb = b.external("emb", 1000 * WIDTH * F32, variable=True)
    x = b.external("x", BATCH * WIDTH * F32)  # a function argument: data
    g = b.op("gamma_reshape", "Reshape", [b.read(gamma, WIDTH * F32)], WIDTH * F32, view=True)
    g16 = b.op("gamma_cast", "Cast", [g], WIDTH * 2)
    h = b.op("scale", "Mul", [x, g16], BATCH * WIDTH * F32)
    tied = b.op("emb_transpose", "Transpose", [b.read(emb, 1000 * WIDTH * F32)], 1000 * WIDTH * F32)
    logits = b.matmul(h, tied, BATCH, WIDTH, 1000, "logits")
    model = b.model([gamma, emb], b.op("loss", "Sum", [logits], 4))
    params = {model.ops[i].name for i in parameters.parameter_ops(model)}
    assert params == {"read_gamma", "gamma_reshape", "gamma_cast", "read_emb", "emb_transpose"}


def test_ones_times_variable_broadcast_to_a_batch_is_data():
    b = Builder()
    v = b.external("v", WIDTH * F32, variable=True)
    xs = [v]
    h = b.op("ones_times_v", "Mul", [_fill(b), b.read(v, WIDTH * F32)], BATCH * WIDTH * F32)
    model = b.model(xs, b.op("loss", "Sum", [_tanh_chain(b, h, 6, xs)], 4))
    params = {model.ops[i].name for i in parameters.parameter_ops(model)}
    assert "ones" not in params and "ones_times_v" not in params
    assert params == {f"read_{t}" for t in ["v"] + [f"w{i}" for i in range(6)]}
    assert candidates.memory_candidates(model)


@pytest.mark.parametrize("feed", ["fill", "constant", "variable"])
def test_a_chain_fed_by_constants_has_activations(feed):
    """Fed by ``tf.ones``, by a constant batch embedded in the graph, or by a
    learned input: the chain's matmuls and tanhs are activations with
    separators between them, and a BatchNorm-like gamma reshape in the
    middle stays a parameter."""
    b = Builder()
    xs = []
    if feed == "fill":
        h = _fill(b)
    elif feed == "constant":
        h = b.external("batch", BATCH * WIDTH * F32, constant=True)
    else:
        learned = b.external("learned", BATCH * WIDTH * F32, variable=True)
        xs.append(learned)
        h = b.read(learned, BATCH * WIDTH * F32)
    h = _tanh_chain(b, h, 4, xs)
    gamma = b.external("gamma", WIDTH * F32, variable=True)
    xs.append(gamma)
    g = b.op("gamma_reshape", "Reshape", [b.read(gamma, WIDTH * F32)], WIDTH * F32, view=True)
    h = b.op("bn_scale", "Mul", [h, g], BATCH * WIDTH * F32)
    h = _tanh_chain(b, h, 4, xs, start=4)
    model = b.model(xs, b.op("loss", "Sum", [h], 4))
    params = {model.ops[i].name for i in parameters.parameter_ops(model)}
    assert "gamma_reshape" in params
    assert not any(name.startswith(("matmul", "tanh", "bn_scale", "ones")) for name in params)
    separators = [model.ops[i].name for i in candidates.articulation(model)]
    assert "gamma_reshape" not in separators
    assert {"tanh0", "tanh3", "bn_scale", "tanh6"} <= set(separators)


def _lora_layers(b, h, depth, xs, rank=4):
    """Dense layers whose kernel is ``W + A @ B`` (Keras' LoRA): the product
    of two weights is larger than either and costs many FLOPs per byte."""
    for i in range(depth):
        w = b.read(b.external(f"w{i}", WIDTH * WIDTH * F32, variable=True), WIDTH * WIDTH * F32, forward=False)
        a = b.external(f"a{i}", WIDTH * rank * F32, variable=True)
        bb = b.external(f"b{i}", WIDTH * rank * F32, variable=True)
        xs += [a, bb]
        ab = b.matmul(b.read(a, WIDTH * rank * F32), b.read(bb, WIDTH * rank * F32), WIDTH, rank, WIDTH, f"ab{i}")
        scaled = b.op(f"scaled{i}", "Mul", [ab, b.external(f"alpha{i}", 4, constant=True)], WIDTH * WIDTH * F32)
        kernel = b.op(f"kernel{i}", "AddV2", [w, scaled], WIDTH * WIDTH * F32)
        h = b.op(f"tanh{i}", "Tanh", [b.matmul(h, kernel, BATCH, WIDTH, WIDTH, f"matmul{i}")], BATCH * WIDTH * F32)
    return h


@pytest.mark.parametrize("feed", ["argument", "fill"])
def test_a_lora_product_that_only_builds_a_kernel_is_a_parameter(feed):
    b = Builder()
    xs = []
    h = b.external("x", BATCH * WIDTH * F32) if feed == "argument" else _fill(b)
    model = b.model(xs, b.op("loss", "Sum", [_lora_layers(b, h, 5, xs)], 4))
    params = {model.ops[i].name for i in parameters.parameter_ops(model)}
    assert {f"{kind}{i}" for kind in ("ab", "scaled", "kernel") for i in range(5)} <= params
    assert not any(name.startswith(("matmul", "tanh")) for name in params)
    separators = {model.ops[i].name for i in candidates.articulation(model)}
    assert {"tanh0", "tanh1", "tanh2", "tanh3"} <= separators


def test_a_heavy_regulariser_added_to_the_loss_is_a_parameter():
    """``sum((W^T W)^2)`` (an orthogonality penalty) added to a data loss:
    a product of weights that only reaches the loss through cheap ops."""
    b = Builder()
    xs = []
    h = _tanh_chain(b, b.external("x", BATCH * WIDTH * F32), 3, xs)
    w = b.read(xs[0], WIDTH * WIDTH * F32)
    gram = b.matmul(w, w, WIDTH, WIDTH, WIDTH, "gram")
    penalty = b.op("penalty", "Sum", [b.op("square", "Square", [gram], WIDTH * WIDTH * F32)], 4)
    data_loss = b.op("data_loss", "Sum", [h], 4)
    model = b.model(xs, b.op("loss", "AddV2", [data_loss, penalty], 4))
    params = {model.ops[i].name for i in parameters.parameter_ops(model)}
    assert {"gram", "square", "penalty"} <= params


def test_stateful_and_argument_inputs_are_data_as_before():
    b = Builder()
    seed = b.external("seed", 8, constant=True)
    noise = b.op("noise", "RandomStandardNormal", [seed], BATCH * WIDTH * F32, forward=False, copyable=False)
    xs = []
    h = b.op("add", "AddV2", [noise, b.external("x", BATCH * WIDTH * F32)], BATCH * WIDTH * F32, forward=False)
    model = b.model(xs, b.op("loss", "Sum", [_tanh_chain(b, h, 3, xs)], 4))
    params = {model.ops[i].name for i in parameters.parameter_ops(model)}
    assert params == {"read_w0", "read_w1", "read_w2"}


# -- TensorFlow: the chains --------------------------------------------------

DEPTH, TF_BATCH, TF_WIDTH = 60, 256, 256
FEEDS = ["ones", "variable", "ones_times_variable", "argument"]


def _weights(depth, width, seed):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.standard_normal((width, width)).astype(np.float32) * width ** -0.5)
            for _ in range(depth)]


def _chain_step(feed, ws, reduce, mode, learned=None, scale=None):
    """A tf.function computing one gradient step of the tanh chain on ``feed``.

    ``mode``: "plain", "memory" or "both" (plain and memsaving gradients of
    one forward graph, and the memsaving plan's checkpoint names)."""
    found = {}

    @tf.function
    def step(arg):
        h = {"ones": lambda: tf.ones([TF_BATCH, TF_WIDTH]),
             "variable": lambda: learned,
             "ones_times_variable": lambda: tf.ones([TF_BATCH, TF_WIDTH]) * scale,
             "argument": lambda: arg}[feed]()
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(h * h)
        if mode == "both":
            found["checkpoints"] = memsaving.plan(loss, ws, checkpoints="memory").checkpoints
            return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")
        grads = tf.gradients(loss, ws) if mode == "plain" else memsaving.gradients(loss, ws, checkpoints="memory")
        return tf.add_n([tf.reduce_sum(g) for g in grads]) if reduce else grads

    return step, found


def _feed_variables():
    rng = np.random.default_rng(7)
    learned = tf.Variable(rng.standard_normal((TF_BATCH, TF_WIDTH)).astype(np.float32))
    scale = tf.Variable(rng.uniform(0.5, 1.5, TF_WIDTH).astype(np.float32))
    return learned, scale


@pytest.mark.parametrize("feed", FEEDS)
def test_memory_mode_checkpoints_every_feed_and_gradients_equal(feed):
    ws = _weights(DEPTH, TF_WIDTH, seed=1)
    learned, scale = _feed_variables()
    step, found = _chain_step(feed, ws, False, "both", learned, scale)
    plain, ours = step(tf.random.normal([TF_BATCH, TF_WIDTH], seed=3))
    assert len(found["checkpoints"]) >= 4, found["checkpoints"]
    assert all(name.startswith(("Tanh", "MatMul")) for name in found["checkpoints"])
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("feed", FEEDS)
def test_memory_mode_measured_peak_is_3x_lower_on_every_feed(feed):
    """Peaks of one step (weight gradients reduced inside it, so the
    activations dominate): plain tf.gradients against "memory"."""
    ws = _weights(DEPTH, TF_WIDTH, seed=1)
    learned, scale = _feed_variables()
    arg = tf.random.normal([TF_BATCH, TF_WIDTH], seed=3)
    peaks = {}
    for mode in ("plain", "memory"):
        step, _ = _chain_step(feed, ws, True, mode, learned, scale)
        step(arg)  # trace and warm up
        peaks[mode] = memsaving.measure_peak_increase(step, arg)
    print(f"\n{feed}: plain {peaks['plain'] / 2**20:.1f} MiB, memory {peaks['memory'] / 2**20:.1f} MiB, "
          f"{peaks['plain'] / peaks['memory']:.2f}x lower")
    assert peaks["plain"] > 0.8 * DEPTH * TF_BATCH * TF_WIDTH * 4, "plain backprop holds every activation"
    assert peaks["plain"] >= 3 * peaks["memory"]


def test_residual_net_fed_from_ones_gets_checkpoints_and_equal_gradients():
    ws = _weights(16, 128, seed=5)
    found = {}

    @tf.function
    def step():
        h = tf.ones([128, 128])
        for w in ws:
            h = h + tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_sum(tf.square(h))
        found["checkpoints"] = memsaving.plan(loss, ws, checkpoints="memory").checkpoints
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, checkpoints="memory")

    plain, ours = step()
    assert len(found["checkpoints"]) >= 2, found["checkpoints"]
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-6)


# -- Keras: BatchNorm and LayerNorm weights stay parameters ------------------------------

def _keras_norm_net():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = inputs
    for _ in range(4):
        h = keras.layers.Conv2D(8, 3, padding="same")(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h))


def _computed_from_weights_alone(model):
    """The former rule: variable reads and ops computed from constants,
    variables and such ops alone."""
    found = set()
    for i, op in enumerate(model.ops):
        sources = [model.tensors[t] for t in op.inputs]
        if op.type == "ReadVariableOp" or (op.copyable and sources and all(
                (s.producer < 0 and s.constant) or s.producer in found for s in sources)):
            found.add(i)
    return found


@pytest.mark.parametrize("feed", ["argument", "ones"])
def test_keras_norm_weights_stay_parameters(feed):
    """Fed by an argument, the forward parameter ops are exactly those of the
    former rule (nothing a Keras layer does to its weights turns into data);
    fed by ``tf.ones``, the same weight reshapes and casts are parameters and
    the convolutions are activations."""
    net = _keras_norm_net()
    variables = net.trainable_variables
    found = {}

    @tf.function(autograph=False)
    def inspect(arg):
        x = arg if feed == "argument" else tf.ones([16, 8, 8, 3])
        loss = tf.reduce_mean(tf.square(net(x, training=True)))
        fwd = forward_graph([tf.convert_to_tensor(v.value.handle) for v in variables], [loss])
        model = graph_model(fwd)
        params = parameters.parameter_ops(model)
        found["params"] = sorted(model.ops[i].type for i in params if model.ops[i].forward)
        found["former"] = sorted(model.ops[i].type for i in _computed_from_weights_alone(model)
                                 if model.ops[i].forward)
        found["activations"] = {model.ops[i].type for i in candidates.activation_digraph(model)[1]}
        found["checkpoints"] = memsaving.plan(loss, variables, checkpoints="memory").checkpoints
        return loss

    inspect(tf.random.normal([16, 8, 8, 3], seed=0))
    assert found["params"].count("ReadVariableOp") == len(variables)
    assert {"Reshape", "Squeeze"} <= set(found["params"])
    if feed == "argument":
        assert found["params"] == found["former"]
    else:
        assert "Conv2D" in found["activations"] and "Relu" in found["activations"]
    assert found["checkpoints"]
