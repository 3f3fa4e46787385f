"""Which ops each backward unit recomputes, on the neutral graph model.

The simulator scores these units and :mod:`memsaving.tf.rewrite` emits them (it
receives the closures through the plan), so what is predicted is what runs.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from enum import Enum
from typing import AbstractSet, Any, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple, Union

from memsaving.model.graph import GraphModel
from memsaving.model.splitting import SPLIT_OP_TYPE


class UnitKind(str, Enum):
    """What a backward unit does with its ops.

    A ``str`` enum, so plans and timelines print and compare it as the plain
    word (``UnitKind.SEGMENT == "segment"``).
    """

    OUTPUT = "output"
    """The ops after the last kept tensors, differentiated in place."""
    SEGMENT = "segment"
    """``ops`` copied and differentiated; ``anchor`` is the kept op whose
    gradient starts it."""
    PASS = "pass"
    """A kept op that cannot be copied, differentiated in place."""
    ADVANCE = "advance"
    """Multi-level recomputation: ``ops`` are recomputed, not differentiated,
    to rebuild the inner checkpoints of ``anchor``'s segment; the units that
    follow read those copies."""
    INPLACE = "inplace"
    """A kept op whose inputs are all kept: differentiated where it is,
    nothing recomputed."""

    def __str__(self) -> str:
        return self.value


RECOMPUTING = frozenset({UnitKind.SEGMENT, UnitKind.ADVANCE})
"""The unit kinds that copy (recompute) their ops."""


@dataclass(frozen=True)
class Unit:
    """One step of the backward pass: ``kind`` (:class:`UnitKind`) says what
    it does with ``ops``; ``anchor`` is the kept op it starts from (-1 for
    the output unit)."""

    kind: UnitKind
    anchor: int
    ops: tuple


def kept_set(model: GraphModel, checkpoint_ops: Iterable[int]) -> Set[int]:
    """Checkpoint producers, non-copyable forward ops and their trainable
    forward inputs' producers, and forward producers of ``xs``: the ops whose
    outputs the rewrite keeps.

    An ``x`` computed by a forward op (``xs`` naming an intermediate tensor
    and something upstream of it) ends every segment, like a checkpoint, so
    its gradient is complete when it is read; its producer must then anchor
    a unit of its own, or the gradient would stop at ``x`` instead of flowing
    on to what lies before it, as it does in ``tf.gradients``.
    """
    kept = {i for i in checkpoint_ops if model.ops[i].forward} | model.derived(
        "always kept", lambda: _always_kept(model))
    return _regions_before_the_output_kept(model, kept)


def _regions_before_the_output_kept(model: GraphModel, kept: Set[int]) -> Set[int]:
    """``kept`` and every split region the output unit would take in.

    The output unit differentiates the forward ops themselves, in place;
    a split region's forward ops never run whole (its pieces do), so it
    must end the output unit: it is kept, and differentiated piece by piece
    in a unit of its own."""
    regions = model.derived("split region ops", lambda: frozenset(
        i for i, op in enumerate(model.ops) if op.type == SPLIT_OP_TYPE))
    if not regions:
        return kept
    feeders = model.derived("forward feeders", lambda: _forward_feeders(model))
    while True:
        ys = [model.tensors[y].producer for y in model.ys
              if model.tensors[y].producer >= 0 and model.tensors[y].producer not in kept]
        inside = regions.intersection(_closure(feeders, ys, kept)) if ys else ()
        if not inside:
            return kept
        kept = kept | set(inside)


def _always_kept(model: GraphModel) -> FrozenSet[int]:
    """The ops :func:`kept_set` keeps whatever the checkpoints: forward
    producers of ``xs``, non-copyable forward ops and the forward producers
    of their trainable inputs."""
    kept = set()
    for x in model.xs:
        producer = model.tensors[x].producer
        if producer >= 0 and model.ops[producer].forward:
            kept.add(producer)
    for i, op in enumerate(model.ops):
        if op.forward and not op.copyable:
            kept.add(i)
            for t in op.inputs:
                info = model.tensors[t]
                if info.trainable and info.producer >= 0 and model.ops[info.producer].forward:
                    kept.add(info.producer)
    return frozenset(kept)


def closure(model: GraphModel, seeds: Iterable[int], kept: Set[int]) -> tuple:
    """Forward ops needed to compute ``seeds`` back to kept tensors, in order."""
    return _closure(model.derived("forward feeders", lambda: _forward_feeders(model)), seeds, kept)


def _closure(feeders: List[Tuple[int, ...]], seeds: Iterable[int], kept: Set[int]) -> tuple:
    """:func:`closure` over the table of :func:`_forward_feeders`."""
    found: Set[int] = set()
    stack = list(seeds)
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        for producer in feeders[i]:
            if producer not in kept:
                stack.append(producer)
    return tuple(sorted(found))


def _forward_feeders(model: GraphModel) -> List[Tuple[int, ...]]:
    """Per op, the forward ops producing its inputs (other than ``xs``): the
    edges :func:`closure` follows back to kept tensors."""
    xs = set(model.xs)
    feeders = []
    for op in model.ops:
        producers = [model.tensors[t].producer for t in op.inputs if t not in xs]
        feeders.append(tuple(p for p in producers if p >= 0 and model.ops[p].forward))
    return feeders


_GRADIENT_REWRITES_FORWARD = frozenset({
    "PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While", "StatelessWhile",
})


def recomputes_anchor(op_type: str) -> bool:
    """Whether a segment must recompute its anchor op as well.

    A segment's anchor is kept, so its gradient can read the kept outputs
    and only the anchor's non-kept inputs need recomputing: the simulator
    scores that and the rewrite differentiates a copy of the anchor, then
    points the gradient ops at the kept outputs, so the copy never runs.
    Function calls and functional control flow are the exception: their
    gradient functions add outputs (intermediates) to the op they
    differentiate, which the kept original does not have.
    """
    return op_type in _GRADIENT_REWRITES_FORWARD


Inner = Dict[int, Tuple[int, ...]]
"""Multi-level plans: segment anchor -> the inner checkpoints its backward
recomputes first and holds while the sub-segments after them are processed."""


def backward_units(model: GraphModel, kept: Set[int], inner: Optional[Inner] = None,
                   inplace: bool = False) -> List[Unit]:
    """The units in the order the backward pass runs them.

    With ``inner``, the segment of anchor ``a`` becomes: an ``advance`` unit
    recomputing ``inner[a]`` from the kept tensors, then the sub-segments
    ``a``, ``inner[a][-1]``, ..., ``inner[a][0]`` (each possibly with inner
    checkpoints of its own), whose closures stop at the inner checkpoints:
    Revolve-style recursive checkpointing.

    With ``inplace``, a kept op whose inputs are all kept is differentiated
    where it is (reading its kept outputs) instead of recomputed; swap plans
    use it, so that keeping and swapping every tensor recomputes nothing.
    """
    inner = inner or {}
    if not isinstance(kept, abc.Set):
        kept = set(kept)
    xs = set(model.xs)
    inner_ys = [
        model.tensors[y].producer for y in model.ys
        if y not in xs and model.tensors[y].producer >= 0
        and model.ops[model.tensors[y].producer].forward
        and model.tensors[y].producer not in kept
    ]
    feeders = model.derived("forward feeders", lambda: _forward_feeders(model))
    passes = model.derived("pass units", dict)  # the same in every plan
    segments = model.derived("segments", lambda: _Segments(len(model.ops)))
    units = []
    if inner_ys:
        units.append(Unit(UnitKind.OUTPUT, -1, _closure(feeders, inner_ys, kept)))
    ops = model.ops
    for i in sorted(kept, reverse=True):
        if not ops[i].copyable:
            if i not in passes:
                passes[i] = Unit(UnitKind.PASS, i, (i,))
            units.append(passes[i])
        elif inner.get(i):
            units.extend(_segment_units(i, kept, inner, inplace, feeders, segments))
        else:
            units.append(segments.unit(i, kept, inplace, feeders))
    return units


def plain_units(model: GraphModel) -> List[Unit]:
    """The backward pass of plain ``tf.gradients``: one unit differentiating
    every forward op in place, nothing recomputed.

    :func:`backward_units` with no checkpoints is not that: ops that cannot
    be recomputed (stateful calls, random draws) are always kept, so the
    ops between them become segments, as the rewrite runs them.  Plain
    backprop holds every activation its gradient reads instead; on a net
    with a stateful call in each block (Keras' grouped convolutions) that
    is several times what the segments hold.

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> [(unit.kind.value, unit.ops) for unit in plain_units(chain_model([4, 4, 4]))]
    [('output', (0, 1, 2))]
    """
    feeders = model.derived("forward feeders", lambda: _forward_feeders(model))
    xs = set(model.xs)
    ys = [model.tensors[y].producer for y in model.ys
          if y not in xs and model.tensors[y].producer >= 0 and model.ops[model.tensors[y].producer].forward]
    return [Unit(UnitKind.OUTPUT, -1, _closure(feeders, ys, set()))] if ys else []


def _segment_units(anchor: int, kept: Set[int], inner: Inner, inplace: bool, feeders: List[Tuple[int, ...]],
                   segments: "_Segments") -> List[Unit]:
    """The units of ``anchor``'s segment: the segment, or with inner
    checkpoints the advance unit and the sub-segments (``feeders``: the
    table :func:`closure` follows; ``segments``: the model's remembered
    segments)."""
    if not inner.get(anchor):
        return [segments.unit(anchor, kept, inplace, feeders)]
    inside = tuple(sorted(inner[anchor]))
    deeper = kept | set(inside)
    units = [Unit(UnitKind.ADVANCE, anchor, _closure(feeders, inside, kept)),
             Unit(UnitKind.SEGMENT, anchor, _closure(feeders, [anchor], deeper))]
    for sub in reversed(inside):
        units.extend(_segment_units(sub, deeper, inner, False, feeders, segments))
    return units


class _Segment:
    """An anchor's segment (:func:`closure` from the anchor) for some kept
    set, and what decides whether it is the segment for another: the ops
    it recomputes besides the anchor (``inside``) and the kept ops feeding
    them (``boundary``).  For a kept set that has no op of ``inside`` and
    every op of ``boundary``, the closure follows the same edges and stops
    at the same ops: it is the same segment."""

    __slots__ = ("anchor", "ops", "inside", "boundary", "segment", "inplace")

    def __init__(self, anchor: int, kept: AbstractSet[int], feeders: List[Tuple[int, ...]]):
        # the traversal of _closure from the anchor, noting where it stops
        found, boundary, stack = {anchor}, [], [anchor]
        while stack:
            for producer in feeders[stack.pop()]:
                if producer in kept:
                    boundary.append(producer)
                elif producer not in found:
                    found.add(producer)
                    stack.append(producer)
        self.anchor, self.ops = anchor, tuple(sorted(found))
        found.discard(anchor)
        self.inside, self.boundary = found, boundary
        self.segment: Optional[Unit] = None
        """Its segment unit, made once (the same object, plan after plan)."""
        self.inplace: Optional[Unit] = None
        """Its inplace unit, made once."""

    def fits(self, kept: Union[Set[int], FrozenSet[int]]) -> bool:
        """Whether it is the anchor's segment when ``kept`` ops are kept."""
        return kept.isdisjoint(self.inside) and kept.issuperset(self.boundary)

    def unit(self, kind: UnitKind) -> Unit:
        """The unit of ``kind`` (segment or inplace) on these ops."""
        if kind is UnitKind.SEGMENT:
            if self.segment is None:
                self.segment = Unit(kind, self.anchor, self.ops)
            return self.segment
        if self.inplace is None:
            self.inplace = Unit(kind, self.anchor, self.ops)
        return self.inplace


class _Segments:
    """Each anchor's last segment (:class:`_Segment`), so that the plans
    that keep the same ops around an anchor (the neighbours a planner
    tries one after the other) follow its closure once and have the same
    unit.  An anchor seen once gets none (the first plans of a search
    share few segments).  At most about :data:`_SEGMENT_OPS_PER_OP` ops of
    segments per op of the model are kept: past that, all are forgotten."""

    def __init__(self, op_count: int):
        self.limit = _SEGMENT_OPS_PER_OP * max(op_count, 1)
        self.found: Dict[int, Optional[_Segment]] = {}
        """Each anchor's last segment, or None when seen once."""
        self.size = 0

    def unit(self, anchor: int, kept: Set[int], inplace: bool, feeders: List[Tuple[int, ...]]) -> Unit:
        """``anchor``'s unit when ``kept`` ops are kept: an inplace unit when
        ``inplace`` and every input is kept, else a segment."""
        segment = self.found.get(anchor, _UNSEEN)
        if segment is _UNSEEN:
            self.found[anchor] = None
            ops = _closure(feeders, [anchor], kept)
            return Unit(_segment_kind(inplace, ops, anchor), anchor, ops)
        if segment is None or not segment.fits(kept):
            if segment is not None:
                self.size -= len(segment.ops) + len(segment.boundary)
            if self.size > self.limit:
                self.found.clear()
                self.size = 0
            segment = self.found[anchor] = _Segment(anchor, kept, feeders)
            self.size += len(segment.ops) + len(segment.boundary)
        return segment.unit(_segment_kind(inplace, segment.ops, anchor))


def _segment_kind(inplace: bool, ops: tuple, anchor: int) -> UnitKind:
    """Inplace when asked for and every input of the anchor is kept (it is
    differentiated where it is, reading its kept outputs, rather than
    recomputed), else a segment."""
    return UnitKind.INPLACE if inplace and ops == (anchor,) else UnitKind.SEGMENT


_UNSEEN: Any = object()  # a sentinel, compared by identity (Any: found.get(anchor, _UNSEEN) stays a segment)

_SEGMENT_OPS_PER_OP = 16
"""Ops (and the kept ops where they stop) of the segments remembered, per
op of the model."""


def validate_inner(model: GraphModel, kept: Set[int], inner: Inner) -> None:
    """Raise ValueError unless every inner checkpoint lies inside its anchor's
    segment, is copyable, has an output gradients flow through, and belongs
    to one anchor only: the sub-segment of an op listed for several anchors
    would run once per anchor, each time passing on the gradient summed so
    far, so the ops before it would get some contributions twice."""
    def check(anchor: int, context: Set[int]):
        inside = inner.get(anchor, ())
        if not inside:
            return
        segment = set(closure(model, [anchor], context))
        for i in inside:
            op = model.ops[i]
            if i == anchor or i not in segment:
                raise ValueError(f"inner checkpoint {op.name} is not inside the segment of {model.ops[anchor].name}")
            if not op.copyable or not any(model.tensors[t].trainable for t in op.outputs):
                raise ValueError(f"inner checkpoint {op.name} cannot be recomputed or carries no gradient")
        deeper = context | set(inside)
        for sub in inside:
            check(sub, deeper)

    owner: Dict[int, int] = {}
    for anchor, inside in inner.items():
        for i in inside:
            if owner.setdefault(i, anchor) != anchor:
                raise ValueError(f"inner checkpoint {model.ops[i].name} is given to two anchors, "
                                 f"{model.ops[owner[i]].name} and {model.ops[anchor].name}: give it to one")
    unknown = set(inner) - set().union(kept, *[set(v) for v in inner.values()])
    if unknown:
        raise ValueError(f"inner checkpoints given for ops that anchor no segment: {sorted(unknown)}")
    for i in kept:
        if model.ops[i].copyable:
            check(i, kept)
