"""Running a model's gradients with tf.gradients and memsaving side by side."""

import numpy as np
import tensorflow as tf

import memsaving


def dense(g):
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.convert_to_tensor(g)
    return g


def smallest_budget(loss, xs, **kwargs) -> int:
    """The smallest budget memsaving finds feasible (from its BudgetError)."""
    try:
        memsaving.plan(loss, xs, budget=1, **kwargs)
    except memsaving.BudgetError as error:
        return error.smallest_budget
    raise AssertionError("a budget of 1 byte cannot fit")


def loss_ancestors(reads, outputs) -> list:
    """Indices of a random program's tensors the loss depends on, walking
    ``reads[i]`` (the tensors tensor ``i`` is computed from) back from
    ``outputs``; tensor 0, the input, is excluded."""
    found, stack = set(), list(outputs)
    while stack:
        i = stack.pop()
        if i in found or i == 0:
            continue
        found.add(i)
        stack.extend(reads[i])
    return sorted(found)


def both_gradients(model, x, params, checkpoints, budget=None):
    """Plain and memsaving gradients of the same forward graph (same random draws).

    ``budget="smallest"`` plans for the smallest feasible budget (usually a
    multi-level plan)."""
    loss, cps = model.forward(x, params)
    chosen = cps if checkpoints == "model" else checkpoints
    xs = list(params) + [x]
    plain = tf.gradients(loss, xs)
    if budget == "smallest":
        chosen = "memory"
        budget = smallest_budget(loss, xs)
    ours = memsaving.gradients(loss, xs, checkpoints=chosen, budget=budget)
    kinds = [(type(a).__name__, type(b).__name__) for a, b in zip(plain, ours)]
    return [dense(g) for g in plain], [dense(g) for g in ours], kinds


def run_tf_function(model, checkpoints="model", seed=0, budget=None):
    rng = np.random.default_rng(seed)
    params = [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.5) for s in model.param_shapes()]
    x = tf.constant(model.make_input(rng))

    @tf.function
    def step(x):
        plain, ours, _ = both_gradients(model, x, params, checkpoints, budget)
        return plain, ours

    kinds = []

    @tf.function
    def kinds_probe(x):
        kinds.extend(both_gradients(model, x, params, checkpoints, budget)[2])
        return tf.constant(0)

    kinds_probe.get_concrete_function(x)
    plain, ours = step(x)
    return [None if g is None else g.numpy() for g in plain], [None if g is None else g.numpy() for g in ours], kinds


def run_session(model, checkpoints="model", seed=0, budget=None):
    rng = np.random.default_rng(seed)
    graph = tf.Graph()
    with graph.as_default():
        params = [
            tf.compat.v1.Variable(rng.standard_normal(s).astype(np.float32) * 0.5, use_resource=True)
            for s in model.param_shapes()
        ]
        x = tf.compat.v1.placeholder(tf.float32, shape=model.make_input(rng).shape)
        plain, ours, kinds = both_gradients(model, x, params, checkpoints, budget)
        fetch_plain = [g for g in plain if g is not None]
        fetch_ours = [g for g in ours if g is not None]
        assert len(fetch_plain) == len(fetch_ours)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = sess.run(fetch_plain + fetch_ours, feed_dict={x: model.make_input(np.random.default_rng(seed + 1))})
    n = len(fetch_plain)
    return values[:n], values[n:], kinds


def assert_close(plain, ours, rtol=1e-5):
    assert len(plain) == len(ours)
    for i, (a, b) in enumerate(zip(plain, ours)):
        if a is None or b is None:
            assert a is None and b is None, f"gradient {i}: one is None"
            continue
        scale = max(float(np.max(np.abs(a))), 1e-12)
        err = float(np.max(np.abs(a - b))) / scale
        assert err <= rtol, f"gradient {i}: relative error {err:.3g} > {rtol}"


def assert_gradients_equal(plain, ours, labels, context=""):
    """tf.gradients' results (``plain``, numpy-convertible or None) against
    memsaving's: None exactly where tf.gradients gives None, values within
    rtol 1e-4 and atol 1e-5 of the gradient's largest entry.  ``labels``
    names each x in the messages."""
    for label, p, o in zip(labels, plain, ours):
        if p is None:
            assert o is None, f"{label}: tf.gradients gives None, memsaving a value"
            continue
        assert o is not None, f"{label}: memsaving gives None, tf.gradients a value"
        p, o = p.numpy(), o.numpy()
        scale = max(float(np.max(np.abs(p))), 1e-3)
        np.testing.assert_allclose(o, p, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{label}, {context}")
