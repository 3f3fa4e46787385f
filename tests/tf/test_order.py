"""memsaving.tf.order: a unit's gradient ops run in the order the plan was scored in.

Structure (graph only), gradients (equal to tf.gradients either way), a
convolution net that must still run (oneDNN fuses bias gradients into filter
gradients: a wait on a bias gradient would be a cycle), and the measured peak
of a Keras two-tower net with TensorFlow's DEFAULT thread pools, in a process
of its own (the test process runs one inter-op thread, see conftest): the
order the executor picks by itself holds each tower's weight gradients and
the activations they read until the end of a unit, above the prediction.
"""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import in_a_fresh_process
from memsaving.tools import models
from memsaving.tf.order import METADATA, NEVER_WAITS, chain_gradient_groups, gradient_groups

MIB = 2 ** 20


def _dense_chain_graph():
    """x -> MatMul -> Relu -> MatMul -> Sum in a v1 graph; returns (graph, forward ops, made ops)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 4], name="x")
        w1 = tf.constant(np.ones((4, 4), np.float32), name="w1")
        w2 = tf.constant(np.ones((4, 4), np.float32), name="w2")
        h = tf.matmul(x, w1, name="first")
        r = tf.nn.relu(h, name="relu")
        y = tf.matmul(r, w2, name="second")
        loss = tf.reduce_sum(y, name="loss")
        forward = [h.op, r.op, y.op, loss.op]
        before = len(graph.get_operations())
        tf.gradients(loss, [x, w1, w2])
        made = graph.get_operations()[before:]
    return graph, forward, made


def test_groups_follow_the_forward_ops_last_first():
    _, forward, made = _dense_chain_graph()
    groups = gradient_groups(made, list(reversed(forward)))
    owners = [{op.name.split("/")[1] for op in group} for group in groups]
    assert owners == [{"loss_grad"}, {"second_grad"}, {"relu_grad"}, {"first_grad"}]
    assert any(op.type == "ReluGrad" for op in groups[2])


def test_a_group_waits_for_the_weight_gradient_before_it():
    _, forward, made = _dense_chain_graph()
    groups = gradient_groups(made, list(reversed(forward)))
    second = {op.name: op for op in groups[1]}
    weight_gradient = second["gradients/second_grad/MatMul_1"]  # d loss / d w2, read by nothing in the step
    relu_gradient = next(op for op in groups[2] if op.type == "ReluGrad")
    assert weight_gradient not in relu_gradient.control_inputs
    assert chain_gradient_groups(groups) > 0
    assert weight_gradient in relu_gradient.control_inputs


def test_first_group_waits_for_what_it_is_given():
    graph, forward, made = _dense_chain_graph()
    with graph.as_default():
        earlier = tf.no_op(name="earlier_unit")
    groups = gradient_groups(made, list(reversed(forward)))
    chain_gradient_groups(groups, [earlier])
    first = [op for op in groups[0] if op.type not in NEVER_WAITS
             and not any(t.op in groups[0] and t.op.type not in METADATA for t in op.inputs)]
    assert first and all(earlier in op.control_inputs for op in first)
    assert not any(earlier in op.control_inputs for op in groups[0] if op.type == "Const")


def test_bias_gradients_are_not_waited_on():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 3])
        kernel = tf.ones([3, 3, 3, 4])
        conv = tf.nn.conv2d(x, kernel, 1, "SAME", name="conv")
        biased = tf.nn.bias_add(conv, tf.ones([4]), name="bias")
        out = tf.nn.relu(biased, name="relu")
        loss = tf.reduce_sum(out)
        forward = [conv.op, biased.op, out.op, loss.op]
        before = len(graph.get_operations())
        tf.gradients(loss, [x, kernel])
        made = graph.get_operations()[before:]
    chain_gradient_groups(gradient_groups(made, list(reversed(forward))))
    bias_gradients = [op for op in made if op.type == "BiasAddGrad"]
    assert bias_gradients
    for op in made:
        assert not set(bias_gradients) & set(op.control_inputs), op.name


FILTER_GRADIENTS = ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter")


def _fusion_cycles(graph: tf.Graph) -> list:
    """(bias gradient, filter gradient) pairs that oneDNN's graph pass may
    fuse (they read the same incoming gradient once Grappler has removed the
    Identity ops between) and whose fusion would close a cycle: a path of
    data or control edges joins them through other ops.  Which filter
    gradient the pass picks varies between runs, so the failure it causes
    ("nodes in a cycle") is intermittent; this finds every candidate."""
    import networkx as nx

    def root(t):
        while t.op.type == "Identity":
            t = t.op.inputs[0]
        return t

    edges = nx.DiGraph()
    readers = {}
    for op in graph.get_operations():
        edges.add_node(op.name)
        edges.add_edges_from((t.op.name, op.name) for t in op.inputs)
        edges.add_edges_from((c.name, op.name) for c in op.control_inputs)
        if op.type in FILTER_GRADIENTS:
            readers.setdefault(root(op.inputs[2]).ref(), []).append(op)
    cycles = []
    for bias in (op for op in graph.get_operations() if op.type == "BiasAddGrad"):
        for conv in readers.get(root(bias.inputs[0]).ref(), []):
            others = edges.copy()
            others.remove_edges_from([(bias.name, conv.name), (conv.name, bias.name)])
            if nx.has_path(others, bias.name, conv.name) or nx.has_path(others, conv.name, bias.name):
                cycles.append((bias.name, conv.name))
    return cycles


def _pre_activation_blocks():
    """Two ResNetV2-style blocks: ``relu(bn(x))`` feeds a biased 1x1 shortcut
    convolution and a branch of biased convolutions; an Add sums them, so
    the branch's last bias gradient and the shortcut's filter gradient read
    the same incoming gradient."""
    import keras
    layers = keras.layers
    inputs = keras.Input((8, 8, 16))
    h = inputs
    for b in range(2):
        pre = layers.ReLU()(layers.BatchNormalization()(h))
        branch = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(8, 1, name=f"b{b}_1")(pre)))
        branch = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", name=f"b{b}_2")(branch)))
        h = layers.Add()([layers.Conv2D(16, 1, name=f"b{b}_short")(pre), layers.Conv2D(16, 1, name=f"b{b}_3")(branch)])
    return keras.Model(inputs, h, name="blocks")


def _layer_output(graph: tf.Graph, layer: str, op: str) -> tf.Tensor:
    """The output of ``op`` (``convolution``, ``BiasAdd``) of Keras layer
    ``layer``, whatever call suffix Keras gave its name scope."""
    found = [o for o in graph.get_operations()
             if o.name.endswith(f"/{op}") and o.name.split("/")[-2].rsplit("_", 1)[0] == layer]
    assert len(found) == 1, (layer, op, [o.name for o in found])
    return found[0].outputs[0]


def test_no_wait_on_a_bias_gradient_a_later_filter_gradient_may_absorb():
    """Checkpoints at a shortcut convolution and at the branch's last BiasAdd
    put the shortcut in the unit after the bias gradient's.  Before bias
    gradients shared with a convolution were left unwaited, such plans made
    cycle candidates (and one plan of ResNet50V2 failed at run time with
    "1937 nodes in a cycle" in some runs)."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    model = _pre_activation_blocks()
    weights = model.trainable_variables
    x = tf.random.stateless_normal([2, 8, 8, 16], seed=(1, 2))
    choices = [((f"b{s}_short", op), (f"b{b}_3", "BiasAdd"))
               for s in range(2) for op in ("convolution", "BiasAdd") for b in range(2)]
    for checkpoints in choices:

        @tf.function
        def both(x):
            # inference-mode batch norm: in training mode the biases before
            # it get a zero gradient, which both sides compute as rounding noise
            loss = tf.reduce_sum(model(x, training=False))
            graph = tf.compat.v1.get_default_graph()
            chosen = [_layer_output(graph, *c) for c in checkpoints]
            return tf.gradients(loss, weights), memsaving.gradients(loss, weights, checkpoints=chosen)

        assert _fusion_cycles(both.get_concrete_function(x).graph) == [], checkpoints
        plain, ours = both(x)
        for a, b in zip(plain, ours):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


