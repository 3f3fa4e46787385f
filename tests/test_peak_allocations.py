"""experiments.peak_allocations: the buffers alive at a measured peak."""

import tensorflow as tf

from experiments.peak_allocations import peak_allocations


def test_the_buffers_alive_at_the_peak_are_named_by_their_ops():
    x = tf.random.normal([512, 1024], seed=1)  # 2 MiB

    @tf.function
    def step(x):
        big = tf.exp(x, name="held_exp")  # alive while the next op runs
        other = tf.sin(x, name="second_sin")
        return tf.reduce_sum(big * other)

    peak, allocations = peak_allocations(step, x)
    names = {a.op for a in allocations}
    assert any("held_exp" in n for n in names) and any("second_sin" in n for n in names)
    assert peak >= sum(a.chunk_bytes for a in allocations) >= 4 * 2 ** 20
