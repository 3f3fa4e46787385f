"""Split regions: runs of ops computed in pieces along their rows (no TensorFlow).

Recomputing and swapping cannot take a step below the memory of its largest
operation: a language model's logits and the softmax gradient beside them,
the first convolutions of a high-resolution net.  Many such operations
compute each *row* of their outputs (an example of the batch, a token) from
the same row of their inputs and from weights read whole.  A run of them,
a *split region*, can then be computed in ``k`` pieces one after the other,
forward and backward, with one piece's tensors alive at a time (TSPLIT, Nie
et al.).  The region's results are the pieces' results put back together
(concatenated rows); the gradients of the weights are summed over the
pieces, those of row inputs concatenated.

Here a region is found on the neutral model, from the rows each op can be
cut along (:attr:`~memsaving.model.graph.OpInfo.row_splits`, which the
extractor fills when asked), and one piece of it is made a model of its
own (:func:`piece_model`); :mod:`memsaving.sim.split_regions` folds each
region into one op of a new model, sized by replaying that piece.  The
folded op's gradient recomputes the pieces (it is never kept past its
region as a whole: its gradient already recomputes it piece by piece), so
the backward costs its forward once more.  The planners then plan the
folded model like any other, and the simulator scores it: a split plan is
judged by the same rules as every other plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import AbstractSet, Dict, List, Optional, Sequence, Set, Tuple, cast

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, gradient_sinks, receives_gradient

FIXED_WORK_BUFFERS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput"})
"""Ops whose kernels' work buffers do not shrink with the batch (the CPU's
3x3 convolution gradient takes about 32 MiB at any size): a piece of them
is sized with the whole op's."""

SPLIT_OP_TYPE = "SplitRegion"
"""The type of the op a split region is folded into."""
METADATA_OPS = frozenset({"Shape", "Size", "Rank"})
"""Ops that read only a tensor's static shape: a region's tensor they read
need not be put together, since its shape is known (the emitter gives
their readers the constant instead)."""


@dataclass(frozen=True)
class SplitRegion:
    """A run of ops computed in ``chunks`` pieces of rows.

    Attributes
    ----------
    name
        the name of the op the region is folded into (``"split/"`` and
        the name of the region's largest op).
    ops
        names of the region's ops, in the model's order.
    rows
        how many rows every row tensor of the region has (the product of
        its first dimensions): the batch, or batch times sequence for
        token-wise ops.
    chunks
        pieces the rows are cut into (the last ones one row smaller when
        ``chunks`` does not divide ``rows``).
    row_inputs
        names of the inputs cut into pieces of rows.
    whole_inputs
        names of the inputs every piece reads whole (weights).
    outputs
        names of the region's tensors read after it (or results of the
        step): each is put back together from its pieces.
    forward_bytes, backward_bytes
        what one piece holds at most while it runs forward, and while it
        is recomputed and differentiated (the folded op's work buffers).
    in_place
        ``(whole input, blocks)`` for each weight whose gradient is
        accumulated in place (:func:`in_place_weights`): the emitter makes
        it in that many blocks, as the piece model was scored.
    """

    name: str
    ops: Tuple[str, ...]
    rows: int
    chunks: int
    row_inputs: Tuple[str, ...]
    whole_inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    forward_bytes: int = 0
    backward_bytes: int = 0
    in_place: Tuple[Tuple[str, int], ...] = ()


def row_dims(shape: Optional[Sequence[int]], rows: int) -> Optional[int]:
    """How many leading dimensions of ``shape`` hold ``rows`` rows (their
    sizes multiply to ``rows``), or None when none do.

    Examples
    --------
    >>> row_dims((8, 256, 512), 2048), row_dims((2048, 512), 2048), row_dims((8, 256), 16)
    (2, 1, None)
    """
    if shape is None:
        return None
    product = 1
    for k, size in enumerate(shape):
        product *= size
        if product == rows:
            return k + 1
        if product > rows:
            return None
    return None


def row_positions(op: OpInfo, rows: int) -> Optional[Tuple[int, ...]]:
    """The positions of ``op``'s inputs that carry rows when it is cut into
    ``rows`` rows, or None when it cannot be."""
    for count, positions in op.row_splits:
        if count == rows:
            return positions
    return None


