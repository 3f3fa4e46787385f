"""Replacing tf.gradients by memsaving: by hand and with memsaving.patch().

Every test restores TensorFlow's functions (the ``restore_tf_gradients``
fixture), so the other test files, which use tf.gradients as the reference,
keep getting TensorFlow's own.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients as tf_gradients_module

import memsaving
from helpers import in_a_fresh_process
from memsaving.api import ORIGINAL_TF_COMPAT_V1_GRADIENTS, ORIGINAL_TF_GRADIENTS
from tf1_idiom_programs import ORDERS

DEPTH, WIDTH, BATCH = 20, 16, 4


@pytest.fixture(autouse=True)
def restore_tf_gradients():
    """Put TensorFlow's functions back even when a test patched by hand and failed."""
    before = (tf.__dict__["gradients"], tf.compat.v1.gradients, tf_gradients_module.gradients)
    assert before == (ORIGINAL_TF_GRADIENTS, ORIGINAL_TF_COMPAT_V1_GRADIENTS, ORIGINAL_TF_COMPAT_V1_GRADIENTS)
    yield
    memsaving.unpatch()
    tf.__dict__["gradients"] = before[0]
    tf.compat.v1.gradients = before[1]
    tf_gradients_module.gradients = before[2]


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * WIDTH ** -0.5 for _ in range(DEPTH)]


def _inputs(seed=1):
    return np.random.default_rng(seed).standard_normal((BATCH, WIDTH)).astype(np.float32)


def _mlp_loss(x, weights, mark_every=0):
    """A DEPTH-layer tanh MLP; ``mark_every`` marks layers for "collection"."""
    h = x
    for i, w in enumerate(weights):
        h = tf.tanh(tf.matmul(h, w))
        if mark_every and i % mark_every == mark_every - 1 and i < len(weights) - 1:
            h = memsaving.checkpoint(h)
    return tf.reduce_sum(h * h)


def _memsaving_ops(graph, scope="memsaving_gradients"):
    """Ops memsaving created: (in its name scope, recomputed copies)."""
    names = [op.name for op in graph.get_operations()]
    return (sum(1 for n in names if n.startswith(scope + "/")),
            sum(1 for n in names if "/recompute_" in n))


def _assert_same(reference, ours):
    assert len(reference) == len(ours)
    for a, b in zip(reference, ours):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def _traced(fn, *args):
    """Run ``fn`` as a tf.function; return its results and its graph."""
    function = tf.function(fn)
    concrete = function.get_concrete_function(*args)
    return [r.numpy() for r in concrete(*args)], concrete.graph


class _MLP:
    """Variables for tf.function tests, and a step calling tf.gradients by module attribute.

    The input is an argument of the function: a small eager constant closed
    over would be inlined as a Const, and "memory" then finds no cut to keep
    (nothing recomputed, nothing to check).
    """

    def __init__(self, mark_every=0):
        self.weights = [tf.Variable(w) for w in _weights()]
        self.mark_every = mark_every

    def step(self, x):
        loss = _mlp_loss(x, self.weights, self.mark_every)
        return tf.gradients(loss, self.weights)


# -- (a) the TF1 package's usage: tf.__dict__["gradients"] = memsaving.gradients_memory ----

@pytest.mark.parametrize("mode", ["memory", "speed", "collection"])
def test_hand_patched_tf_gradients_equal_the_original(mode):
    model = _MLP(mark_every=5 if mode == "collection" else 0)
    x = tf.constant(_inputs())
    reference, plain_graph = _traced(model.step, x)
    assert _memsaving_ops(plain_graph) == (0, 0)
    tf.__dict__["gradients"] = getattr(memsaving, f"gradients_{mode}")
    try:
        ours, graph = _traced(model.step, x)  # RecursionError / CheckpointError before the fix
    finally:
        tf.__dict__["gradients"] = ORIGINAL_TF_GRADIENTS
    _assert_same(reference, ours)
    in_scope, recomputed = _memsaving_ops(graph)
    assert in_scope > 0 and recomputed > 0, "memsaving did not rewrite the backward pass"


