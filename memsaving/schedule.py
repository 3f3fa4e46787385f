"""Which ops each backward unit recomputes, on the neutral graph model.

The simulator scores these units and :mod:`memsaving.rewrite` emits them (it
receives the closures through the plan), so what is predicted is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Set

from memsaving.graph import GraphModel


@dataclass(frozen=True)
class Unit:
    """One step of the backward pass.

    ``kind`` is ``"output"`` (ops after the last kept tensors, differentiated
    in place), ``"segment"`` (``ops`` copied and differentiated; ``anchor`` is
    the kept op whose gradient starts it) or ``"pass"`` (a kept op that cannot
    be copied, differentiated in place).
    """

    kind: str
    anchor: int
    ops: tuple


def kept_set(model: GraphModel, checkpoint_ops: Iterable[int]) -> Set[int]:
    """Checkpoint producers, non-copyable forward ops and their trainable
    forward inputs' producers: the ops whose outputs the rewrite keeps."""
    kept = {i for i in checkpoint_ops if model.ops[i].forward}
    for i, op in enumerate(model.ops):
        if op.forward and not op.copyable:
            kept.add(i)
            for t in op.inputs:
                info = model.tensors[t]
                if info.trainable and info.producer >= 0 and model.ops[info.producer].forward:
                    kept.add(info.producer)
    return kept


def closure(model: GraphModel, seeds: Iterable[int], kept: Set[int]) -> tuple:
    """Forward ops needed to compute ``seeds`` back to kept tensors, in order."""
    xs = set(model.xs)
    found: Set[int] = set()
    stack = list(seeds)
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        for t in model.ops[i].inputs:
            producer = model.tensors[t].producer
            if producer >= 0 and model.ops[producer].forward and producer not in kept and t not in xs:
                stack.append(producer)
    return tuple(sorted(found))


def backward_units(model: GraphModel, kept: Set[int]) -> List[Unit]:
    """The units in the order the backward pass runs them."""
    xs = set(model.xs)
    inner_ys = [
        model.tensors[y].producer for y in model.ys
        if y not in xs and model.tensors[y].producer >= 0
        and model.ops[model.tensors[y].producer].forward
        and model.tensors[y].producer not in kept
    ]
    units = []
    if inner_ys:
        units.append(Unit("output", -1, closure(model, inner_ys, kept)))
    for i in sorted(kept, reverse=True):
        op = model.ops[i]
        if op.copyable:
            units.append(Unit("segment", i, closure(model, [i], kept)))
        else:
            units.append(Unit("pass", i, (i,)))
    return units
