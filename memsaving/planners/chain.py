"""The chain of candidate cuts, summarised for the budget dynamic programs.

Both the single-level DP (:mod:`memsaving.planners.budget`) and the multi-level one
(:mod:`memsaving.planners.nested`) see the graph as a chain: candidate cuts ordered
from the inputs to the outputs, with prefix sums over the ops between them
(forward cost, bytes their gradients read, gradient and work buffers) from which the
surrogate memory and recomputation of any stretch between two cuts is read
in constant time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from memsaving.model.graph import GraphModel
from memsaving.model.schedule import recomputes_anchor


@dataclass
class Chain:
    positions: List[int]  # op index of each candidate, plus start (-1) and end (n)
    kept: np.ndarray  # bytes kept by each candidate
    cost_prefix: np.ndarray  # cumulative forward cost by op position
    reads_prefix: np.ndarray  # cumulative grad-read bytes by op position
    held: np.ndarray  # per op position: bytes its backward holds besides reads (gradient and work buffers)
    anchor_cost: np.ndarray  # per candidate: cost of its ops a segment does not recompute
    _stretches: Optional[Tuple[np.ndarray, np.ndarray]] = field(default=None, repr=False, compare=False)
    _to: Dict[Tuple[str, int], np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    """:meth:`memory_to` and :meth:`cost_to` by stage: the single-level DP
    is solved for several budgets on one chain, and they do not depend on it."""

    @property
    def size(self) -> int:
        """Number of candidate cuts."""
        return len(self.positions) - 2

    def _span(self, a: int, b: int) -> tuple:
        lo = self.positions[a] + 1
        hi = self.positions[b] if b <= self.size else len(self.held) - 1
        return lo, hi

    def memory(self, a: int, b: int) -> float:
        """Surrogate bytes of backpropagating the stretch after cut ``a`` up
        to cut ``b`` (``b = size + 1``: the end): the forward tensors its
        gradients read plus, for its op whose gradient holds most, two
        buffers of its output's size (incoming and outgoing gradients) and
        its kernels' work buffer.  Cut 0 is the start (the inputs)."""
        lo, hi = self._span(a, b)
        reads = self.reads_prefix[hi + 1] - self.reads_prefix[lo]
        return float(reads + (self.held[lo:hi + 1].max() if hi >= lo else 0.0))

    def memory_to(self, b: int) -> np.ndarray:
        """``memory(a, b)`` for every ``a < b`` at once (vectorised DPs; read only)."""
        key = ("memory", b)
        if key not in self._to:
            self._to[key] = self._memory_to(b)
        return self._to[key]

    def _memory_to(self, b: int) -> np.ndarray:
        starts = np.array(self.positions[:b]) + 1
        _, hi = self._span(0, b)
        reads = self.reads_prefix[hi + 1] - self.reads_prefix[starts]
        if hi < 0:
            return reads
        # most held from each start to hi: a running max from the right
        suffix_max = np.maximum.accumulate(self.held[: hi + 1][::-1])[::-1]
        return reads + np.where(starts <= hi, suffix_max[np.minimum(starts, hi)], 0.0)

    def cost_to(self, b: int) -> np.ndarray:
        """``cost(a, b)`` for every ``a < b`` at once (read only)."""
        key = ("cost", b)
        if key not in self._to:
            self._to[key] = self._cost_to(b)
        return self._to[key]

    def _cost_to(self, b: int) -> np.ndarray:
        starts = np.array(self.positions[:b]) + 1
        _, hi = self._span(0, b)
        return np.maximum(self.cost_prefix[hi + 1] - self.cost_prefix[starts] - self._anchor(b), 0.0)

    def _anchor(self, b: int) -> float:
        return float(self.anchor_cost[b - 1]) if 1 <= b <= self.size else 0.0

    def stretch_tables(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(cost, memory)``: :meth:`cost` and :meth:`memory` of every
        stretch ``(a, b)``, ``a < b``, with stage 0 the inputs and stage
        ``size + 1`` the end (0 elsewhere); computed once per chain, since
        the multi-level DP is solved for many budgets on one chain."""
        if self._stretches is None:
            end = self.size + 1
            cost = np.zeros((end + 1, end + 1))
            memory = np.zeros((end + 1, end + 1))
            for a in range(end + 1):
                for b in range(a + 1, end + 1):
                    cost[a, b] = self.cost(a, b)
                    memory[a, b] = self.memory(a, b)
            self._stretches = (cost, memory)
        return self._stretches

    def peak(self, picked: Sequence[int]) -> float:
        """Surrogate bytes of the plan keeping the candidates ``picked``
        (indices into the candidate list, ascending): the largest, over its
        stretches, of the bytes kept up to the stretch's start plus
        :meth:`memory` of the stretch, the quantity the single-level DP keeps
        within its budget.

        Examples
        --------
        >>> from memsaving.model.graph import chain_model
        >>> model = chain_model([4, 16, 8])
        >>> summary = chain(model, [[0], [1]])
        >>> summary.peak([]) == summary.memory(0, 3)
        True
        """
        stages = [0] + [k + 1 for k in picked] + [self.size + 1]
        kept_before = np.concatenate([[0.0], np.cumsum(self.kept[list(picked)])])
        return float(max(kept_before[s] + self.memory(a, b) for s, (a, b) in enumerate(zip(stages, stages[1:]))))

    def cost(self, a: int, b: int) -> float:
        """Recomputation cost of the stretch after cut ``a`` up to cut ``b``:
        the forward cost of its ops, except cut ``b``'s own (kept) ops."""
        lo, hi = self._span(a, b)
        return max(float(self.cost_prefix[hi + 1] - self.cost_prefix[lo]) - self._anchor(b), 0.0)


def as_cuts(candidates: Sequence[Union[int, Sequence[int]]]) -> List[List[int]]:
    """Candidates as lists of op indices (a single op becomes a one-op cut)."""
    return [[c] if isinstance(c, (int, np.integer)) else list(c) for c in candidates]


def ops_of(cuts: Sequence[Sequence[int]], chosen: Sequence[int]) -> List[int]:
    """The op indices of the chosen cuts."""
    return sorted({i for k in chosen for i in cuts[k]})


def chain(model: GraphModel, cuts: Sequence[Sequence[int]], work_buffers: bool = True) -> Chain:
    """The surrogate chain of ``cuts`` (candidate cuts, inputs to outputs).

    ``work_buffers``: whether a stretch's memory counts the work buffer of
    its op whose gradient holds most.  The simulator counts it, and on
    convolutional networks (a 3x3 Conv2D gradient takes some 32 MiB on CPU)
    it is most of the step's memory above the resident: without it the
    surrogate is optimistic and the single-level DP proposes plans that do
    not fit.  The multi-level DP leaves it out: its search scales the
    surrogate budget over a wide range anyway, and with one buffer that
    large in every stretch, splitting stretches further never lowers the
    surrogate, so it would propose no recursive plan at all.
    """
    n = len(model.ops)
    cost = np.zeros(n + 1)
    reads = np.zeros(n + 1)
    held = np.zeros(n)
    for i, op in enumerate(model.ops):
        fwd = op.forward
        cost[i + 1] = cost[i] + (op.cost if fwd else 0.0)
        reads[i + 1] = reads[i] + (sum(model.tensors[t].nbytes for t in op.grad_reads) if fwd else 0)
        if fwd:
            work = op.work_buffer_bytes if work_buffers else 0
            held[i] = 2 * max([model.tensors[t].nbytes for t in op.outputs] + [0]) + work
    kept = np.array([sum(model.tensors[t].nbytes for i in cut for t in model.ops[i].outputs) for cut in cuts],
                    dtype=float)
    anchor_cost = np.array([sum(model.ops[i].cost for i in cut if not recomputes_anchor(model.ops[i].type))
                            for cut in cuts], dtype=float)
    return Chain([-1] + [max(cut) for cut in cuts] + [n], kept, cost, reads, held, anchor_cost)
