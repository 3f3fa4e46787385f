"""Graph-model builders shared by the planning side's tests (no TensorFlow)."""

from typing import Iterator

import numpy as np

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model


def random_chains(count: int, n: int, seed: int) -> Iterator[GraphModel]:
    """``count`` chains of ``n`` ops with random activation bytes (100-999)
    and costs (1-10); their gradients read the op's input, its output, or
    both, in turn, so each rule of what a gradient holds is exercised."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        reads = ("input", "output", "both")[trial % 3]
        yield chain_model(list(rng.integers(100, 1000, n)), list(rng.uniform(1, 10, n)), grad_reads=reads)


def dense_chain(layers: int = 8, weight: int = 4096, activation: int = 64, flops: float = 1e6,
                tied: bool = False) -> GraphModel:
    """x -> (read w_k, matmul, tanh) * layers -> loss, as a Keras MLP extracts:
    each weight's read is a view (0 bytes) of the variable behind a handle
    (tensor ``10 k + 1``).  With ``tied`` the last layer reads the first
    layer's variable again instead of one of its own (a tied embedding)."""
    tensors = {0: TensorInfo("x", activation, trainable=False)}
    ops, h, handles = [], 0, []
    for k in range(layers):
        handle, value, product, out = 10 * k + 1, 10 * k + 2, 10 * k + 3, 10 * k + 4
        source = 1 if tied and k == layers - 1 else handle
        if source == handle:
            tensors[handle] = TensorInfo(f"w{k}", 0, constant=True, value_bytes=weight)
            handles.append(handle)
        tensors[value] = TensorInfo(f"read{k}", 0, len(ops), value_bytes=weight)
        ops.append(OpInfo(f"read{k}", "ReadVariableOp", (source,), (value,), copyable=False))
        tensors[product] = TensorInfo(f"matmul{k}", activation, len(ops))
        ops.append(OpInfo(f"matmul{k}", "MatMul", (h, value), (product,), grad_reads=(h, value),
                          input_grad_reads=((value,), (h,)), cost=flops))
        tensors[out] = TensorInfo(f"tanh{k}", activation, len(ops))
        ops.append(OpInfo(f"tanh{k}", "Tanh", (product,), (out,), grad_reads=(out,), cost=activation))
        h = out
    tensors[1000] = TensorInfo("loss", 4, len(ops))
    ops.append(OpInfo("loss", "Sum", (h,), (1000,), cost=activation))
    resident = activation + len(handles) * weight
    return GraphModel(ops, tensors, xs=handles, ys=[1000], resident_bytes=resident, separate_result_kernels=True)
