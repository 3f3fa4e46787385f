"""Property-based correctness on image-shaped random DAGs.

Every tensor of a generated program has shape [B, H, W, C]; ops are 2-D
convolutions, matmuls over the channel axis, elementwise ops, concat and a
*separate* split (both halves become tensors of the program), reductions
broadcast back, reshapes, gathers (channel permutations and batch gathers
with repeated indices) and tf.where.  Each example draws a checkpoint choice:
a random subset of the tensors, "memory", "speed", "collection", or a budget
that is a fraction of the plain plan's predicted peak.  memsaving.gradients
must equal tf.gradients (dense or IndexedSlices alike); an infeasible budget
may only raise BudgetError stating the smallest budget, which then works.

The default run draws a fixed small number of examples; ``pytest -m slow``
runs a longer search.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memsaving
from helpers import assert_gradients_equal, dense, loss_ancestors

B, H, W, C = 2, 4, 4, 4
SHAPE = [B, H, W, C]
UNARY = (tf.tanh, tf.nn.relu, tf.sigmoid, tf.square, tf.sin, tf.nn.elu)
BINARY_KINDS = ("add", "mul", "concat", "where", "reduce")
KINDS = ("conv2d", "matmul", "unary", "split") + BINARY_KINDS + ("reshape", "gather_channels", "gather_batch")
MODES = ("subset", "memory", "speed", "collection", "budget", "none")


@st.composite
def programs(draw, max_ops=12):
    count = draw(st.integers(2, max_ops))
    program = []
    available = 1  # tensor 0 is the input
    for _ in range(count):
        kind = draw(st.sampled_from(KINDS))
        a = draw(st.integers(0, available - 1))
        b = draw(st.integers(0, available - 1))
        param = draw(st.integers(0, 10_000))
        program.append((kind, a, b, param))
        available += 2 if kind == "split" else 1
    outputs = draw(st.lists(st.integers(1, available - 1), min_size=1, max_size=3, unique=True))
    mode = draw(st.sampled_from(MODES))
    seed = draw(st.integers(0, 2 ** 16))
    fraction = draw(st.sampled_from([0.3, 0.6, 0.8, 0.95]))
    return program, outputs, mode, seed, fraction


def _weights(program):
    rng = np.random.RandomState(7)
    weights = {}
    for k, (kind, _, _, _) in enumerate(program):
        if kind == "conv2d":
            weights[k] = tf.Variable((rng.randn(3, 3, C, C) / np.sqrt(9 * C)).astype(np.float32))
        elif kind == "matmul":
            weights[k] = tf.Variable((rng.randn(C, C) / np.sqrt(C)).astype(np.float32))
    return weights


def _build(program, outputs, x, weights):
    """Returns the loss, every tensor of the program, for each tensor the
    indices of the tensors it reads, and the kind of op that made it."""
    tensors, reads, kinds = [x], [()], ["input"]
    for k, (kind, a, b, param) in enumerate(program):
        ta, tb = tensors[a], tensors[b]
        if kind == "conv2d":
            out, used = tf.nn.conv2d(ta, weights[k], strides=1, padding="SAME"), (a,)
        elif kind == "matmul":
            out, used = tf.reshape(tf.matmul(tf.reshape(ta, [-1, C]), weights[k]), SHAPE), (a,)
        elif kind == "unary":
            out, used = UNARY[param % len(UNARY)](ta), (a,)
        elif kind == "split":
            left, right = tf.split(ta, 2, axis=3)
            # two program tensors of shape [B, H, W, C]: tile the halves back
            tensors += [tf.concat([left, left * 0.5], axis=3), tf.concat([tf.tanh(right), right], axis=3)]
            reads += [(a,), (a,)]
            kinds += ["split", "split"]
            continue
        elif kind == "add":
            out, used = ta + tb, (a, b)
        elif kind == "mul":
            out, used = ta * tb, (a, b)
        elif kind == "concat":
            joined = tf.concat([ta, tb], axis=3)
            out, used = joined[..., 1: C + 1] * 0.7, (a, b)  # straddles both inputs
        elif kind == "where":
            out, used = tf.where(ta > tb, ta, 0.5 * tb), (a, b)
        elif kind == "reduce":
            axis = [(1, 2), (3,), (1, 2, 3)][param % 3]
            out, used = ta * tf.reduce_mean(tb, axis=axis, keepdims=True), (a, b)
        elif kind == "reshape":
            out, used = tf.reshape(tf.transpose(tf.reshape(ta, [B, H * W, C]), [0, 2, 1]), SHAPE), (a,)
        elif kind == "gather_channels":
            out, used = tf.gather(ta, np.random.RandomState(param).permutation(C), axis=3), (a,)
        else:  # gather_batch: repeated rows, gradient is an IndexedSlices-like segment sum
            rows = np.random.RandomState(param).randint(0, B, size=B)
            out, used = tf.gather(ta, rows, axis=0), (a,)
        tensors.append(out)
        reads.append(used)
        kinds.append(kind)
    loss = tf.add_n([tf.reduce_mean(tf.square(tensors[i])) * (i + 1) for i in outputs])
    return loss, tensors, reads, kinds


def check_example(example):
    program, outputs, mode, seed, fraction = example
    weights = _weights(program)
    variables = [weights[k] for k in sorted(weights)]
    x = tf.constant(np.random.RandomState(seed % 97).randn(*SHAPE).astype(np.float32))
    refused = []

    @tf.function
    def both(x):
        loss, tensors, reads, kinds = _build(program, outputs, x, weights)
        xs = [x] + variables
        plain = tf.gradients(loss, xs)
        live = loss_ancestors(reads, outputs)
        rng = np.random.RandomState(seed)
        subset = [tensors[i] for i in live if rng.rand() < 0.5]
        kwargs = {}
        if mode == "subset":
            kwargs["checkpoints"] = subset
        elif mode == "collection":
            for t in subset or [tensors[live[-1]]]:
                memsaving.checkpoint(t)
        elif mode in ("memory", "speed"):
            kwargs["checkpoints"] = mode
        elif mode == "budget":
            kwargs["checkpoints"] = "memory"
            kwargs["budget"] = max(1, int(fraction * memsaving.plan(loss, xs, checkpoints=[]).predicted_peak))
        else:
            kwargs["checkpoints"] = []
        try:
            ours = memsaving.gradients(loss, xs, **kwargs)
        except memsaving.BudgetError as error:
            message = str(error)
            assert "smallest feasible budget" in message and error.smallest_budget, message
            assert error.smallest_budget > kwargs["budget"], message
            refused.append(error.smallest_budget)
            ours = memsaving.gradients(loss, xs, checkpoints="memory", budget=error.smallest_budget)
        except memsaving.CheckpointError as error:
            # "speed" on a program without a conv or matmul between xs and ys
            assert mode == "speed" and "found no MatMul/Conv" in str(error), str(error)
            assert not any(kinds[i] in ("conv2d", "matmul") for i in live)
            ours = memsaving.gradients(loss, xs, checkpoints=[])
        return [dense(g) for g in plain], [dense(g) for g in ours]

    plain, ours = both(x)
    assert len(plain) == len(ours)
    assert_gradients_equal(plain, ours, [f"gradient {i}" for i in range(len(plain))], f"mode {mode}")


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)


@settings(max_examples=12, **SETTINGS)  # 300 in the slow long run below
@given(programs())
def test_image_dags_gradients_equal_tf_gradients(example):
    check_example(example)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_on_one_fixed_dag(mode):
    """Each checkpoint choice at least once, whatever hypothesis draws."""
    program = [("conv2d", 0, 0, 1), ("unary", 1, 0, 1), ("split", 2, 0, 0), ("add", 3, 4, 0),
               ("matmul", 5, 0, 0), ("where", 6, 1, 0), ("reduce", 7, 3, 2), ("gather_batch", 8, 0, 3),
               ("reshape", 9, 0, 0), ("gather_channels", 10, 0, 5), ("concat", 11, 6, 0)]
    check_example((program, [12, 4], mode, 11, 0.3))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(programs(max_ops=24))
def test_image_dags_gradients_equal_tf_gradients_long_run(example):
    check_example(example)
