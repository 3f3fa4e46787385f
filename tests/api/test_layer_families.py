"""Each Keras layer family: memory mode gives tf.gradients' gradients and a
measured saving, under DEFAULT Grappler (no optimizer options changed).

One small stack per family and one training step in a tf.function: forward
with ``training=True``, a scalar loss, then ``memsaving.gradients(loss,
model.trainable_variables, checkpoints="memory")`` or ``tf.gradients``, the
weight gradients reduced to a scalar inside the step (returned gradients
would hide the activations).  Each test checks

* every gradient equals tf.gradients' (tight ``assert_allclose``);
* the measured peak (``memsaving.measure_peak_increase``, CPU BFC allocator,
  one inter-op thread as conftest sets) of memory mode is at most
  ``max_ratio`` times that of plain tf.gradients;
* the executed plan's prediction (``predicted_peak - resident_bytes``, from
  ``memsaving.gradients_and_plan`` in the same trace) is within
  ``under``/``over`` of the measured peak.

Thresholds come from measurements on this project's machines (TF 2.21 CPU,
Keras 3, 2 cores, see FAMILIES; CPUs differ between machines, and with them
the oneDNN kernels' work buffers) with ~15-20% headroom for executor noise.  Each family
is measured in a fresh Python process (``family_figures``): in one long pytest
process what earlier tests left behind moved a figure by a whole activation.
Peaks repeat to the byte within one traced function, but two traces of the
same step can differ by one or two activations (and more under CPU load), so
each figure is the smallest over ``TRACES`` traces of ``RUNS`` runs after a
warm-up run.

Guards for two fixes: bias gradients waited on (memsaving.tf.rewrite
``_fusable_bias_gradient``; without it memory mode saves little on biased
layers: Dense, EinsumDense, DepthwiseConv2D, Dense+BatchNorm, Embedding+Dense)
and kept views pinning their base buffer (memsaving.sim.simulate
``_pin_view_bases``; without it the plan under-predicts and picks views as
checkpoints: Conv1D, MultiHeadAttention, Embedding+Dense).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import grappler_failures, in_a_fresh_process

MiB = 2**20
TRACES = 2
RUNS = 2
L = keras.layers


# --------------------------------------------------------------------------
# the stacks


def _sequential(input_shape, layers):
    return keras.Sequential([keras.Input(input_shape)] + layers)


def _dense():
    return _sequential((256,), [L.Dense(256, activation="relu") for _ in range(24)]), [512, 256]


def _einsum_dense():
    layers = [L.EinsumDense("ab,bc->ac", output_shape=256, bias_axes="c", activation="relu") for _ in range(24)]
    return _sequential((256,), layers), [512, 256]


def _conv1d():
    return _sequential((128, 64), [L.Conv1D(64, 3, padding="same", activation="relu") for _ in range(16)]), [32, 128, 64]


def _conv2d(use_bias=False):
    layers = [L.Conv2D(32, 3, padding="same", activation="relu", use_bias=use_bias) for _ in range(12)]
    return _sequential((16, 16, 32), layers), [32, 16, 16, 32]


def _conv2d_bias():
    return _conv2d(use_bias=True)


def _depthwise():
    return _sequential((32, 32, 32), [L.DepthwiseConv2D(3, padding="same", activation="relu") for _ in range(16)]), [8, 32, 32, 32]


def _batchnorm():
    layers = []
    for _ in range(6):
        layers += [L.Dense(256), L.BatchNormalization(), L.ReLU()]
    return _sequential((256,), layers), [1024, 256]


def _layernorm():
    layers = []
    for _ in range(6):
        layers += [L.Dense(256), L.LayerNormalization(), L.ReLU()]
    return _sequential((256,), layers), [1024, 256]


def _mha():
    inputs = keras.Input((64, 64))
    h = inputs
    for _ in range(4):
        h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=4, key_dim=16)(h, h))
    return keras.Model(inputs, h), [16, 64, 64]


def _embedding():
    inputs = keras.Input((64,), dtype="int32")
    h = L.Embedding(1000, 128)(inputs)
    for _ in range(10):
        h = L.Dense(128, activation="relu")(h)
    return keras.Model(inputs, h), [32, 64]


def _recurrent():
    return _sequential((16, 32), [L.LSTM(64, return_sequences=True), L.GRU(64, return_sequences=True)]), [128, 16, 32]


# --------------------------------------------------------------------------
# the step and its measurements


def _inputs(model, shape):
    if model.inputs[0].dtype == "int32":
        x = tf.random.uniform(shape, maxval=1000, dtype=tf.int32, seed=1)
    else:
        x = tf.random.normal(shape, seed=1)
    y = tf.random.normal(model(x).shape, seed=2)
    return x, y


def _loss(model, x, y):
    return tf.reduce_mean(tf.square(model(x, training=True) - y))


def _step(model, mode, plans):
    """One training step, its weight gradients reduced to a scalar."""
    weights = model.trainable_variables

    @tf.function
    def step(x, y):
        loss = _loss(model, x, y)
        if mode == "plain":
            grads = tf.gradients(loss, weights)
        else:
            grads, plans["memory"] = memsaving.gradients_and_plan(loss, weights, checkpoints="memory")
        return tf.add_n([tf.reduce_sum(g.values if isinstance(g, tf.IndexedSlices) else g) for g in grads])

    return step


def _both_gradients(model, x, y):
    """tf.gradients' and memory mode's gradients of the same loss (one trace)."""
    weights = model.trainable_variables

    @tf.function
    def both(x, y):
        loss = _loss(model, x, y)
        # memory mode first: tf.gradients adds outputs to a forward While
        # loop, which memory mode would profile anew
        ours = memsaving.gradients(loss, weights, checkpoints="memory")
        plain = tf.gradients(loss, weights)
        return [tf.convert_to_tensor(g) for g in plain], [tf.convert_to_tensor(g) for g in ours]

    return both(x, y)


@dataclasses.dataclass
class Measured:
    plain: float  # MiB, measure_peak_increase, the smallest over TRACES x RUNS
    memory: float
    predicted: float  # MiB, the executed plan's predicted_peak - resident_bytes
    checkpoints: list  # names of the executed plan's checkpoints
    peaks: dict  # mode -> every measurement (MiB)
    work_buffer: float  # MiB, the executed plan's largest_work_buffer


def family_figures(name: str) -> dict:
    """``name``'s figures (see ``Measured``) as plain JSON, gradients checked.

    Called in a fresh process by the tests: what earlier tests left in the
    allocator and the executor's cost estimates moved a family's memory-mode
    peak by a whole activation in a full suite run (all four readings of one
    run 7.28 MiB where it reads 6.07-6.34 alone)."""
    build = _recurrent if name == "recurrent" else FAMILIES[name].build
    return dataclasses.asdict(_run(build))


def _measured_in_a_fresh_process(name: str) -> Measured:
    return Measured(**in_a_fresh_process("test_layer_families", "family_figures", name))


def _run(build: Callable) -> Measured:
    keras.utils.set_random_seed(0)
    model, shape = build()
    x, y = _inputs(model, shape)
    plans = {}

    # Peaks repeat to the byte within one traced function, but two traces of
    # the same step can differ by a few activations (the executor's order of
    # independent ops differs; probably its per-function choice, from kernel
    # times measured in the first runs, of which ops run inline and which go
    # to the inter-op pool).  Hence the smallest over TRACES traces.
    peaks = {"plain": [], "memory": []}
    for _ in range(TRACES):
        values = {}
        for mode in peaks:
            step = _step(model, mode, plans)
            result, failures = grappler_failures(lambda: step(x, y))  # trace and warm up
            assert not failures, f"Grappler gave up on the {mode} step: {failures}"
            values[mode] = float(result)
            peaks[mode] += [memsaving.measure_peak_increase(step, x, y) / MiB for _ in range(RUNS)]
        assert values["memory"] == pytest.approx(values["plain"], rel=1e-5, abs=1e-6)

    # gradients: every one equal to tf.gradients'
    plain_grads, ours_grads = _both_gradients(model, x, y)
    assert len(plain_grads) == len(ours_grads) == len(model.trainable_variables)
    for variable, a, b in zip(model.trainable_variables, plain_grads, ours_grads):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=variable.path)

    plan = plans["memory"]
    return Measured(min(peaks["plain"]), min(peaks["memory"]),
                    (plan.predicted_peak - plan.resident_bytes) / MiB, [str(c) for c in plan.checkpoints], peaks,
                    plan.largest_work_buffer / MiB)


# --------------------------------------------------------------------------
# the families


@dataclasses.dataclass
class Family:
    build: Callable
    max_ratio: float  # measured memory <= max_ratio * measured plain
    under: Optional[float]  # predicted >= (1 - under) * measured; None: prediction not checked
    over: Optional[float] = None  # predicted <= (1 + over) * measured


# Basis, in MiB (plain / memory mode / predicted), each the smallest over the
# traces of one fresh process, ranges over 7 runs of this file (2026-11-24):
# the memory/plain ratio and the prediction's relative error ((predicted -
# measured) / measured).  Then, measured earlier with every family in one
# pytest process, the same stack with each fix reverted (monkeypatched), 3-4
# processes each.  The bounds date from the one-process measurements, which
# spread wider; they were not tightened.
FAMILIES = {
    # 24 x Dense(256, relu), batch 512.  12.8-15.3 / 5.01 / 4.5: ratio
    # 0.33-0.39, error -10%.  No bias fix: 13.0-15.3 / 12.5-12.8, ratio
    # 0.82-0.96, error -64%.
    "dense": Family(_dense, 0.45, 0.2, 0.2),
    # 24 x EinsumDense("ab,bc->ac", bias_axes="c", relu), batch 512.
    # 12.8-15.3 / 5.01 / 4.5: ratio 0.33-0.39, error -10%.  No bias
    # fix: 13.8-15.2 / 11.8-13.2, ratio 0.83-0.87, error -62..-66%.
    "einsum_dense": Family(_einsum_dense, 0.5, 0.3, 0.2),
    # 16 x Conv1D(64, 3, relu), (32, 128, 64).  18.1-28.1 / 7.20-7.22 / 7.05:
    # ratio 0.26-0.40, error -2%.  No view fix: 17.3-18.3 / 12.3 / 3.05,
    # ratio 0.67-0.71, error -75% (kept ExpandDims/Squeeze views counted
    # free).  No bias fix: ratio 0.42-0.53, error -38..-43% (fails on the
    # prediction, with little margin).
    # On an AMD EPYC machine (AVX2, no AVX-512; 2026-11-25) every convolution
    # gradient takes a 32 MiB work buffer, measured by the profiles: 57.2 /
    # 39.25 / 39.05 (error -1%), and the same 7.2 MiB above the buffer.  The
    # three convolution families' ratios are taken above that buffer.
    "conv1d": Family(_conv1d, 0.6, 0.35, 0.2),
    # 12 x Conv2D(32, 3, relu, use_bias=False), (32, 16, 16, 32).
    # 13.47 / 6.47-6.51 / 6.0: ratio 0.48, error -7..-8%.  Neither
    # fix changes it (no bias, no views).  AMD EPYC: 47.5 / 38.5 / 38.0, a
    # 32 MiB work buffer: ratio 0.42 above it, error -1%.
    "conv2d": Family(_conv2d, 0.7, 0.35, 0.2),
    # The same with biases (the Keras default).  13.47 / 6.48-6.57 / 6.0:
    # ratio 0.48-0.49, error -7..-9%.  It was a
    # known problem until the gradient ops ran in the planned order
    # (memsaving.tf.order): memory mode measured 8.0-14.5 from one process to
    # the next, and 8- or 16-layer stacks failed at run time with "nodes in
    # a cycle"; the ratio bound (0.6) is what guards that.
    "conv2d_bias": Family(_conv2d_bias, 0.6, 0.3, 0.2),
    # 16 x DepthwiseConv2D(3, relu), (8, 32, 32, 32).  18.0-22.0 / 9.97 /
    # 7.0: ratio 0.45-0.55, error -30% (in one pytest process: 7.1-10.7,
    # error -25..+14%).  AMD EPYC: 23.0 / 10.97 / 7.01, error -36% (one
    # activation more measured; the kernel's work buffer profiles at 0.01
    # MiB), hence under 0.4: the prediction misses four 1 MiB activations.
    # No bias fix: 17.4-18.6 / 16.4-18.2, ratio 0.94-1.03, error -51..-56%.
    "depthwise_conv2d": Family(_depthwise, 0.7, 0.4, 0.25),
    # 6 x (Dense(256), BatchNormalization, ReLU), batch 1024.  14.02 /
    # 6.26-6.27 / 7.0: ratio 0.45, error +12% (in one pytest process:
    # 7.3-8.97 / 7.0-7.75).  No bias fix:
    # 14.0-14.5 / 9.0-9.7, ratio 0.64-0.67, error -22..-28%.  No view fix:
    # 14.9 / 8.2 / 7.0, ratio 0.55, error -15% (the moments' Squeeze views).
    # Executor drift in one pytest process reached the no-view-fix error, so
    # the view fix is guarded by Conv1D, MHA and Embedding.
    "dense_batchnorm": Family(_batchnorm, 0.63, 0.2, 0.15),
    # 6 x (Dense(256), LayerNormalization, ReLU), batch 1024.  21.1-22.1 /
    # 11.28 / 8.0: ratio 0.51-0.54, error -29% (the plan misses about three
    # activations).  Neither fix is caught: without the bias fix
    # ratio 0.51-0.54, error -32%; without the view fix ratio 0.46-0.48,
    # error -32%; the fixed code's error needs a tolerance that covers them.
    # Running the gradient ops in the planned order (memsaving.tf.order) costs
    # this family about one activation: memory mode 11.3 MiB in isolation,
    # 13.0 in a full suite run, against 10.0-10.9 before (cause not found;
    # the Dense and two-tower steps measure lower and steadier with it).
    "layernorm": Family(_layernorm, 0.6, 0.45, 0.15),
    # 4 x (MultiHeadAttention(4 heads, key_dim 16) + residual, LayerNorm),
    # (16, 64, 64).  16.2-16.5 / 5.24-6.00 / 6.03-6.20: ratio 0.32-0.37,
    # error 0..+18%.  No view fix: 15.3-16.3 / 7.0-8.3 / 6.0, ratio
    # 0.43-0.55, error -13..-27% (the attention heads' reshapes).  The
    # prediction moves with the kernel profiles: a reading counts whole
    # allocator chunks, and what earlier tests left allocated decides the
    # chunk a request gets (the scores' Mul gradient read 1.0-1.8 MiB over
    # 114 processes), hence +35%.
    "multi_head_attention": Family(_mha, 0.44, 0.1, 0.35),
    # Embedding(1000, 128) + 10 x Dense(128, relu), (32, 64) ids.  12.0-13.0 /
    # 6.01 / 6.01: ratio 0.46-0.50, error 0% (in one pytest process a full
    # fresh-clone suite run read 7.28, -17%).  No bias fix:
    # 12.0-12.7 / 12.0-12.7, ratio 1.0, error -53%.  No view fix:
    # 12.0 / 8.06 / 4.0, ratio 0.67, error -50% (Dense on 3-D inputs reshapes).
    "embedding_dense": Family(_embedding, 0.6, 0.15, 0.15),
}


def _show(name, m):
    print(f"\n{name}: peaks (MiB) {m.peaks}, predicted {m.predicted:.2f} MiB, largest work buffer "
          f"{m.work_buffer:.2f} MiB, checkpoints {m.checkpoints}")


def _check(name, family, m):
    _show(name, m)
    assert m.checkpoints, f"{name}: memory mode chose no checkpoints"
    floor = m.work_buffer  # in every step's peak, whatever is recomputed
    assert m.memory - floor <= family.max_ratio * (m.plain - floor), (
        f"{name}: memory mode {m.memory:.2f} MiB > {family.max_ratio} x plain {m.plain:.2f} MiB, "
        f"both above the largest kernel work buffer ({floor:.2f} MiB; peaks {m.peaks})")
    if family.under is not None:
        error = (m.predicted - m.memory) / m.memory
        assert -family.under <= error <= family.over, (
            f"{name}: predicted {m.predicted:.2f} MiB, measured {m.memory:.2f} MiB ({error:+.0%}, "
            f"allowed -{family.under:.0%}..+{family.over:.0%})")


SLOW_FAMILIES = {"einsum_dense", "conv1d", "conv2d", "layernorm", "dense_batchnorm", "depthwise_conv2d"}
"""Families left to ``-m slow`` (about 12 s each): what they guard is guarded
by the others too (the bias fix by Dense and Embedding+Dense, the order of
gradient ops and convolutions' work buffers by Conv2D with biases); LayerNorm
guards neither fix."""


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FAMILIES else name
                                  for name in FAMILIES])
def test_memory_mode_saves_on_layer_family(name):
    _check(name, FAMILIES[name], _measured_in_a_fresh_process(name))


@pytest.mark.slow  # 15 s; test_profiles.test_lstm_step checks a loop's prediction
def test_recurrent_layers_are_not_worse():
    """LSTM and GRU: nothing to save, and nothing lost.

    Keras runs each recurrence as one While loop; memsaving never recomputes
    control flow, so each loop (which keeps every time step's activations
    for its own gradient) is kept whole, and memory mode cannot lower the
    peak (its plan has no checkpoint, or one after the loops).  It must
    still give the same gradients and not raise the peak beyond noise
    (10% + 0.25 MiB).

    LSTM(64) + GRU(64), (128, 16, 32).  9.34-9.47 / 8.83-9.35 / 10.0-10.13
    MiB (plain / memory mode / predicted, 7 fresh processes): ratio
    0.94-0.99, error +7..+13% (the
    plan takes each loop whole, sized from measured kernel profiles).
    Neither fix changes it.
    """
    m = _measured_in_a_fresh_process("recurrent")
    _show("recurrent", m)
    assert m.memory <= 1.1 * m.plain + 0.25, f"memory mode {m.memory:.2f} MiB vs plain {m.plain:.2f} MiB"
    error = (m.predicted - m.memory) / m.memory
    assert -0.1 <= error <= 0.25, f"predicted {m.predicted:.2f} MiB, measured {m.memory:.2f} MiB ({error:+.0%})"
