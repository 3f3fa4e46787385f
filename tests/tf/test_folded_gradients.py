"""The loss's gradient that Grappler folds into a constant: the model counts
it as resident memory, and the allocator shows it held after the first run."""

import tensorflow as tf

import memsaving
from memsaving.tf.extract import MAX_FOLDED_BYTES, graph_model
from memsaving.tf.forward import forward_graph

from helpers import in_a_fresh_process

MIB = 2 ** 20


def _folded(batch: int, width: int, loss_of=lambda h: tf.reduce_mean(tf.square(h)), grad_ys_given=False):
    """Names and bytes of the tensors whose gradient the model folds, for ``loss_of(relu(x @ w))``."""
    w = tf.Variable(tf.random.normal([width, width], seed=1))
    found = {}

    @tf.function(autograph=False)
    def trace(x):
        h = tf.nn.relu(tf.matmul(x, w))
        loss = loss_of(h)
        fwd = forward_graph([loss.graph.capture(w.handle)], [loss])
        found["model"] = graph_model(fwd, batch_size=batch, seeded_with_ones=not grad_ys_given)
        return loss

    trace(tf.zeros([batch, width]))
    model = found["model"]
    return {t.name: t.gradient_bytes for t in model.tensors.values() if t.folded_gradient}, model


def test_mean_square_loss_gradient_of_the_squares_is_folded():
    folded, model = _folded(1024, 256)
    assert list(folded.values()) == [MIB]  # Square:0, the [1024, 256] squares
    assert model.folded_gradient_bytes == MIB
    assert next(iter(folded)).endswith("Square:0")


def test_nothing_is_folded_past_a_gradient_that_reads_data_or_with_grad_ys():
    folded, _ = _folded(1024, 256, loss_of=lambda h: tf.reduce_sum(h * h))
    assert list(folded.values()) == [MIB]  # mul:0 only, not h (its gradient reads h)
    assert _folded(1024, 256, grad_ys_given=True)[0] == {}


def test_no_constant_above_grappler_limit_is_folded():
    width = 1024
    batch = MAX_FOLDED_BYTES // (4 * width) + 8
    assert _folded(batch, width)[0] == {}


def held_after_first_runs() -> list:
    """Bytes in use added by a step's first two runs (its results freed),
    and the plan's folded gradient bytes; run in a fresh process."""
    w = tf.Variable(tf.random.normal([256, 256], seed=1))
    x = tf.random.normal([1024, 256], seed=2)
    captured = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(tf.nn.relu(tf.matmul(x, w))))
        grads, captured["plan"] = memsaving.gradients_and_plan(loss, [w], checkpoints=[])
        return tf.reduce_sum(grads[0])

    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(x).numpy()
    step(x).numpy()
    held = tf.config.experimental.get_memory_info("CPU:0")["current"] - before
    return [held, captured["plan"].resident_bytes, 256 * 256 * 4 + 1024 * 256 * 4]


def test_the_folded_gradient_is_held_after_the_first_run():
    """Memory in use grows by the folded constant (1 MiB, the squares'
    gradient) when the step first runs, as the model counts it resident."""
    held, resident, variables_and_input = in_a_fresh_process("test_folded_gradients", "held_after_first_runs")
    assert MIB <= held < MIB + 64 * 1024, held
    # the allocator's bytes in use while planning may add a few small tensors to the graph's own count
    assert 0 <= resident - (variables_and_input + MIB) <= 4096
