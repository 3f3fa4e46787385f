"""``tf.custom_gradient`` ops (Keras' silu/swish): predicted and measured peaks.

``tf.nn.silu`` wraps ``x * sigmoid(x)`` and its argument in an IdentityN
whose gradient is a Python closure reading the ORIGINAL ``x`` (it recomputes
the sigmoid).  Two fixes are guarded here, on 8 ``Dense(256, "silu")``
layers, batch 512 (0.5 MiB per activation):

* the graph model (:func:`memsaving.tf.extract.custom_gradient`): the IdentityN's
  outputs are views, its gradient reads what the closure captured, and the
  ops computing ``x * sigmoid(x)`` are never differentiated.  Before, the
  model held five activations per layer instead of two: plain predicted
  24.0 MiB against 12.8 measured (absolute peaks).
* the rewrite (``BackwardBuilder._reading_copies``): a recomputed segment's
  custom gradient reads the recomputed copies.  Before, it read the forward
  tensors, which stayed alive through the whole forward pass, so memory mode
  measured 12.5 MiB, no saving over plain's 12.8.

Figures are peak increases over the memory in use before the step
(``measure_peak_increase``) against ``predicted - resident_bytes``, the
smallest of two runs after a warm-up.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import grappler_failures, in_a_fresh_process

BATCH = 512
LAYERS = 8
RUNS = 2


def _stack() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(256, activation="silu")
                                                      for _ in range(LAYERS)])


def _step(model: keras.Model, mode: str, captured: dict):
    """One training step; the weight gradients are reduced inside it."""

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        weights = model.trainable_variables
        if mode == "plain":
            captured["plan"] = memsaving.plan(loss, weights, checkpoints=[], batch_size=BATCH)
            grads = tf.gradients(loss, weights)
        else:
            grads, captured["plan"] = memsaving.gradients_and_plan(loss, weights, checkpoints="memory",
                                                                   batch_size=BATCH)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    return step


def _gradients(model: keras.Model, x: tf.Tensor, memory: bool) -> list:
    @tf.function
    def grads(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        if memory:
            return memsaving.gradients(loss, model.trainable_variables, checkpoints="memory", batch_size=BATCH)
        return tf.gradients(loss, model.trainable_variables)

    return [g.numpy() for g in grads(x)]


def silu_figures() -> dict:
    """Measured and predicted peak increases (bytes) of plain and memory
    mode, and the Grappler failures their first calls logged."""
    model = _stack()
    x = tf.random.stateless_normal([BATCH, 256], seed=(1, 2))
    figures = {}
    for mode in ("plain", "memory"):
        captured: dict = {}
        step = _step(model, mode, captured)
        _, figures[mode + " grappler failures"] = grappler_failures(lambda: step(x))
        measured = min(memsaving.measure_peak_increase(step, x) for _ in range(RUNS))
        plan = captured["plan"]
        predicted = (plan.plain_peak if mode == "plain" else plan.predicted_peak) - plan.resident_bytes
        figures[mode] = (measured, predicted)
    return figures


@pytest.fixture(scope="module")
def silu_stack():
    """The model, an input, and :func:`silu_figures` measured in a fresh
    process: in this one, tests run before moved memory mode's figure from
    4.00 to 4.45 MiB."""
    model = _stack()
    x = tf.random.stateless_normal([BATCH, 256], seed=(1, 2))
    return model, x, in_a_fresh_process("test_custom_gradient", "silu_figures")


def test_silu_memory_mode_gradients_equal(silu_stack):
    model, x, _ = silu_stack
    for got, want in zip(_gradients(model, x, True), _gradients(model, x, False)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_grappler_optimizes_the_rewritten_step(silu_stack):
    """The loss's ``Square`` gradient multiplies by a constant that TensorFlow
    makes wait on the incoming gradient; Grappler's constant folding moved it
    into the last layer's forward ``x * sigmoid(x)`` and made a cycle, so the
    whole step ran unoptimized (memory mode measured 5.75 MiB, 4.00 with the
    constant released: :func:`memsaving.tf.rewrite.release_gradient_constants`)."""
    figures = silu_stack[2]
    assert not figures["plain grappler failures"]
    assert not figures["memory grappler failures"]


def test_silu_plain_prediction_within_10_percent(silu_stack):
    measured, predicted = silu_stack[2]["plain"]
    assert abs(predicted - measured) <= 0.10 * measured, (measured / 2**20, predicted / 2**20)


def test_silu_memory_mode_frees_the_forward_activations(silu_stack):
    plain, _ = silu_stack[2]["plain"]
    memory, _ = silu_stack[2]["memory"]
    assert memory <= 0.75 * plain, (plain / 2**20, memory / 2**20)


def test_silu_memory_prediction_within_25_percent(silu_stack):
    """The goal is 10%, as for plain.  Memory mode measures 4.00 MiB in some
    processes and 4.50 in others (one weight gradient of 0.5 MiB consumed
    later), against 3.50 predicted: 12.5% or 22% off.  25% guards against a
    regression without flipping from one process to the next."""
    measured, predicted = silu_stack[2]["memory"]
    assert abs(predicted - measured) <= 0.25 * measured, (measured / 2**20, predicted / 2**20)


def silu_gradient_figures() -> dict:
    """The bytes of silu's gradient beyond its result: as :func:`memsaving.tf.extract.custom_gradient`
    predicts them, and as measured (peak increase of the gradient alone, less its result)."""
    from memsaving.tf.extract import custom_gradient

    shape = [8, 64, 64, 32]
    activation = int(np.prod(shape)) * 4
    graph = tf.Graph()
    with graph.as_default():
        features = tf.compat.v1.placeholder(tf.float32, shape)
        tf.nn.silu(features)
    op = next(o for o in graph.get_operations() if o.type == "IdentityN")
    predicted = custom_gradient(op, 1, wanted=lambda t: t is features).temp_bytes

    x, dy = tf.random.normal(shape), tf.random.normal(shape)

    @tf.function
    def gradient(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.silu(x)
        return tape.gradient(y, x, output_gradients=dy)

    gradient(x, dy)
    measured = min(memsaving.measure_peak_increase(gradient, x, dy) for _ in range(2)) - activation  # less the result
    return {"activation": activation, "predicted": predicted, "measured": measured}


def test_silus_gradient_temporary_is_one_activation_as_measured():
    """silu's gradient recomputes ``sigmoid(beta * x)`` and multiplies by ``beta * x`` again, with
    ``beta`` a constant one that Grappler folds away: the step holds the sigmoid and ``1 -
    sigmoid`` and writes the result into one of them.  Counting both products put the temporary
    at two activations (a depthwise net's budget plan predicted 64.6 MiB, measured 60.7).
    Measured in a process of its own: after the suite's earlier tests the allocator handed the
    same gradient 0.8 MiB more in chunks."""
    figures = in_a_fresh_process("test_custom_gradient", "silu_gradient_figures")
    activation, predicted, measured = figures["activation"], figures["predicted"], figures["measured"]
    assert predicted == activation
    assert abs(measured - predicted) <= activation // 8, (measured / 2**20, predicted / 2**20)
