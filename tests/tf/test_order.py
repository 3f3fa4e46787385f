"""memsaving.tf.order: the step runs in the order the simulator replayed.

Structure (graph only: one total order, the replay's, and the ops left
out of it), the order TensorFlow actually runs (one inter-op thread, a
v1 session's trace), gradients (equal to tf.gradients either way), nets
whose fused ops must not be split by the order (oneDNN merges a bias
gradient into a filter gradient, and a convolution into its bias
addition: an op chained between the two halves is a cycle), and the
measured peak of budget plans with TensorFlow's DEFAULT thread pools, in a
process of their own (the test process runs one inter-op thread, see
conftest): left to itself, the executor runs ready ops in an order that
changes from run to run, and so does the peak.
"""

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import grappler_failures, in_a_fresh_process, session_step_times
from memsaving.tools import models
from memsaving.tf.order import FILTER_GRADIENTS, FREE, gradient_groups, merged_bias_gradients, must_run, pin_step, UnitOps

MIB = 2 ** 20


@pytest.fixture
def parallel_executor(monkeypatch):
    """Plan and rewrite as for TensorFlow's default thread pools (several
    inter-op threads), where the whole step is pinned; this process runs
    one (conftest), where only each unit's gradient groups are chained."""
    from memsaving.tf import extract
    monkeypatch.setattr(extract, "_parallel_executor", lambda: True)


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


def test_forward_ops_follow_the_replay():
    """Two independent ops: the replay's order is given them by an edge."""
    graph = tf.Graph()
    with graph.as_default():
        a = tf.square(tf.constant(1.0), name="a")
        b = tf.square(tf.constant(2.0), name="b")
        y = tf.add(a, b, name="y")
    assert pin_step(["forward b", "forward a", "forward y"], UnitOps(), graph, [], [], [y]) == 1
    assert a.op.control_inputs == [b.op] and not b.op.control_inputs


def _two_towers_v1(width=16, batch=8, depth=3):
    """Two towers of ``tanh(h @ w)`` made interleaved (a layer of one, a
    layer of the other), concatenated, summed; in a v1 graph.  Returns
    (graph, x, loss, weights)."""
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, width], name="x")
        weights = [tf.compat.v1.Variable((rng.standard_normal((width, width)) / 4).astype(np.float32),
                                         use_resource=True, name=f"w{k}") for k in range(2 * depth)]
        a, b = x, x
        for k in range(depth):
            a = tf.tanh(tf.matmul(a, weights[2 * k]), name=f"a{k}")
            b = tf.tanh(tf.matmul(b, weights[2 * k + 1]), name=f"b{k}")
        loss = tf.reduce_sum(tf.concat([a, b], axis=1) ** 2, name="loss")
    return graph, x, loss, weights


def _chained_ops(graph, results, ys):
    """The ops the order chains: those the step runs, not FREE, not merged bias gradients."""
    needed = must_run([g.op for g in results if g is not None] + [y.op for y in ys])
    merged = merged_bias_gradients(list(graph.get_operations()))
    return [op for op in graph.get_operations() if op in needed and op.type not in FREE and op not in merged]


def _edges(graph):
    edges = nx.DiGraph()
    for op in graph.get_operations():
        edges.add_node(op.name)
        edges.add_edges_from((t.op.name, op.name) for t in op.inputs)
        edges.add_edges_from((c.name, op.name) for c in op.control_inputs)
    return edges


def _unordered(graph, results, ys) -> list:
    """Pairs of chained ops (:func:`_chained_ops`) neither of which waits on the other."""
    closure = nx.transitive_closure_dag(_edges(graph))
    chained = [op.name for op in _chained_ops(graph, results, ys)]
    return [(p, q) for n, p in enumerate(chained) for q in chained[n + 1:]
            if not closure.has_edge(p, q) and not closure.has_edge(q, p)]


@pytest.mark.parametrize("follow_order", [True, False])
def test_the_pinned_step_has_one_order(follow_order, parallel_executor):
    """Pinned, every op the step runs (but constants, shapes, identities)
    comes before or after every other: the executor has one op to run at a
    time, whatever its threads.  Unpinned, the towers' ops are unordered."""
    graph, x, loss, weights = _two_towers_v1()
    with graph.as_default():
        grads = memsaving.gradients(loss, weights, checkpoints=[], follow_order=follow_order, profile=False)
    unordered = _unordered(graph, grads, [loss])
    if follow_order:
        assert not unordered, unordered[:5]
    else:
        assert unordered