def _splittable(model: GraphModel, i: int, rows: int) -> bool:
    """Op ``i`` can be part of a region of ``rows`` rows: it has a rule for
    them, can be run again (its pieces are), and every output has them."""
    op = model.ops[i]
    return (op.copyable and row_positions(op, rows) is not None and op.type != SPLIT_OP_TYPE
            and all(row_dims(model.tensors[t].shape, rows) is not None and t not in model.xs for t in op.outputs))


def grow_region(model: GraphModel, seed: int, rows: int, upstream: bool = True,
                fences: AbstractSet[int] = frozenset()) -> Optional[Tuple[int, ...]]:
    """The ops of the region of ``rows`` rows around op ``seed``, in order,
    or None when ``seed`` cannot be split so.

    The region does not grow past a tensor of ``fences``: it may make one
    (it is then one of its outputs) or read one (one of its inputs), not
    both; fences keep a region from running on into the next block of a
    network (:func:`memsaving.planners.splits.region_choices` fences it
    at the small tensors every path crosses).

    From the seed the region takes in every consumer that reads one of its
    tensors as a row input and can be cut into the same rows (towards the
    loss, whose per-row terms are small), and, with ``upstream``, every
    producer of a row input all of whose readers are in the region already
    (so none of its results must be put back together for someone else).
    Ops that make one of ``ys`` stay out (a result must be the tensor the
    caller holds), and so does anything that would make the region read
    one of its own results through an op outside it.
    """
    if not _splittable(model, seed, rows):
        return None
    ys = set(model.ys)
    region: Set[int] = {seed}
    changed = True
    while changed:
        changed = False
        for i in sorted(region):
            op = model.ops[i]
            for t in op.outputs:  # downstream
                if t in fences:
                    continue
                for c in model.consumers(t):
                    if c in region or not _splittable(model, c, rows):
                        continue
                    positions = cast(Tuple[int, ...], row_positions(model.ops[c], rows))  # c is splittable
                    if any(model.ops[c].inputs[k] == t for k in positions) and not _reads_whole(model, c, t, rows):
                        if not ys.intersection(model.ops[c].outputs):
                            region.add(c)
                            changed = True
            if not upstream:
                continue
            for k in cast(Tuple[int, ...], row_positions(op, rows)):  # upstream (the region's ops are splittable)
                if op.inputs[k] in fences:
                    continue
                p = model.tensors[op.inputs[k]].producer
                if p < 0 or p in region or not _splittable(model, p, rows) or ys.intersection(model.ops[p].outputs):
                    continue
                readers = {c for t in model.ops[p].outputs for c in model.consumers(t)
                           if model.ops[c].type not in METADATA_OPS}
                if readers <= region and all(not _reads_whole(model, c, t, rows)
                                             for t in model.ops[p].outputs for c in model.consumers(t)):
                    region.add(p)
                    changed = True
    convex = _convex(model, region, seed)
    if convex is None:
        # the seed reads, through an op outside, a result of an op taken in
        # upstream: the region of the seed and what follows it cannot
        return grow_region(model, seed, rows, upstream=False, fences=fences) if upstream else None
    return tuple(sorted(convex))


def _reads_whole(model: GraphModel, i: int, t: int, rows: int) -> bool:
    """Op ``i`` reads tensor ``t`` at a position that is not a row input
    (it would need the whole tensor, which no piece has)."""
    positions = row_positions(model.ops[i], rows) or ()
    return any(u == t and k not in positions for k, u in enumerate(model.ops[i].inputs))


def _convex(model: GraphModel, region: Set[int], seed: int) -> Optional[Set[int]]:
    """``region`` less the ops that read a result of the region through an
    op outside it (a region is folded into one op, which cannot wait for
    its own result); None when the seed itself does."""
    while True:
        after: Set[int] = set()  # ops outside the region that depend on it
        bad: Set[int] = set()
        for i in range(min(region), len(model.ops)):
            feeders = {model.tensors[t].producer for t in model.ops[i].inputs}
            if i in region:
                if not feeders.isdisjoint(after):
                    bad.add(i)
            elif not feeders.isdisjoint(region) or not feeders.isdisjoint(after):
                after.add(i)
        if not bad:
            return region
        if seed in bad:
            return None
        region = region - bad