def test_unet_memory_mode_runs_and_matches_tf_gradients():
    """A Keras Conv2D net whose bias reshapes once made a cycle with oneDNN's fusion."""
    model = models.unet(16)
    x = tf.random.stateless_normal([2, 16, 16, 3], seed=(1, 2))
    weights = model.trainable_variables

    @tf.function
    def both(x):
        loss = tf.reduce_mean(tf.square(model(x, training=False)))
        return tf.gradients(loss, weights), memsaving.gradients(loss, weights, checkpoints="memory")

    plain, ours = both(x)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("follow_order", [True, False])
def test_gradients_do_not_depend_on_the_order(follow_order):
    model = models.two_tower(size=16, depth=4, width=16)
    x = tf.random.stateless_normal([8, 16], seed=(3, 4))
    weights = model.trainable_variables

    @tf.function
    def both(x):
        loss = tf.reduce_mean(tf.square(model(x)))
        return tf.gradients(loss, weights), memsaving.gradients(loss, weights, checkpoints="memory",
                                                                follow_order=follow_order)

    plain, ours = both(x)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)


def test_half_precision_forward_passes_are_not_reordered():
    """Grappler rewrites ops with control edges differently; in float16 the
    gradients would round differently from tf.gradients', so by default no
    edge is added (an explicit follow_order=True still adds them)."""
    counts = {}
    for follow_order in (None, True):
        x = tf.random.stateless_normal([4, 8], seed=(1, 1))
        w = tf.Variable(tf.ones([8, 8]))

        @tf.function
        def step(x):
            h = tf.cast(x, tf.float16)
            for _ in range(4):
                h = tf.nn.relu(tf.matmul(h, tf.cast(w, tf.float16)))
            loss = tf.reduce_sum(tf.cast(h, tf.float32))
            kwargs = {} if follow_order is None else {"follow_order": follow_order}
            memsaving.gradients(loss, [w], checkpoints="memory", **kwargs)
            return loss

        graph = step.get_concrete_function(x).graph
        counts[follow_order] = sum(len(op.control_inputs) for op in graph.get_operations()
                                   if "_grad/" in op.name)
    assert counts[True] > counts[None]


