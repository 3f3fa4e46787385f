"""The simulator's model of TensorFlow's buffer reuse, on hand-made graphs:
in-place elementwise kernels, weight gradients of variable reads, and weight
gradients consumed by their own kernels."""

from dataclasses import replace

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model, gradient_sinks, without_forwarding
from memsaving.sim.simulate import simulate

SIZE = 100


def _elementwise_chain(n: int, forwards: bool) -> GraphModel:
    """x -> op_1 -> ... -> op_n; each gradient reads the op's output (like tanh)."""
    model = chain_model([SIZE] * n, grad_reads="output")
    ops = [replace(op, type="Tanh", forwards_input=forwards) for op in model.ops]
    return GraphModel(ops, model.tensors, model.xs, model.ys)


def test_in_place_backward_saves_one_gradient_buffer():
    plain = simulate(_elementwise_chain(6, forwards=False))
    in_place = simulate(_elementwise_chain(6, forwards=True))
    # without reuse a gradient op holds its input gradient and its output
    # gradient at once; writing into the dying input gradient saves one
    assert plain.peak_bytes - in_place.peak_bytes == SIZE


def test_in_place_forward_does_not_reuse_a_buffer_still_needed():
    # every output is read by its own gradient, so no forward op may reuse
    # its input's buffer: the forward part of the timeline is unchanged
    plain = simulate(_elementwise_chain(6, forwards=False))
    in_place = simulate(_elementwise_chain(6, forwards=True))
    assert plain.timeline[:6] == in_place.timeline[:6]


def test_without_forwarding_restores_the_plain_count():
    model = _elementwise_chain(6, forwards=True)
    assert simulate(without_forwarding(model)).peak_bytes == simulate(_elementwise_chain(6, False)).peak_bytes


def _layer_with_variable(separate: bool) -> GraphModel:
    """x = 2 * z; h = matmul(x, read(w)); loss = sum(h): the weight read is a
    view (0 bytes, ``value_bytes`` of the weight) of the handle w, an x, and
    the matmul's gradient makes both dx and dw."""
    weight = 5 * SIZE
    tensors = {
        0: TensorInfo("z", SIZE, -1),
        1: TensorInfo("w", 0, -1, constant=True, value_bytes=weight),
        2: TensorInfo("x", SIZE, 0),
        3: TensorInfo("read", 0, 1, value_bytes=weight),
        4: TensorInfo("h", SIZE, 2),
        5: TensorInfo("loss", 4, 3),
    }
    ops = [
        OpInfo("scale", "Mul", (0,), (2,), grad_reads=()),
        OpInfo("read", "ReadVariableOp", (1,), (3,)),
        OpInfo("matmul", "MatMul", (2, 3), (4,), grad_reads=(2, 3)),
        OpInfo("sum", "Sum", (4,), (5,)),
    ]
    return GraphModel(ops, tensors, xs=[1], ys=[5], separate_result_kernels=separate)


def test_a_variable_read_is_a_gradient_sink_with_the_weight_size():
    model = _layer_with_variable(separate=False)
    assert gradient_sinks(model) == {1, 3}
    sim = simulate(model, keep_x_gradients=True)
    # the weight gradient (500 bytes) stays, h and its gradient come and go
    assert sim.peak_bytes >= 5 * SIZE
    # no backward action for the read: its output's gradient is the result
    assert "backward read" not in sim.labels


def test_separate_result_kernels_do_not_hold_a_weight_gradient_with_the_rest():
    together = simulate(_layer_with_variable(separate=False))
    separate = simulate(_layer_with_variable(separate=True))
    assert separate.peak_bytes < together.peak_bytes
    # a kept weight gradient is held either way
    assert simulate(_layer_with_variable(True), keep_x_gradients=True).peak_bytes == \
        simulate(_layer_with_variable(False), keep_x_gradients=True).peak_bytes