def test_hand_patched_compat_v1_gradients_in_a_session():
    """``tf.compat.v1.gradients = ...`` by hand: memsaving's rewrite calls TF's v1 function."""
    graph = tf.compat.v1.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        ws = [tf.constant(w) for w in _weights()]
        loss = _mlp_loss(x, ws)
        reference = tf.compat.v1.gradients(loss, ws, colocate_gradients_with_ops=True)
        tf.compat.v1.gradients = memsaving.gradients_memory
        try:
            ours = tf.compat.v1.gradients(loss, ws, colocate_gradients_with_ops=True)
        finally:
            tf.compat.v1.gradients = ORIGINAL_TF_COMPAT_V1_GRADIENTS
        assert all(_memsaving_ops(graph))
        with tf.compat.v1.Session(graph=graph) as session:
            expected, got = session.run([reference, ours], {x: _inputs()})
    _assert_same(expected, got)


# -- (a') the same idiom on tf.compat.v1, whose module wrapper caches lookups ---------------

DROP_IN = ["gradients", "gradients_memory", "gradients_speed", "gradients_collection"]


@pytest.mark.parametrize("function", DROP_IN)
def test_idiom_on_compat_v1_takes_effect_after_a_lookup(function):
    """TensorFlow's wrapper served the ``gradients`` its first lookup cached:
    ``tf1.__dict__["gradients"] = ...`` was silently ignored before."""
    import tensorflow.compat.v1 as tf1

    replacement = getattr(memsaving, function)
    assert tf1.gradients is ORIGINAL_TF_COMPAT_V1_GRADIENTS  # a lookup, as ``old = tf.gradients``
    tf1.__dict__["gradients"] = replacement
    assert tf1.gradients is replacement
    assert tf.compat.v1.gradients is replacement
    tf1.__dict__["gradients"] = ORIGINAL_TF_COMPAT_V1_GRADIENTS
    assert tf1.gradients is ORIGINAL_TF_COMPAT_V1_GRADIENTS


# the third order (the module reached as tensorflow.compat.v1 after import tensorflow) joins the slow
# tests: about 15 s, and the read before memsaving loads is the first order's case too
@pytest.mark.parametrize("order", [pytest.param(order, marks=pytest.mark.slow) if order == "tf.compat.v1 first"
                                   else order for order in ORDERS])
def test_idiom_on_compat_v1_in_any_import_order(order):
    """Whether memsaving's functions load before or after tensorflow.compat.v1
    is imported and read (a fresh process: the wrappers are per process)."""
    assert in_a_fresh_process("tf1_idiom_programs", "idiom_takes_effect", order) == [True, True]


def test_tf1_users_idiom_saves_memory_in_a_session():
    """The TF1 package's usage on a 100-node chain of 1 MB tanh nodes in a v1
    graph and session: memsaving builds the backward pass, its gradient is
    TensorFlow's, and the session's peak is a fraction of TensorFlow's
    (measured about 20.7 MB against 102 MB)."""
    figures = in_a_fresh_process("tf1_idiom_programs", "tf1_user_program")
    assert figures["memsaving_ops"] > 0, "tf.gradients did not go to memsaving"
    assert figures["largest_difference"] <= 1e-6
    assert figures["ours_peak"] < figures["plain_peak"] / 3, figures


# -- (b) memsaving.patch(): callers that only know tf.gradients ----------------------------

def test_patch_replaces_the_module_attributes_callers_reach():
    memsaving.patch()
    assert tf.gradients is not ORIGINAL_TF_GRADIENTS
    assert tf.compat.v2.gradients is tf.gradients
    assert tf.compat.v1.gradients is not ORIGINAL_TF_COMPAT_V1_GRADIENTS
    assert tf_gradients_module.gradients is tf.compat.v1.gradients  # tf.compat.v1.train optimizers
    from tensorflow.python.ops import gradients_impl
    assert gradients_impl.gradients is ORIGINAL_TF_COMPAT_V1_GRADIENTS  # TF's definitions stay
    assert gradients_impl.gradients_v2 is ORIGINAL_TF_GRADIENTS


def test_patched_functions_keep_tensorflows_signatures():
    memsaving.patch()
    for patched_fn, original in [(tf.gradients, ORIGINAL_TF_GRADIENTS),
                                 (tf.compat.v1.gradients, ORIGINAL_TF_COMPAT_V1_GRADIENTS)]:
        assert list(inspect.signature(patched_fn).parameters) == list(inspect.signature(original).parameters)


def _train_step(weights, x, learning_rate=0.1):
    """A hand-written train step of the kind Keras-era code has: it calls tf.gradients
    by module attribute and applies plain SGD."""
    loss = _mlp_loss(x, weights)
    grads = tf.gradients(loss, weights)
    for w, g in zip(weights, grads):
        w.assign_sub(learning_rate * g)
    return [loss] + grads