def test_follow_order_must_be_a_bool():
    x = tf.constant([1.0])

    @tf.function
    def step():
        return memsaving.gradients(tf.reduce_sum(x * x), [x], follow_order="yes")

    with pytest.raises(TypeError, match="follow_order"):
        step()


def two_tower_figures(follow_order: bool, runs: int = 5) -> dict:
    """Predicted and measured peaks (MiB) of a Keras two-tower step in memory mode."""
    model = models.two_tower(size=256, depth=12, width=256)
    x = tf.random.stateless_normal([512, 256], seed=(1, 2))
    captured = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads, captured["plan"] = memsaving.gradients_and_plan(loss, model.trainable_variables,
                                                               checkpoints="memory", batch_size=512,
                                                               follow_order=follow_order)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    step(x).numpy()
    peaks = [memsaving.measure_peak_increase(step, x) / MIB for _ in range(runs)]
    plan = captured["plan"]
    return {"predicted": (plan.predicted_peak - plan.resident_bytes) / MIB, "measured": peaks}


def test_measured_peak_follows_the_prediction_with_default_threads():
    """Default thread pools: the step's own memory (peak above what was in
    use before it, against the predicted peak above the resident bytes)
    within 10% of the prediction, and the same in every run.

    Measured on 2 cores, a process per setting: 5.25 MiB in every run
    against 5.25 predicted (the data gradients a free thread runs during
    each recomputation counted); with ``two_tower_figures(False)``,
    5.50-5.76 MiB.

    "The same" allows one run in five to differ: the order pins the
    gradient ops, not the caller's ops that read the gradients (here each
    weight gradient's ``reduce_sum``), which a busy thread can run late
    (the likely cause).
    One full fresh-clone run read 5.25 four times and 5.50 once (one
    256 KiB weight gradient more); 600 runs measured the same way, on an
    idle or a loaded machine, did not repeat it."""
    figures = in_a_fresh_process("test_order", "two_tower_figures", True, test_settings=False)
    measured, predicted = figures["measured"], figures["predicted"]
    print(f"\ntwo towers, memory mode, default threads: predicted {predicted:.2f} MiB, measured "
          f"{min(measured):.2f}-{max(measured):.2f} MiB")
    assert max(measured) <= 1.10 * predicted
    assert max(measured) >= 0.9 * predicted
    typical = float(np.median(measured))
    assert sum(abs(peak - typical) > 0.03 * predicted for peak in measured) <= 1, measured


