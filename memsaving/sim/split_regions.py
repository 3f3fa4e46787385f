"""Folding split regions into one op each, sized by replaying one piece.

A split region (:mod:`memsaving.model.splitting`) becomes one op of a new
model: its inputs are the region's inputs, its outputs the region's
outputs, and what one piece holds while it runs forward, or while it is
recomputed and differentiated, becomes the op's work buffers, measured by
replaying one piece (:func:`memsaving.model.splitting.piece_model`) with the
simulator's own rules.  The planners then plan the folded model like any
other, and the simulator scores it.
"""

from __future__ import annotations

import heapq
import math  # noqa: F401  (the examples in fold_regions's docstring use it)
from dataclasses import replace
from typing import Dict, Iterable, List, Sequence, Set, Tuple, cast

from memsaving.model.buffers import memory_replay
from memsaving.model.graph import GraphModel, OpInfo, gradient_sinks, receives_gradient
from memsaving.model.splitting import (METADATA_OPS, SPLIT_OP_TYPE, SplitRegion, in_place_weights, piece_bytes,
                                       piece_model, region_tensors)
from memsaving.sim.actions import forward_actions
from memsaving.sim.simulate import simulate


KERNEL_LAUNCH_SECONDS = 5e-6
"""What one more kernel launch costs (a few microseconds on a GPU): a
region in ``k`` pieces launches each of its ops ``k`` times forward, and
recomputes and differentiates each piece (about three launches per op)."""


def piece_figures(model: GraphModel, ops: Sequence[int], rows: int, chunks: int) -> Tuple[int, int]:
    """What the region holds while it runs, beyond its inputs and its
    put-together outputs: ``(forward, backward)`` bytes.

    Forward: one piece run alone (each of its tensors freed after its last
    reader in the piece), plus the pieces of the outputs made before it,
    held until they are put together.  Backward: one piece recomputed and
    differentiated (the plain backprop of :func:`piece_model`), plus the
    running sums of the whole inputs' gradients and the pieces of the row
    inputs' gradients held until they are put together."""
    piece = piece_model(model, ops, rows, chunks)
    actions = forward_actions(piece)
    outputs = {("f", t) for t in piece.ys}
    _, forward_peak = memory_replay(actions, outputs)
    row_in, whole_in, outputs_ids = region_tensors(model, ops, rows)
    held_outputs = sum(piece_bytes(model, t, rows, chunks) for t in outputs_ids) * (chunks - 1)
    sinks = gradient_sinks(model)
    backward_peak = simulate(piece).peak_bytes
    sums = sum(model.tensors[t].gradient_bytes for t in whole_in if receives_gradient(model, t, sinks))
    row_gradients = sum(model.tensors[t].gradient_bytes for t in row_in if receives_gradient(model, t, sinks))
    return forward_peak + held_outputs, backward_peak + sums + row_gradients


def fold_regions(model: GraphModel, regions: Iterable[Tuple[Sequence[int], int, int]]) -> GraphModel:
    """``model`` with each region ``(ops, rows, chunks)`` folded into one op
    (module docstring); the regions must not share ops.

    Examples
    --------
    A row-wise chain whose middle op makes a large tensor, folded into 4
    pieces: the folded op holds a quarter of it at a time.

    >>> from memsaving.model.graph import GraphModel, OpInfo, TensorInfo
    >>> shapes = {0: (8, 4), 1: (8, 64), 2: (8, 4), 3: (1,)}
    >>> tensors = {t: TensorInfo(f"t{t}", 4 * math.prod(s), t - 1, shape=s) for t, s in shapes.items()}
    >>> rule = ((8, (0,)),)
    >>> ops = [OpInfo("wide", "Op", (0,), (1,), grad_reads=(0,), row_splits=rule),
    ...        OpInfo("narrow", "Op", (1,), (2,), grad_reads=(1,), row_splits=rule),
    ...        OpInfo("loss", "Sum", (2,), (3,))]
    >>> model = GraphModel(ops, tensors, xs=[0], ys=[3])
    >>> folded = fold_regions(model, [((0, 1), 8, 4)])
    >>> [op.name for op in folded.ops], folded.ops[0].temp_bytes < tensors[1].nbytes
    (['split/wide', 'loss'], True)
    """
    regions = list(regions)
    if not regions:
        return model
    taken: Dict[int, int] = {}
    for r, (ops, _, _) in enumerate(regions):
        for i in ops:
            if i in taken:
                raise ValueError(f"op {model.ops[i].name} is in two split regions")
            taken[i] = r
    folded_ops: Dict[int, OpInfo] = {}
    splits = []
    for r, (ops, rows, chunks) in enumerate(regions):
        ops = tuple(sorted(ops))
        op, region = _folded_op(model, ops, rows, chunks)
        folded_ops[r] = op
        splits.append(region)
    internal = {t for r, (ops, _, _) in enumerate(regions) for i in ops for t in model.ops[i].outputs
                if t not in folded_ops[r].outputs}
    # shape readers of the tensors folded away read a constant instead
    dropped = {i for i, op in enumerate(model.ops)
               if i not in taken and op.type in METADATA_OPS and not internal.isdisjoint(op.inputs)}
    order = _order_with_folds(model, taken, dropped)
    new_ops: List[OpInfo] = []
    new_index: Dict[object, int] = {}
    for item in order:
        new_index[item] = len(new_ops)
        new_ops.append(folded_ops[item[1]] if item[0] == "region" else model.ops[item[1]])
    tensors = {}
    for t, info in model.tensors.items():
        if t in internal:
            continue
        producer = info.producer
        if producer in dropped:
            tensors[t] = replace(info, producer=-1, constant=True)
            continue
        if producer >= 0:
            producer = new_index[("region", taken[producer])] if producer in taken else new_index[("op", producer)]
        tensors[t] = replace(info, producer=producer)
    return GraphModel(new_ops, tensors, list(model.xs), list(model.ys), model.resident_bytes,
                      separate_result_kernels=model.separate_result_kernels,
                      ready_gradients_early=model.ready_gradients_early, profile=model.profile,
                      splits=tuple(model.splits) + tuple(splits), unfolded=model.unfolded or model)


