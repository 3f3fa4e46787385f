"""memsaving.gradients(..., offload_params=True) in a custom training loop:
the variables live on the host, every weight reaches the accelerator through
copies, training equals the same loop without memsaving to the bit, and the
plan carries the offloading prediction.

Needs the ``offload_params`` keyword of memsaving.gradients (memsaving.options)."""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from memsaving.options import ACCEPTED_KEYWORDS
from memsaving.tf.placement import same_device

pytestmark = pytest.mark.skipif("offload_params" not in ACCEPTED_KEYWORDS,
                                reason="memsaving.gradients has no offload_params keyword yet")

HOST, ACCELERATOR = "/CPU:1", "/CPU:0"


def _values(depth=5, width=32):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((width, width)).astype(np.float32) * width ** -0.5 for _ in range(depth)]


def _loss(x, ws):
    h = x
    for w in ws:
        h = tf.nn.relu(tf.matmul(h, w))
    return tf.reduce_mean(h * h)


def _train(offload: bool, steps: int = 20):
    device = HOST if offload else ACCELERATOR
    with tf.device(device):
        ws = [tf.Variable(v) for v in _values()]
    plans = []

    @tf.function
    def step(x):
        loss = _loss(x, ws)
        if offload:
            grads, plan = memsaving.gradients_and_plan(loss, ws, checkpoints="memory", offload_params=True,
                                                       offload_device=HOST)
            plans.append(plan)
        else:
            grads = tf.gradients(loss, ws)
        with tf.device(device):
            for w, g in zip(ws, grads):
                w.assign_sub(0.1 * g)
        return loss

    rng = np.random.default_rng(1)
    losses = [float(step(tf.constant(rng.standard_normal((16, 32)).astype(np.float32)))) for _ in range(steps)]
    return [w.numpy() for w in ws], losses, plans, step


def test_custom_loop_equals_plain_gradients_to_the_bit():
    plain_weights, plain_losses, _, _ = _train(offload=False)
    ours_weights, ours_losses, plans, _ = _train(offload=True)
    assert ours_losses == plain_losses
    for a, b in zip(plain_weights, ours_weights):
        np.testing.assert_array_equal(a, b)
    plan = plans[0]
    assert plan.offload is not None and plan.offload.offloaded_bytes == 5 * 32 * 32 * 4
    assert plan.offload.copied_bytes >= plan.offload.offloaded_bytes


def test_reads_of_the_host_variables_go_through_copies():
    _, _, _, step = _train(offload=True, steps=1)
    graph = step.get_concrete_function(tf.TensorSpec([16, 32])).graph
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert reads
    for read in reads:
        for reader in read.outputs[0].consumers():
            if reader.type == "Identity":  # a recomputed segment's proxy, bypassed
                assert not reader.outputs[0].consumers()
                continue
            assert reader.type == "Snapshot" and same_device(reader.device, HOST), reader.name
            copies = reader.outputs[0].consumers()
            assert copies and all(c.type == "Snapshot" and same_device(c.device, ACCELERATOR) for c in copies)


def test_bad_offload_arguments():
    ws = [tf.Variable(tf.ones([4, 4]))]

    @tf.function
    def bad(x):
        return memsaving.gradients(_loss(x, ws), ws, offload_params="yes")

    with pytest.raises(TypeError, match="offload_params"):
        bad(tf.ones([2, 4]))
