"""Cut candidates on hand-made graph models (no TensorFlow graph)."""

import networkx as nx
import numpy as np
import pytest

from memsaving.candidates import cuts as candidates
from memsaving.model import parameters
from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model
from memsaving.candidates.selection import bottlenecks


def towers(k: int, depth: int) -> GraphModel:
    """k chains fed by one input tensor, summed at the end."""
    tensors = {0: TensorInfo("x", 8)}
    ops = []
    ends = []
    for t in range(k):
        prev = 0
        for d in range(depth):
            out = len(tensors)
            tensors[out] = TensorInfo(f"t{t}_{d}", 8, len(ops))
            ops.append(OpInfo(f"op{t}_{d}", "Op", (prev,), (out,), grad_reads=(prev,)))
            prev = out
        ends.append(prev)
    out = len(tensors)
    tensors[out] = TensorInfo("sum", 8, len(ops))
    ops.append(OpInfo("sum", "AddN", tuple(ends), (out,)))
    return GraphModel(ops, tensors, xs=[0], ys=[out])


def test_bottlenecks_on_a_diamond_and_a_chain():
    g = nx.DiGraph([("a", "b"), ("b", "c"), ("b", "d"), ("c", "e"), ("d", "e"), ("e", "f")])
    assert bottlenecks(g, ["a", "b", "c", "d", "e", "f"]) == ["b", "e"]
    with pytest.raises(ValueError, match="topological"):
        bottlenecks(g, ["b", "a", "c", "d", "e", "f"])


def test_chain_articulation_is_every_inner_op():
    model = chain_model([8] * 6)
    assert candidates.articulation(model) == [1, 2, 3, 4]


def test_towers_have_level_cuts_with_one_op_per_tower():
    model = towers(3, 5)
    assert candidates.articulation(model) == []
    cuts = candidates.level_cuts(model)
    assert len(cuts) == 5
    for cut, before in cuts[:-1]:
        assert len(cut) == 3
    assert [b for _, b in cuts] == sorted(b for _, b in cuts)
    chosen = candidates.sqrtn_sets(model, candidates.memory_candidates(model))
    assert len(chosen) >= 3 and len(chosen) % 3 == 0


def test_parameter_ops_are_not_activations():
    """A weight reshape late in the network must not hide earlier separators."""
    tensors = {0: TensorInfo("x", 8), 1: TensorInfo("w", 0, -1, True, constant=True)}
    ops = []
    prev = 0
    for d in range(4):
        out = len(tensors)
        tensors[out] = TensorInfo(f"h{d}", 8, len(ops))
        ops.append(OpInfo(f"layer{d}", "Op", (prev,), (out,), grad_reads=(prev,)))
        prev = out
    # a late op that only reshapes the weight, then its use
    w2 = len(tensors)
    tensors[w2] = TensorInfo("w_reshaped", 4, len(ops))
    ops.append(OpInfo("reshape_w", "Reshape", (1,), (w2,)))
    out = len(tensors)
    tensors[out] = TensorInfo("y", 8, len(ops))
    ops.append(OpInfo("last", "Mul", (prev, w2), (out,), grad_reads=(prev, w2)))
    model = GraphModel(ops, tensors, xs=[0, 1], ys=[out])
    assert parameters.parameter_ops(model) == {4}
    assert candidates.articulation(model) == [1, 2, 3]


def test_random_data_made_from_constants_is_not_a_parameter():
    """A stateful op (a random or dataset input) reading only constants makes
    data: the network after it must still get candidates."""
    tensors = {0: TensorInfo("shape", 8, constant=True, trainable=False), 1: TensorInfo("w", 8, constant=True)}
    ops = [OpInfo("random", "RandomStandardNormal", (0,), (2,), copyable=False)]
    tensors[2] = TensorInfo("x", 64, 0)
    prev = 2
    for d in range(6):
        out = len(tensors)
        tensors[out] = TensorInfo(f"h{d}", 64, len(ops))
        ops.append(OpInfo(f"matmul{d}", "MatMul", (prev, 1), (out,), grad_reads=(prev, 1)))
        prev = out
    model = GraphModel(ops, tensors, xs=[1], ys=[prev])
    assert 0 not in parameters.parameter_ops(model)
    assert candidates.memory_candidates(model), "the layers after the random input are candidates"


def _closest_cuts(model, cuts, count):
    """sqrtn_sets' choice restated: for each of ``count`` evenly spaced byte
    targets, the first cut after the last chosen one of the smallest
    distance to the target; then the last cut."""
    total = model.activation_bytes() or 1
    chosen, start = [], 0
    for j in range(1, count + 1):
        if start >= len(cuts):
            break
        target = total * j / (count + 1)
        distances = [abs(cuts[k][1] - target) for k in range(start, len(cuts))]
        best = start + distances.index(min(distances))
        chosen.append(best)
        start = best + 1
    chosen.append(len(cuts) - 1)
    return sorted({i for k in chosen for i in cuts[k][0]})


def test_sqrtn_sets_picks_the_first_closest_cut_to_each_target():
    """Byte positions with repeats (ties between equal cuts) and uneven
    gaps; every count from one to all cuts."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        model = chain_model(list(rng.integers(100, 1000, 40)))
        positions = np.sort(rng.choice(np.arange(0, model.activation_bytes(), 50), 30))
        positions[5:8] = positions[5]  # three cuts at one position
        cuts = [([k], int(at)) for k, at in enumerate(positions)]
        for count in range(1, len(cuts) + 1):
            assert candidates.sqrtn_sets(model, cuts, count) == _closest_cuts(model, cuts, count), (trial, count)
