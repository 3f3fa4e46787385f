"""experiments.peak_allocations: the buffers alive at a measured peak."""

import tensorflow as tf

from experiments.peak_allocations import (GradientOrder, OpRun, dense_gradient_order, executed_ops, peak_allocations,
                                           profiled_run)


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


def test_the_trace_names_the_ops_the_executor_ran_in_time_order():
    x = tf.random.normal([64, 64], seed=1)

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.sin(tf.matmul(x, x, name="first_matmul"), name="then_sin"))

    runs = executed_ops(profiled_run(step, x))
    names = [r.name for r in runs]
    assert "first_matmul" in names and "then_sin" in names, names
    assert names.index("first_matmul") < names.index("then_sin")
    assert not any("ExecutorState" in name or "Threadpool" in name for name in names)
    assert all(a.start_us <= b.start_us for a, b in zip(runs, runs[1:]))


def test_dense_gradient_order_counts_the_data_gradients_run_while_a_weight_gradient_waits():
    def run(name, start):
        return OpRun(name, start, 1.0, "thread")

    runs = [run("g/top/MatMul_grad/MatMul", 0), run("g/mid/MatMul_grad/MatMul", 1),
            run("g/low/MatMul_grad/MatMul_1", 2), run("g/low/MatMul_grad/MatMul", 3),
            run("g/top/MatMul_grad/MatMul_1", 4), run("g/mid/MatMul_grad/MatMul_1", 5),
            run("g/top/BiasAdd_grad/BiasAddGrad", 6)]
    order = {o.layer: o for o in dense_gradient_order(runs)}
    assert set(order) == {"g/top", "g/mid", "g/low"}
    assert order["g/top"] == GradientOrder("g/top", True, 2)   # mid's and low's data gradients ran first
    assert order["g/mid"] == GradientOrder("g/mid", True, 1)
    assert order["g/low"] == GradientOrder("g/low", False, 0)