def test_no_op_waits_on_an_op_the_step_would_not_run(parallel_executor):
    """tf.gradients makes the gradient of ``h * 0.5`` with respect to the
    constant too; nothing reads it and the runtime prunes it.  A wait on it
    would make it run (and keep the activation it reads alive)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 4], name="x")
        w = tf.compat.v1.Variable(np.ones((4, 4), np.float32), use_resource=True)
        h = tf.tanh(tf.matmul(x, w))
        loss = tf.reduce_sum(h * 0.5)
        grads = memsaving.gradients(loss, [w], checkpoints=[], profile=False)
    needed = must_run([g.op for g in grads] + [loss.op])
    assert any(op not in needed and "_grad/" in op.name for op in graph.get_operations())
    for op in graph.get_operations():
        assert all(c in needed for c in op.control_inputs), (op.name, [c.name for c in op.control_inputs])


def test_the_step_runs_in_the_replays_order(parallel_executor):
    """With one inter-op thread too, TensorFlow's executor follows a chain
    of ready ops depth first: the tower made first runs through before the
    other, where the plan replays the layers in the order they were made
    (a layer of one tower, then of the other).  Pinned, every op the
    replay names starts in the replay's order; the prediction is the
    replay of what runs."""
    graph, x, loss, weights = _two_towers_v1(width=64, batch=64)
    with graph.as_default():
        grads, plan = memsaving.gradients_and_plan(loss, weights, checkpoints=[], profile=False)
    times = session_step_times(graph, grads, {x: np.ones((64, 64), np.float32)})
    replayed = []
    for label in plan.simulation.labels:
        kind, _, name = label.partition(" ")
        if kind == "forward" and name in times and graph.get_operation_by_name(name).type not in FREE:
            replayed.append(name)
    assert len(replayed) >= 12
    starts = [times[name][0] for name in replayed]
    assert starts == sorted(starts), [name for _, name in sorted(zip(starts, replayed))]


def test_dense_bias_gradients_are_in_the_order(parallel_executor):
    """A Dense layer's bias gradient (no filter gradient reads its incoming
    gradient) is chained like any op: left to the executor it may wait to
    the end of the step, with the incoming gradient it reads."""
    model = models.mlp(size=16, depth=4, width=16)
    x = tf.random.stateless_normal([8, 16], seed=(1, 2))
    seen = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x)))
        seen["grads"] = memsaving.gradients(loss, model.trainable_variables, checkpoints="memory", profile=False)
        seen["loss"] = loss
        return tf.add_n([tf.reduce_sum(g) for g in seen["grads"]])

    graph = step.get_concrete_function(x).graph
    bias_gradients = [op for op in graph.get_operations() if op.type == "BiasAddGrad"]
    assert bias_gradients and not merged_bias_gradients(bias_gradients)
    assert not _unordered(graph, seen["grads"], [seen["loss"]])


def test_bias_gradients_a_filter_gradient_may_absorb_are_left_out(parallel_executor):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 3])
        kernel = tf.compat.v1.Variable(tf.ones([3, 3, 3, 4]), use_resource=True)
        conv = tf.nn.conv2d(x, kernel, 1, "SAME", name="conv")
        biased = tf.nn.bias_add(conv, tf.ones([4]), name="bias")
        loss = tf.reduce_sum(tf.nn.relu(biased, name="relu"))
        grads = memsaving.gradients(loss, [kernel], checkpoints=[], profile=False)
    bias_gradients = [op for op in graph.get_operations() if op.type == "BiasAddGrad"]
    assert bias_gradients and merged_bias_gradients(bias_gradients) == set(bias_gradients)
    for op in graph.get_operations():
        assert not set(bias_gradients) & set(op.control_inputs), op.name
    assert grads[0] is not None


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


def _biased_convolutions():
    """Conv2D(bias) + ReLU layers: Keras reshapes each bias after its
    convolution, and oneDNN merges the convolution into its BiasAdd."""
    import keras
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 8))
    h = inputs
    for k in range(4):
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name=f"c{k}")(h)
    return keras.Model(inputs, h)


def test_a_convolution_kept_for_its_bias_addition_runs(parallel_executor):
    """Checkpoints at the convolutions (before their bias): a convolution is
    then read by its BiasAdd and kept for the backward pass, and oneDNN
    still merges the two.  The bias's reshape, chained between them, made
    the merged op wait on itself ("nodes in a cycle")."""
    model = _biased_convolutions()
    x = tf.random.stateless_normal([4, 16, 16, 8], seed=(1, 2))
    weights = model.trainable_variables

    @tf.function
    def both(x):
        loss = tf.reduce_mean(tf.square(model(x, training=False)))
        graph = tf.compat.v1.get_default_graph()
        kept = [_layer_output(graph, f"c{k}", "convolution") for k in range(1, 4)]
        return tf.gradients(loss, weights), memsaving.gradients(loss, weights, checkpoints=kept, follow_order=True)

    (plain, ours), failures = grappler_failures(lambda: both(x))
    assert not failures, failures
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


def budget_spread_figures(runs: int = 10) -> dict:
    """Predicted and measured peaks (MiB, the allocator's whole peak) of a
    Keras two-tower step under a budget of 80% of its plain step's memory
    (less leaves no single-level plan room for the known error, 30%, and
    the allocator's headroom)."""
    import keras
    keras.utils.set_random_seed(0)
    model = models.two_tower(size=256, depth=6, width=256)
    x = tf.random.stateless_normal([512, 256], seed=(1, 2))
    weights = model.trainable_variables
    captured = {}

    @tf.function
    def plain(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        captured["plain"] = memsaving.plan(loss, weights, checkpoints=[], batch_size=512, profile=False)
        return loss

    plain.get_concrete_function(x)
    resident = captured["plain"].resident_bytes
    budget = resident + int(0.8 * (captured["plain"].plain_peak - resident))

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads, captured["plan"] = memsaving.gradients_and_plan(loss, weights, budget=budget, batch_size=512,
                                                               profile=False)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    step(x).numpy()
    peaks = [memsaving.measure_peak(step, x) / MIB for _ in range(runs)]
    return {"predicted": captured["plan"].predicted_peak / MIB, "measured": peaks}


def test_a_budget_plans_peak_repeats_with_default_threads():
    """Default thread pools, a budget plan: the peak moves by at most 1%
    over ten runs.  Measured on 2 cores (2 processes each) at half the
    plain step's memory: 7.58-7.60 MiB pinned (0.25%), 7.12-7.58 MiB
    without the order (6.5%), 8.06 predicted; at 65% (since budgets keep
    the allocator's headroom): 8.12-8.12 MiB, 8.12 predicted; at 80% (since
    the known error is 30%): see the figures printed.

    One run may stray: in a fresh clone on be149a1 one run of ten measured
    8.83 MiB where the nine others measured 8.12 (none in six reruns, nor in
    earlier fresh clones): the pinned order does not hold every run.  So
    nine of ten runs must be within 1% of the lowest, and every run within
    10% of it (the stray run: 8.8%)."""
    figures = in_a_fresh_process("test_order", "budget_spread_figures", test_settings=False)
    measured = figures["measured"]
    print(f"\ntwo towers, budget plan, default threads: predicted {figures['predicted']:.2f} MiB, measured "
          f"{min(measured):.2f}-{max(measured):.2f} MiB")
    within = [m for m in measured if m <= 1.01 * min(measured)]
    assert len(within) >= len(measured) - 1, measured
    assert max(measured) <= 1.1 * min(measured), measured
    assert max(within) <= 1.1 * figures["predicted"]


def test_a_budget_plan_gives_tf_gradients_and_grappler_keeps_working(parallel_executor):
    """The same two towers and budget as above (one inter-op thread here)."""
    import keras
    keras.utils.set_random_seed(0)
    model = models.two_tower(size=64, depth=6, width=64)
    x = tf.random.stateless_normal([128, 64], seed=(1, 2))
    weights = model.trainable_variables

    @tf.function
    def both(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        smallest = memsaving.BudgetError
        try:
            memsaving.plan(loss, weights, budget=1, profile=False)
        except smallest as error:
            budget = int(error.smallest_budget * 1.05)
        return tf.gradients(loss, weights), memsaving.gradients(loss, weights, budget=budget, profile=False)

    (plain, ours), failures = grappler_failures(lambda: both(x))
    assert not failures, failures
    for a, b in zip(plain, ours):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


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
    """Default thread pools, memory mode (no budget): the step's own memory
    (peak above what was in use before it, against the predicted peak above
    the resident bytes) within 10% of the prediction, and the same in every
    run.

    Measured on 2 cores, a process per setting: 4.76 MiB in every run
    against 4.75 predicted, the whole step pinned; with
    ``two_tower_figures(False)``, 5.51-5.76 MiB.  When only each unit's
    gradient ops were chained, 5.25 in four runs of five and 5.50 in the
    fifth (a weight gradient's reduction, which the caller makes, run late),
    against 5.25 predicted with the data gradients a free thread ran during
    each recomputation; the replay now runs the recomputation first, as the
    pinned step does.  "The same" still allows one run in five to differ:
    the caller's ops that read the gradients are not pinned."""
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
    and Dense: plain within 15% of the measured peak, memory mode within
    20% (attention's per-operand reads and precomputed softmax factor
    counted).

    Measured on 2 cores: plain 32.3 predicted, 33.8-35.8 measured; memory
    mode 13.3 predicted, 15.8 measured in every run (pinned to the replay;
    before, 14.8 to 16.3 from run to run against 13.5).  At the peak the
    buffers alive ask for the predicted bytes; the rest is the allocator's:
    two 2 MiB requests are handed 3.5 MiB chunks whole."""
    figures = in_a_fresh_process("test_order", "encoder_figures", test_settings=False)
    median = {mode: float(np.median(found["measured"])) for mode, found in figures.items()}
    for mode, found in figures.items():
        predicted = found["predicted"]
        print(f"\nattention encoder, {mode}, default threads: predicted {predicted:.2f} MiB, "
              f"measured {min(found['measured']):.2f}-{max(found['measured']):.2f} MiB (median {median[mode]:.2f})")
        low = 0.8 if mode == "memory" else 0.85
        assert low * median[mode] <= predicted <= 1.15 * median[mode], mode
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
