"""Running a model's gradients with tf.gradients and memsaving side by side."""

import glob
import json
import os
import subprocess
import sys
import tempfile

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

    ``budget="smallest"`` plans for the smallest feasible budget with
    multi-level plans allowed (usually a multi-level plan)."""
    loss, cps = model.forward(x, params)
    chosen = cps if checkpoints == "model" else checkpoints
    xs = list(params) + [x]
    plain = tf.gradients(loss, xs)
    extra = {}
    if budget == "smallest":
        chosen = "memory"
        extra = {"multilevel": True}
        budget = smallest_budget(loss, xs, **extra)
    ours = memsaving.gradients(loss, xs, checkpoints=chosen, budget=budget, **extra)
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


MODE_KWARGS = [dict(checkpoints="memory"), dict(checkpoints="speed"), dict(checkpoints=[])]
"""memsaving.gradients keywords for memory mode, speed mode and no checkpoints."""


def mlp_weights(n, width=16, dtype=tf.float32, seed=0) -> list:
    """``n`` square ``width`` x ``width`` weight variables scaled by 1/sqrt(width)."""
    rng = np.random.RandomState(seed)
    return [tf.Variable((rng.randn(width, width) / np.sqrt(width)).astype(dtype.as_numpy_dtype)) for _ in range(n)]


def tanh_mlp(x, ws):
    """``x`` through ``tanh(h @ w)`` for each ``w`` of ``ws``."""
    h = x
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
    return h


def compare_gradients(loss_fn, ws, x, rtol=1e-5, **kwargs):
    """tf.gradients and ``memsaving.gradients(..., **kwargs)`` of ``loss_fn(x)``
    in one tf.function, compared with ``assert_close``."""
    @tf.function
    def both(x):
        loss = loss_fn(x)
        return tf.gradients(loss, ws), memsaving.gradients(loss, ws, **kwargs)

    plain, ours = both(x)
    assert_close([p.numpy() for p in plain], [o.numpy() for o in ours], rtol=rtol)


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


def optimized_graphs(call) -> list:
    """Run ``call()`` (a tf.function's call) with run metadata on and return
    the GraphDefs of the functions it ran, as Grappler left them.  Graph
    collection is turned off again afterwards: ``disable_run_metadata``
    alone leaves it on, and later calls would keep adding their graphs."""
    from tensorflow.python.eager import context

    context.context().enable_run_metadata()
    try:
        call()
        metadata = context.context().export_run_metadata()
    finally:
        context.context().disable_run_metadata()
        context.context().disable_graph_collection()
    return [graph.post_optimization_graph for graph in metadata.function_graphs]


def session_step_times(graph: tf.Graph, fetches, feed: dict) -> dict:
    """Run ``fetches`` once in a v1 session on ``graph`` (two logical CPUs,
    one inter-op thread, variables initialized) with a full trace; return
    each node's ``(start, end)`` in microseconds, for tests of run order."""
    with graph.as_default():
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, device_count={"CPU": 2})
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        metadata = tf.compat.v1.RunMetadata()
        session.run(fetches, feed, options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                    run_metadata=metadata)
    return {node.node_name: (node.all_start_micros, node.all_start_micros + node.all_end_rel_micros)
            for device in metadata.step_stats.dev_stats for node in device.node_stats}


GRAPPLER_FAILURES = ("optimizer failed", "topological sort failed", "couldn't be sorted in topological order",
                     "function optimization failure")


def grappler_failures(call):
    """Run ``call()`` (a tf.function's first call, which optimizes its graph)
    and return ``(result, lines)``: the lines Grappler printed to stderr about
    a pass that failed.  When a pass fails on a graph (a cycle, say),
    TensorFlow runs the function unoptimized and only logs it, so a test
    must read the C++ log to know."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as log:
        os.dup2(log.fileno(), 2)
        try:
            result = call()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if any(key in line for key in GRAPPLER_FAILURES)]
    return result, lines


def in_a_fresh_process(module: str, function: str, *args, test_settings: bool = True, environment=None,
                       timeout: int = 300):
    """``tests/**/<module>.py``'s ``function(*args)`` called in a new Python
    process; returns what it returned (it must be JSON-serialisable).

    A measured peak depends on what ran before it in the same process: the
    allocator's free chunks and the executor's measured op costs are left by
    earlier tests, and a test's figure moved by a whole activation with the
    test run before it.  A fresh process measures what the test means.

    ``test_settings`` configures TensorFlow as ``conftest`` does (one
    inter-op thread, two logical CPUs, a fresh profile cache); ``False``
    keeps TensorFlow's default thread pools.  ``environment``: variables
    added to the process's environment (read when TensorFlow starts, such
    as ``TF_ENABLE_ONEDNN_OPTS``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    folder = next(os.path.dirname(path) for path in glob.glob(os.path.join(here, "**", f"{module}.py"), recursive=True))
    code = (f"import sys; sys.path[:0] = [{here!r}, {folder!r}]; "
            + ("import conftest; conftest.configure_tensorflow(); " if test_settings else "")
            + f"import json, memsaving, {module}; "
            + f"print('RESULT', json.dumps({module}.{function}(*{args!r})))")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(environment or {}))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"{module}.{function}{args} failed in its process:\n{done.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


TF1_NODE_ELEMENTS = 250_000
"""float32 elements of one node of the TF1 package's test chains: 1 MB."""


def tf1_tanh_chain(length: int, prefix: str = "a") -> list:
    """The TF1 package's test chain, built in the default graph: ``a0`` is
    1 MB of ones (a Fill op, computed at each run), ``a1`` ...
    ``a{length-1}`` are tanh of the node before, 1 MB each."""
    nodes = [tf.ones((TF1_NODE_ELEMENTS,), name=f"{prefix}0")]
    for i in range(1, length):
        nodes.append(tf.tanh(nodes[-1], name=f"{prefix}{i}"))
    return nodes


def tf1_session(graph: tf.Graph) -> tf.compat.v1.Session:
    """A v1 session configured as the TF1 package's memory tests were:
    graph optimizer at L0 and constant folding off, so the graph that runs
    (and is measured) is the graph that was built."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    v1 = tf.compat.v1
    level = v1.OptimizerOptions(opt_level=v1.OptimizerOptions.L0)
    config = v1.ConfigProto(graph_options=v1.GraphOptions(optimizer_options=level))
    config.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    return v1.Session(graph=graph, config=config)


def session_peak(session: tf.compat.v1.Session, fetches) -> tuple:
    """``(values, peak)``: ``fetches`` run twice, and the CPU allocator's
    peak bytes during the second run (the first one warms up) above what
    was in use before it (results an earlier run handed out and are still
    held)."""
    session.run(fetches)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    values = session.run(fetches)
    return values, int(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