def region_tensors(model: GraphModel, ops: Sequence[int], rows: int) -> Tuple[List[int], List[int], List[int]]:
    """The region's row inputs, whole inputs and outputs (tensor ids).

    An output is a tensor made inside that an op outside reads, or one of
    ``ys``; an input read at a row position by one op and whole by another
    is both a row input and a whole input."""
    members = set(ops)
    ys = set(model.ys)
    row_in: Dict[int, None] = {}
    whole_in: Dict[int, None] = {}
    outputs: Dict[int, None] = {}
    for i in ops:
        op = model.ops[i]
        positions = cast(Tuple[int, ...], row_positions(op, rows))  # a region's ops are splittable
        for k, t in enumerate(op.inputs):
            if model.tensors[t].producer in members:
                continue
            (row_in if k in positions else whole_in)[t] = None
        for t in op.outputs:
            if t in ys or any(c not in members and model.ops[c].type not in METADATA_OPS
                              for c in model.consumers(t)):
                outputs[t] = None
    return list(row_in), list(whole_in), list(outputs)


IN_PLACE_PRODUCTS = frozenset({"MatMul"})
"""Ops whose weight (second input, a matrix) gets its gradient accumulated
in place, block by block (:func:`in_place_weights`)."""


MAX_GRADIENT_BLOCKS = 16
"""The most blocks a weight's gradient is made in per piece
(:func:`gradient_blocks`).  Smaller blocks would save at most 1/16 of the
weight (the buffer they add into holds all of it anyway), and each block is
a few more ops for every piece: sized to a piece alone, the blocks grew as
the pieces shrank, so a region's block ops grew with the square of its
pieces (8 rows in 8 pieces: one block per weight row and piece, and a
step with 1024-wide weights took 42 s to trace, 4 times as long as in 4
pieces)."""