def encoder_figures(runs: int = 5) -> dict:
    """Predicted and measured peaks (MiB) of a Keras MultiHeadAttention
    encoder step, plain ``tf.gradients`` and memory mode."""
    model = models.attention_encoder(size=64, blocks=2, dim=128, heads=4)
    x = tf.random.stateless_normal([16, 64, 128], seed=(1, 2))
    figures = {}
    for mode in ("plain", "memory"):
        captured = {}

        @tf.function
        def step(x):
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
            grads, captured["plan"] = memsaving.gradients_and_plan(loss, model.trainable_variables,
                                                                   checkpoints="memory", batch_size=16)
            if mode == "plain":
                grads = tf.gradients(loss, model.trainable_variables)
            return tf.add_n([tf.reduce_sum(g) for g in grads])

        step(x).numpy()
        plan = captured["plan"]
        predicted = plan.plain_peak if mode == "plain" else plan.predicted_peak
        figures[mode] = {"predicted": (predicted - plan.resident_bytes) / MIB,
                         "measured": [memsaving.measure_peak_increase(step, x) / MIB for _ in range(runs)]}
    return figures


@pytest.mark.slow  # 15 s; test_measured_peak_follows_the_prediction_with_default_threads keeps default threads in the default run
def test_attention_encoder_prediction_with_default_threads():
    """Default thread pools, Keras MultiHeadAttention, LayerNormalization
    and Dense: plain and memory-mode predictions within 15% of the measured
    peaks (the parallel executor's early data gradients, attention's
    per-operand reads and precomputed softmax factor counted).

    The measured figure is the median of five runs of one trace: with
    default threads the executor's order, and so the peak, moves from run to
    run (memory mode measured 14.8 to 16.3 MiB over three runs of one trace
    in a full fresh-clone run, where the maximum failed the bound once).

    Measured on 2 cores: plain 32.3 predicted, 33.3 measured; memory mode
    13.5 predicted, 14.8 measured."""
    figures = in_a_fresh_process("test_order", "encoder_figures", test_settings=False)
    median = {mode: float(np.median(found["measured"])) for mode, found in figures.items()}
    for mode, found in figures.items():
        predicted = found["predicted"]
        print(f"\nattention encoder, {mode}, default threads: predicted {predicted:.2f} MiB, "
              f"measured {min(found['measured']):.2f}-{max(found['measured']):.2f} MiB (median {median[mode]:.2f})")
        assert 0.85 * median[mode] <= predicted <= 1.15 * median[mode], mode
    assert median["memory"] * 2 <= median["plain"]


def test_a_recomputed_power_waits_through_its_input():
    """A segment that starts at ``x ** 3`` (tanh-Gelu): the copy of the Pow
    waits through an Identity on its input, never by control edges of its
    own, which Grappler's arithmetic optimizer mishandles (a keras_hub BERT
    budget plan logged "ConvertPow__inner_Pow does not exist" and ran
    unoptimized).  Gradients equal tf.gradients'; Grappler logs no failure."""
    from helpers import grappler_failures
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((64, 64)).astype(np.float32) / 8) for _ in range(4)]
    x = tf.constant(rng.standard_normal((32, 64)).astype(np.float32))
    made = {}

    @tf.function
    def both(x):
        h, starts = x, []
        for w in weights:
            a = tf.matmul(h, w)
            starts.append(a)
            h = 0.5 * a * (1.0 + tf.tanh(0.7978846 * (a + 0.044715 * tf.pow(a, 3.0))))
        loss = tf.reduce_sum(h * h)
        ours = memsaving.gradients(loss, weights, checkpoints=starts)
        made["graph"] = tf.compat.v1.get_default_graph()
        return tf.gradients(loss, weights), ours

    (plain, ours), failures = grappler_failures(lambda: both(x))
    assert not failures, failures
    copies = [op for op in made["graph"].get_operations()
              if op.type == "Pow" and "recompute_" in op.name and "_grad/" not in op.name]
    assert copies
    for op in copies:
        assert not op.control_inputs, op.name
        waiting = op.inputs[0].op
        assert waiting.type == "Identity" and waiting.control_inputs, (op.name, waiting.type)
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