def _folded_op(model: GraphModel, ops: Tuple[int, ...], rows: int, chunks: int) -> Tuple[OpInfo, SplitRegion]:
    """The op region ``ops`` is folded into, and its :class:`SplitRegion`."""
    row_in, whole_in, outputs = region_tensors(model, ops, rows)
    forward_bytes, backward_bytes = piece_figures(model, ops, rows, chunks)
    members = [model.ops[i] for i in ops]
    largest = max(ops, key=lambda i: (sum(model.tensors[t].nbytes for t in model.ops[i].outputs), -i))
    name = f"split/{model.ops[largest].name}"
    inputs = tuple(dict.fromkeys(row_in + whole_in))
    launches = KERNEL_LAUNCH_SECONDS * len(members) * (chunks - 1)
    timed = all(op.seconds is not None for op in members)
    grad_timed = timed and all(op.grad_seconds is not None for op in members if op.forward)
    op = OpInfo(
        name=name, type=SPLIT_OP_TYPE, inputs=inputs, outputs=tuple(outputs),
        forward=any(op.forward for op in members), copyable=True,
        # every piece is recomputed from the region's inputs, whatever their kind
        grad_reads=tuple(t for t in inputs if model.tensors[t].producer >= 0),
        cost=sum(op.cost for op in members), temp_bytes=forward_bytes, grad_temp_bytes=backward_bytes,
        # measured times of the whole ops, plus a launch per op and piece (timed: no op's seconds is None)
        seconds=sum(cast(float, op.seconds) for op in members) + launches if timed else None,
        grad_seconds=(sum(op.grad_seconds or 0.0 for op in members) + sum(cast(float, op.seconds) for op in members)
                      + 3 * launches if grad_timed else None),
        chunks=chunks)
    names = lambda ids: tuple(model.tensors[t].name for t in ids)  # noqa: E731
    in_place = tuple((model.tensors[t].name, blocks)
                     for t, blocks in in_place_weights(model, ops, rows, chunks).items())
    region = SplitRegion(name, tuple(op.name for op in members), rows, chunks, names(row_in), names(whole_in),
                         names(outputs), forward_bytes, backward_bytes, in_place)
    return op, region


def _order_with_folds(model: GraphModel, taken: Dict[int, int], dropped: Set[int]) -> List[Tuple[str, int]]:
    """A topological order of the model's ops outside regions (but the
    ``dropped`` ones) and of the folded regions (``("op", i)`` /
    ``("region", r)``), as close to the model's order as the folds allow
    (Kahn's algorithm, earliest first)."""
    def node(i: int) -> Tuple[str, int]:
        return ("region", taken[i]) if i in taken else ("op", i)

    first: Dict[Tuple[str, int], int] = {}
    predecessors: Dict[Tuple[str, int], Set[Tuple[str, int]]] = {}
    for i, op in enumerate(model.ops):
        if i in dropped:
            continue
        here = node(i)
        first.setdefault(here, i)
        needs = predecessors.setdefault(here, set())
        for t in op.inputs:
            p = model.tensors[t].producer
            if p >= 0 and p not in dropped and node(p) != here:
                needs.add(node(p))
    successors: Dict[Tuple[str, int], List[Tuple[str, int]]] = {n: [] for n in predecessors}
    for n, needs in predecessors.items():
        for need in needs:
            successors[need].append(n)
    waiting = {n: len(needs) for n, needs in predecessors.items()}
    ready = [(first[n], n) for n, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for s in successors[n]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (first[s], s))
    if len(order) != len(predecessors):
        raise ValueError("a split region reads one of its own results through an op outside it")
    return order