def test_patch_reaches_a_train_step_in_tf_function():
    plain_weights = [tf.Variable(w) for w in _weights()]
    x = tf.constant(_inputs())
    reference, plain_graph = _traced(lambda inp: _train_step(plain_weights, inp), x)
    memsaving.patch()
    ours_weights = [tf.Variable(w) for w in _weights()]
    ours, graph = _traced(lambda inp: _train_step(ours_weights, inp), x)
    _assert_same(reference, ours)
    _assert_same([w.numpy() for w in plain_weights], [w.numpy() for w in ours_weights])
    assert _memsaving_ops(plain_graph) == (0, 0)
    in_scope, recomputed = _memsaving_ops(graph)
    assert in_scope > 0 and recomputed > 0


def test_patch_reaches_keras_legacy_backend_gradients():
    """Keras' own caller: keras' legacy backend calls tf.compat.v1.gradients."""
    legacy_backend = pytest.importorskip("keras.src.legacy.backend")
    model = _MLP()
    x = tf.constant(_inputs())

    def keras_gradients(inp):
        return legacy_backend.gradients(_mlp_loss(inp, model.weights), model.weights)

    reference, _ = _traced(keras_gradients, x)
    with memsaving.patched():
        ours, graph = _traced(keras_gradients, x)
    _assert_same(reference, ours)
    assert all(_memsaving_ops(graph))


def test_patch_reaches_tf_compat_v1_gradients_in_a_session():
    graph = tf.compat.v1.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        ws = [tf.compat.v1.placeholder_with_default(w, w.shape) for w in _weights()]
        loss = _mlp_loss(x, ws)
        reference = tf.compat.v1.gradients(loss, ws)
        assert _memsaving_ops(graph) == (0, 0)
        memsaving.patch()
        ours = tf.compat.v1.gradients(loss, ws)
        assert all(_memsaving_ops(graph))
        with tf.compat.v1.Session(graph=graph) as session:
            expected, got = session.run([reference, ours], {x: _inputs()})
    _assert_same(expected, got)


def _v1_training(patch: bool):
    """One GradientDescentOptimizer.minimize step in a v1 graph: weights after, memsaving ops."""
    graph = tf.compat.v1.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        ws = [tf.Variable(w) for w in _weights()]
        if patch:
            memsaving.patch()
        try:
            train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(_mlp_loss(x, ws))
        finally:
            memsaving.unpatch()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(train, {x: _inputs()})
            return session.run(ws), _memsaving_ops(graph)


def test_patch_reaches_tf_compat_v1_train_optimizers():
    plain, plain_ops = _v1_training(patch=False)
    ours, ops = _v1_training(patch=True)
    _assert_same(plain, ours)
    assert plain_ops == (0, 0) and all(ops)


def test_patched_call_passes_tf_gradients_arguments_positionally():
    """grad_ys, name, ..., unconnected_gradients reach memsaving in tf.gradients' order."""
    memsaving.patch()

    @tf.function
    def f():
        a = tf.constant([1.0, 2.0])
        b = tf.constant([3.0])
        y = tf.tanh(a) * 3.0
        return tf.gradients(y, [a, b], tf.constant([2.0, 2.0]), "mine", False, None, None, "zero")

    graph = f.get_concrete_function().graph
    assert any(op.name.startswith("mine/") for op in graph.get_operations())  # memsaving's scope = name
    da, db = f()
    np.testing.assert_allclose(da.numpy(), 6.0 * (1.0 - np.tanh([1.0, 2.0]) ** 2), rtol=1e-6)
    np.testing.assert_array_equal(db.numpy(), [0.0])


def test_patch_options_apply_to_every_call():
    """patch("speed") really is memsaving's "speed": no MatMul, no checkpoint."""
    memsaving.patch("speed")

    @tf.function
    def no_matmul():
        a = tf.constant([1.0, 2.0])
        return tf.gradients(tf.reduce_sum(tf.tanh(a)), a)

    with pytest.raises(memsaving.CheckpointError):
        no_matmul()
    memsaving.patch("memory")
    np.testing.assert_allclose(no_matmul()[0].numpy(), 1.0 - np.tanh([1.0, 2.0]) ** 2, rtol=1e-6)


@pytest.mark.parametrize("kwargs", [{"name": "g"}, {"gate_gradients": True}, {"not_an_option": 1},
                                    {"checkpoints": None}])
def test_patch_refuses_bad_options_before_patching(kwargs):
    with pytest.raises(TypeError):
        memsaving.patch(**kwargs)
    assert tf.gradients is ORIGINAL_TF_GRADIENTS


