"""Random differentiable programs over [B, W] tensors, for property tests.

A program is a list of ``(kind, a, b, param)``: op ``k`` makes tensor
``k + 1`` from tensors ``a`` and ``b`` made before it (tensor 0 is the
input).  The loss sums the squares of the ``outputs`` tensors.
"""

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

B, W = 4, 8
UNARY = ("tanh", "relu", "sigmoid", "square", "sin")
KINDS = ("matmul", "unary", "add", "mul", "concat_split", "reduce", "reshape", "gather", "where", "conv")
BINARY_KINDS = frozenset({"add", "mul", "concat_split", "reduce", "where"})


@st.composite
def programs(draw, max_ops=14):
    """``(program, outputs)``: a random program and the tensors its loss sums."""
    count = draw(st.integers(3, max_ops))
    program = []
    for k in range(count):
        kind = draw(st.sampled_from(KINDS))
        a = draw(st.integers(0, k))
        b = draw(st.integers(0, k))
        program.append((kind, a, b, draw(st.integers(0, 1000))))
    outputs = draw(st.lists(st.integers(1, count), min_size=1, max_size=3, unique=True))
    return program, outputs


def run_program(program, x, weights) -> list:
    """Every tensor of ``program`` (tensor 0 is ``x``)."""
    tensors = [x]
    for k, (kind, a, b, param) in enumerate(program):
        ta, tb = tensors[a], tensors[b]
        if kind == "matmul":
            out = tf.matmul(ta, weights[k])
        elif kind == "unary":
            name = UNARY[param % len(UNARY)]
            out = tf.nn.relu(ta) if name == "relu" else getattr(tf.math, name)(ta)
        elif kind == "add":
            out = ta + tb
        elif kind == "mul":
            out = ta * tb
        elif kind == "concat_split":
            joined = tf.concat([ta, tb], axis=1)
            left, right = tf.split(joined, 2, axis=1)
            out = left * 0.5 + tf.tanh(right)
        elif kind == "reduce":
            out = ta * tf.reduce_mean(tb, axis=1, keepdims=True)
        elif kind == "reshape":
            out = tf.reshape(tf.reshape(ta, [B * W]) * 1.5, [B, W])
        elif kind == "gather":
            out = tf.gather(ta, np.random.RandomState(param).permutation(W), axis=1)
        elif kind == "where":
            out = tf.where(ta > 0, ta, tb * 0.3)
        else:  # conv
            out = tf.reshape(tf.nn.conv1d(tf.reshape(ta, [B, W, 1]), weights[k], 1, "SAME"), [B, W])
        tensors.append(out)
    return tensors


def program_loss(tensors, outputs):
    return tf.add_n([tf.reduce_sum(tf.square(tensors[i])) for i in outputs])


def program_reads(program) -> list:
    """For each tensor, the tensors it is computed from (tensor 0 is the input)."""
    return [()] + [(a, b) if kind in BINARY_KINDS else (a,) for kind, a, b, _ in program]


def program_weights(program) -> dict:
    """Variables of the matmul and conv ops, by op index."""
    rng = np.random.RandomState(0)
    weights = {}
    for k, (kind, _, _, _) in enumerate(program):
        if kind == "matmul":
            weights[k] = tf.Variable((rng.randn(W, W) / np.sqrt(W)).astype(np.float32))
        elif kind == "conv":
            weights[k] = tf.Variable(rng.randn(3, 1, 1).astype(np.float32) * 0.5)
    return weights
