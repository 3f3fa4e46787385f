"""memsaving.tf.constant_values: which tensors TensorFlow can fold."""

import doctest

import tensorflow as tf

from memsaving.tf import constant_values
from memsaving.tf.constant_values import from_constants


def _graph_tensors():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3])
        found = {
            "fill": tf.ones_like(x),  # a Fill over x's known shape
            "shape": tf.shape(x),
            "mask": tf.logical_and(tf.ones([2, 3], tf.bool), tf.linalg.band_part(tf.ones([3, 3], tf.bool), -1, 0)[:2]),
            "x": x,
            "from x": tf.sin(x) * 2.0,
            "random": tf.random.uniform([2, 3]),
            "from random": tf.random.uniform([2, 3]) + 1.0,
        }
        unknown = tf.compat.v1.placeholder(tf.float32, [None, 3])
        found["unknown shape"] = tf.shape(unknown)
    return found


def test_values_from_constants_and_shapes_known_when_tracing():
    tensors = _graph_tensors()
    known = {}
    assert all(from_constants(tensors[name], known) for name in ("fill", "shape", "mask"))


def test_values_from_placeholders_random_ops_and_unknown_shapes_are_not():
    tensors = _graph_tensors()
    known = {}
    assert not any(from_constants(tensors[name], known)
                   for name in ("x", "from x", "random", "from random", "unknown shape"))


def test_a_value_behind_too_many_ops_is_not_taken_as_constant():
    def chain(length):
        with tf.Graph().as_default():
            t = tf.constant(1.0)
            for _ in range(length):
                t = t + 1.0
            return t

    assert from_constants(chain(10), {})
    # not looked at so far: copied per piece, as any value is (correct, not shared)
    assert not from_constants(chain(constant_values.MAX_OPS + 5), {})


def test_module_examples():
    failures, tried = doctest.testmod(constant_values)
    assert tried and not failures