# -- (c) unpatch and patched() restore exactly ---------------------------------------------

def _assert_originals():
    assert tf.gradients is ORIGINAL_TF_GRADIENTS
    assert tf.compat.v2.gradients is ORIGINAL_TF_GRADIENTS
    assert tf.compat.v1.gradients is ORIGINAL_TF_COMPAT_V1_GRADIENTS
    assert tf_gradients_module.gradients is ORIGINAL_TF_COMPAT_V1_GRADIENTS


def test_unpatch_restores_the_originals():
    memsaving.patch()
    memsaving.unpatch()
    _assert_originals()


def test_unpatch_without_patch_does_nothing():
    memsaving.unpatch()
    memsaving.unpatch()
    _assert_originals()


def test_double_patch_then_one_unpatch_restores_the_originals():
    memsaving.patch("memory")
    first = tf.gradients
    memsaving.patch("speed")
    assert tf.gradients is not first and tf.gradients is not ORIGINAL_TF_GRADIENTS
    memsaving.unpatch()
    _assert_originals()


def test_patched_context_restores_on_exception():
    with pytest.raises(ZeroDivisionError):
        with memsaving.patched():
            assert tf.gradients is not ORIGINAL_TF_GRADIENTS
            assert tf.compat.v1.gradients is not ORIGINAL_TF_COMPAT_V1_GRADIENTS
            1 / 0
    _assert_originals()


def test_nested_patched_restores_the_enclosing_patch():
    with memsaving.patched("memory"):
        outer = (tf.gradients.__doc__, tf.compat.v1.gradients.__doc__)
        with memsaving.patched("speed"):
            assert "'speed'" in tf.gradients.__doc__
        assert (tf.gradients.__doc__, tf.compat.v1.gradients.__doc__) == outer
        assert "'memory'" in tf.gradients.__doc__
    _assert_originals()


def test_a_users_own_replacement_comes_back_after_unpatch():
    def mine(ys, xs, grad_ys=None, **kwargs):
        return ORIGINAL_TF_GRADIENTS(ys, xs, grad_ys, **kwargs)

    tf.__dict__["gradients"] = mine
    memsaving.patch()
    assert tf.gradients is not mine
    memsaving.unpatch()
    assert tf.gradients is mine


def test_unpatch_takes_back_the_idiom():
    tf.compat.v1.__dict__["gradients"] = memsaving.gradients_memory
    tf.__dict__["gradients"] = memsaving.gradients_speed
    memsaving.unpatch()
    _assert_originals()


@pytest.mark.parametrize("name", ["tf", "tf.compat.v1"])
def test_unpatch_after_idiom_then_patch_restores_tensorflows_functions(name):
    """unpatch() used to put the idiom's function back: memsaving stayed on."""
    module = {"tf": tf, "tf.compat.v1": tf.compat.v1}[name]
    module.__dict__["gradients"] = memsaving.gradients_memory
    memsaving.patch()
    assert "replaced by memsaving.patch(" in module.gradients.__doc__  # patch's function, not the idiom's
    memsaving.unpatch()
    _assert_originals()


def test_unpatch_after_patch_then_idiom_restores_tensorflows_functions():
    memsaving.patch()
    tf.compat.v1.__dict__["gradients"] = memsaving.gradients_memory
    tf.__dict__["gradients"] = memsaving.gradients
    memsaving.unpatch()
    _assert_originals()


def test_unpatch_after_idiom_and_two_patches_restores_tensorflows_functions():
    memsaving.patch("speed")
    tf.compat.v1.__dict__["gradients"] = memsaving.gradients_collection
    memsaving.patch("memory")
    memsaving.unpatch()
    _assert_originals()


def test_profiling_under_patch_uses_tensorflows_own_gradients(monkeypatch):
    """Profiling an op builds its gradient with tf.gradients; under patch() that
    name is memsaving's, and each profiled op's gradient was planned (and its
    ops profiled) again, recursively: a TF1-style 24-layer MLP's minimize
    printed 60-odd "profiled 1 kernel signatures" lines, hit RecursionError and
    took 7.7 s.  Now memsaving.gradients runs once per minimize."""
    from memsaving import api

    calls = []
    original = api.gradients_and_plan

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "gradients_and_plan", counted)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64])
        h = x
        for i in range(6):
            w = tf.compat.v1.get_variable(f"w{i}", [64, 64])
            h = tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(h * h)
        with memsaving.patched("memory", profile=True):
            tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
    assert len(calls) == 1
