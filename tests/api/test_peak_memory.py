"""Measured peak memory: recomputation must really lower it.

Peaks are read from the CPU BFC allocator (conftest sets
TF_CPU_ALLOCATOR_USE_BFC and one inter-op thread, so they repeat exactly).
Gradients are reduced to a scalar inside the function so returned weight
gradients do not hide the activations.
"""

import math

import tensorflow as tf

import memsaving

DEPTH, BATCH, WIDTH = 64, 1024, 128


def _deep_mlp_step(use_memsaving: bool):
    ws = [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=WIDTH ** -0.5, seed=i)) for i in range(DEPTH)]
    every = int(math.sqrt(DEPTH))

    @tf.function
    def step(x):
        h, cps = x, []
        for i, w in enumerate(ws):
            h = tf.nn.relu(tf.matmul(h, w))
            if i % every == every - 1:
                cps.append(h)
        loss = tf.reduce_sum(h * h)
        if use_memsaving:
            grads = memsaving.gradients(loss, ws, checkpoints=cps)
        else:
            grads = tf.gradients(loss, ws)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    return step


def test_sqrt_n_checkpoints_halve_peak_memory_of_deep_mlp():
    x = tf.random.normal([BATCH, WIDTH], seed=0)
    plain_step, ours_step = _deep_mlp_step(False), _deep_mlp_step(True)
    plain_value, ours_value = plain_step(x), ours_step(x)  # trace and warm up
    # the step's own memory: an absolute peak would also count whatever
    # earlier tests in the same process keep alive, and halving is a claim
    # about the step
    plain = memsaving.measure_peak_increase(plain_step, x)
    ours = memsaving.measure_peak_increase(ours_step, x)
    activation = BATCH * WIDTH * 4
    print(f"peak plain {plain / 2**20:.1f} MiB, memsaving {ours / 2**20:.1f} MiB, ratio {plain / ours:.2f}")
    assert plain > DEPTH * activation * 0.8, "plain backprop should hold every activation"
    assert plain >= 2 * ours
    assert abs(float(plain_value) - float(ours_value)) <= 1e-4 * abs(float(plain_value)) + 1e-6


def test_measure_peak_repeats_exactly():
    x = tf.random.normal([BATCH, WIDTH], seed=0)
    step = _deep_mlp_step(True)
    step(x)
    assert memsaving.measure_peak(step, x) == memsaving.measure_peak(step, x)