def gradient_blocks(weight_rows: int, weight_bytes: int, piece_largest_bytes: int) -> int:
    """How many blocks of rows a weight's gradient, accumulated in place, is
    made in for each piece: enough that a block is no larger than the
    piece's largest tensor (a block then adds no more than what the piece
    holds anyway), but at most one per row and at most
    :data:`MAX_GRADIENT_BLOCKS`.  Blocks are kept as few as that allows:
    each is a few kernels per piece, and every kernel a function runs holds
    a little memory of its own for as long as the function lives.

    Examples
    --------
    A 256 x 32,000 head (31.25 MiB) after a piece of 32 tokens (4 MiB of
    logits), and a 1024 x 256 product in the same piece:

    >>> gradient_blocks(256, 256 * 32000 * 4, 32 * 32000 * 4), gradient_blocks(1024, 1024 * 256 * 4, 32 * 32000 * 4)
    (8, 1)

    The head after a piece of one token: 16 blocks of 2 MiB, not 256 of
    one row each:

    >>> gradient_blocks(256, 256 * 32000 * 4, 32000 * 4)
    16
    """
    fitting = -(-weight_bytes // max(piece_largest_bytes, 1))
    return max(1, min(weight_rows, fitting, MAX_GRADIENT_BLOCKS))


def in_place_weights(model: GraphModel, ops: Sequence[int], rows: int, chunks: int) -> Dict[int, int]:
    """The region's whole inputs whose gradient is accumulated in place,
    each with its :func:`gradient_blocks`.

    A weight's gradient is a sum over the pieces.  Summed as tensors, the
    running sum and the next piece's term are alive together: twice the
    weight, which for a language model's head is more than everything else
    the piece holds.  A matrix that one product of the region reads as its
    weight (and nothing else in the region reads) has its gradient made
    instead in blocks of rows, each added into one buffer in place, so the
    piece's term is never whole."""
    members = set(ops)
    found: Dict[int, int] = {}
    _, whole_in, _ = region_tensors(model, ops, rows)
    sinks = gradient_sinks(model)
    largest = max((piece_bytes(model, t, rows, chunks) for i in ops for t in model.ops[i].outputs
                   if row_dims(model.tensors[t].shape, rows) is not None), default=0)
    for t in whole_in:
        info = model.tensors[t]
        readers = [i for i in model.consumers(t) if i in members]
        if len(readers) != 1 or info.shape is None or len(info.shape) != 2 or not receives_gradient(model, t, sinks):
            continue
        op = model.ops[readers[0]]
        if op.type not in IN_PLACE_PRODUCTS or op.inputs[1:] != (t,) or op.inputs[0] == t:
            continue
        found[t] = gradient_blocks(info.shape[0], info.gradient_bytes, largest)
    return found


def piece_bytes(model: GraphModel, t: int, rows: int, chunks: int) -> int:
    """Bytes of the largest piece of row tensor ``t``."""
    nbytes = model.tensors[t].nbytes
    return nbytes if rows <= 0 else -(-nbytes * math.ceil(rows / chunks) // rows)


def piece_model(model: GraphModel, ops: Sequence[int], rows: int, chunks: int) -> GraphModel:
    """One piece of the region as a model of its own: its ops on the
    largest piece of rows, its inputs resident, its outputs the results.

    Work buffers are taken to shrink with the rows, as a product's or a
    softmax's do, except those of :data:`FIXED_WORK_BUFFERS` (a
    convolution's work buffer hardly shrinks with the batch), which stay as
    measured for the whole tensors.  A weight whose gradient is accumulated
    in place (:func:`in_place_weights`) gets a gradient of one block: the
    piece's term is made a block at a time."""
    members = set(ops)
    index = {i: k for k, i in enumerate(ops)}
    row_in, whole_in, outputs = region_tensors(model, ops, rows)
    in_place = in_place_weights(model, ops, rows, chunks)
    tensors: Dict[int, TensorInfo] = {}

    def info(t: int) -> TensorInfo:
        base = model.tensors[t]
        producer = index[base.producer] if base.producer in members else -1
        nbytes = base.nbytes
        value = base.value_bytes
        if t in in_place:
            value = -(-base.gradient_bytes // in_place[t])
        elif row_dims(base.shape, rows) is not None:
            nbytes = piece_bytes(model, t, rows, chunks)
            if value is not None:
                value = -(-value * math.ceil(rows / chunks) // rows)
        return replace(base, nbytes=nbytes, producer=producer, value_bytes=value)

    pieces = []
    for i in ops:
        op = model.ops[i]
        for t in op.inputs + op.outputs:
            if t not in tensors:
                tensors[t] = info(t)
        share = 1.0 if op.type in FIXED_WORK_BUFFERS else math.ceil(rows / chunks) / rows
        pieces.append(replace(op, cost=op.cost / chunks, temp_bytes=int(op.temp_bytes * share),
                              grad_temp_bytes=int(op.grad_temp_bytes * share),
                              seconds=None if op.seconds is None else op.seconds / chunks,
                              grad_seconds=None if op.grad_seconds is None else op.grad_seconds / chunks,
                              row_splits=()))
    sinks = gradient_sinks(model)
    xs = [t for t in row_in + whole_in if receives_gradient(model, t, sinks)]
    ys = [t for t in outputs if model.tensors[t].trainable]
    return GraphModel(pieces, tensors, xs, ys or outputs, 0,
                      separate_result_kernels=model.separate_result_kernels)


def footprint(model: GraphModel, i: int) -> int:
    """Bytes op ``i`` holds by itself while it runs, forward or backward:
    its outputs (and as many again for their gradients) and its largest
    work buffer; what a budget must leave room for however the rest of
    the step is planned."""
    op = model.ops[i]
    outputs = sum(model.tensors[t].nbytes for t in op.outputs)
    return 2 * outputs + op.work_buffer_bytes


def largest_splittable_ops(model: GraphModel, count: int = 3) -> List[Tuple[int, int]]:
    """Up to ``count`` ops with the largest :func:`footprint` that can be
    split, each with the largest number of rows it can be cut into:
    ``[(op, rows), ...]``, largest first."""
    found = []
    for i, op in enumerate(model.ops):
        if not op.row_splits or not op.forward:
            continue
        options = [rows for rows, _ in op.row_splits if _splittable(model, i, rows)]
        if options:
            found.append((footprint(model, i), i, max(options)))
    found.sort(key=lambda item: (-item[0], item[1]))
    return [(i, rows) for _, i, rows in found[:count]]
