"""Bad input gets an error that says what is wrong and what to do."""

import pytest
import tensorflow as tf

import memsaving


def _mlp(x, w):
    h = x
    for v in w:
        h = tf.tanh(tf.matmul(h, v))
    return h


W = [tf.Variable(tf.ones([4, 4]) * 0.1) for _ in range(3)]


def test_eager_mode_raises_runtime_error_pointing_to_tf_function():
    x = tf.ones([2, 4])
    with pytest.raises(RuntimeError, match="tf.function"):
        memsaving.gradients(tf.reduce_sum(_mlp(x, W)), W)


def test_checkpoint_outside_forward_graph_is_named():
    @tf.function
    def step(x):
        unrelated = tf.sqrt(tf.ones([3]), name="unrelated_sqrt")
        loss = tf.reduce_sum(_mlp(x, W))
        return memsaving.gradients(loss, W, checkpoints=[unrelated])

    with pytest.raises(memsaving.CheckpointError, match="unrelated_sqrt"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_checkpoint_after_ys_is_rejected():
    @tf.function
    def step(x):
        h = _mlp(x, W)
        loss = tf.reduce_sum(h)
        later = tf.exp(loss, name="after_loss")
        return memsaving.gradients(loss, W, checkpoints=[later])

    with pytest.raises(memsaving.CheckpointError, match="after_loss"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_ys_not_a_tensor():
    @tf.function
    def step(x):
        return memsaving.gradients(3.0, W)

    with pytest.raises(TypeError, match="ys must be tf.Tensor"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_empty_collection_says_how_to_mark():
    @tf.function
    def step(x):
        return memsaving.gradients(tf.reduce_sum(_mlp(x, W)), W)

    with pytest.raises(memsaving.CheckpointError, match="memsaving.checkpoint"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_unknown_mode_and_keyword():
    @tf.function
    def bad_mode(x):
        return memsaving.gradients(tf.reduce_sum(_mlp(x, W)), W, checkpoints="fastest")

    with pytest.raises(memsaving.CheckpointError, match="unknown checkpoints mode"):
        bad_mode.get_concrete_function(tf.TensorSpec([2, 4]))

    @tf.function
    def bad_kw(x):
        return memsaving.gradients(tf.reduce_sum(_mlp(x, W)), W, checkpoints="memory", colour="red")

    with pytest.raises(TypeError, match="colour"):
        bad_kw.get_concrete_function(tf.TensorSpec([2, 4]))


def test_memory_mode_never_fails_on_a_tiny_graph():
    a = tf.Variable(tf.ones([4, 4]))

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tf.matmul(x, a))
        return tf.gradients(loss, [a])[0], memsaving.gradients(loss, [a], checkpoints="memory")[0]

    plain, ours = step(tf.ones([2, 4]))
    assert (plain.numpy() == ours.numpy()).all()


def test_grad_ys_length_mismatch():
    @tf.function
    def step(x):
        h = _mlp(x, W)
        return memsaving.gradients([h], W, grad_ys=[h, h], checkpoints=[])

    with pytest.raises(ValueError, match="grad_ys"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))
