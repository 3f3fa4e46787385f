"""The rows of remembered blocks of actions, in one set of arrays.

A replay runs the buffer rules over arrays of its actions' reads and writes
(:class:`memsaving.model.buffers.BufferRows`).  The simulator remembers the
actions of backward units per model (:mod:`memsaving.sim.blocks`), and with
them their rows: numbered once, by a table all of them share
(:class:`memsaving.model.buffers.KeyNumbers`), and stored one after the
other in a few arrays.  A plan's rows are then gathered from the arrays by
index, whatever the order of its blocks, in a handful of array operations
rather than a pass over every read and write in Python.

The arrays only grow as blocks are added; their owner keeps the rows of
the blocks still remembered (:meth:`RowStore.keep`) when the rest has
grown large.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any, List, Sequence, Tuple

import numpy as np

from memsaving.model.buffers import Action, BufferRows, KeyNumbers, RowBlock

Span = Tuple[int, int, int, int, int, int]
"""Where a block's rows are: first read row and count, first write row
and count, first action and count."""


class RowStore:
    """Rows of blocks of actions, gathered into the rows of the lists they
    make up.  A block is anything with ``actions`` (a list, while its rows
    are not stored) and a ``span`` (:data:`Span`, None until stored)."""

    def __init__(self):
        self.numbers = KeyNumbers()
        """The buffer numbers of every row stored."""
        self.arrays = [np.zeros((2, 1024), np.int64), np.zeros((4, 1024), np.int64), np.zeros((2, 1024), np.int64)]
        """Reads, writes and actions (as :attr:`memsaving.model.buffers.RowBlock.packed`),
        each block's actions numbered from 0."""
        self.fill = [0, 0, 0]
        """The columns of each array in use."""

    @property
    def actions(self) -> int:
        """The actions whose rows are stored (those of forgotten blocks included)."""
        return self.fill[2]

    def add(self, blocks: Sequence) -> None:
        """Store the rows of ``blocks`` (numbered together) and set their spans."""
        actions: List[Action] = list(chain.from_iterable(map(attrgetter("actions"), blocks)))
        rows = RowBlock(actions, self.numbers)
        counts = np.fromiter(map(len, map(attrgetter("actions"), blocks)), np.int64, len(blocks))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        read_bounds, write_bounds = rows.read_starts[bounds], rows.write_starts[bounds]
        reads, writes, acts = rows.packed
        # each block's actions numbered from its first
        reads[1] -= np.repeat(bounds[:-1], np.diff(read_bounds))
        writes[1] -= np.repeat(bounds[:-1], np.diff(write_bounds))
        first = [self._append(k, part) for k, part in enumerate((reads, writes, acts))]
        spans = zip((read_bounds[:-1] + first[0]).tolist(), np.diff(read_bounds).tolist(),
                    (write_bounds[:-1] + first[1]).tolist(), np.diff(write_bounds).tolist(),
                    (bounds[:-1] + first[2]).tolist(), counts.tolist())
        for block, span in zip(blocks, spans):
            block.span = span

    def _append(self, k: int, part: np.ndarray) -> int:
        """Append ``part`` to array ``k``; return its first column there."""
        start, array = self.fill[k], self.arrays[k]
        if start + part.shape[1] > array.shape[1]:
            grown = np.zeros((array.shape[0], max(2 * array.shape[1], start + part.shape[1])), np.int64)
            grown[:, :start] = array[:, :start]
            self.arrays[k] = array = grown
        array[:, start:start + part.shape[1]] = part
        self.fill[k] = start + part.shape[1]
        return start

    def rows(self, blocks: Sequence) -> BufferRows:
        """The rows of the list of actions that is ``blocks``' (stored) one
        after the other."""
        spans = np.array(list(map(attrgetter("span"), blocks)), np.int64).reshape(-1, 6)
        starts = np.cumsum(spans[:, 5]) - spans[:, 5]  # each block's first action in the list
        reads = self.arrays[0][:, _ranges(spans[:, 0], spans[:, 1])]
        reads[1] += np.repeat(starts, spans[:, 1])
        writes = self.arrays[1][:, _ranges(spans[:, 2], spans[:, 3])]
        writes[1] += np.repeat(starts, spans[:, 3])
        acts = self.arrays[2][:, _ranges(spans[:, 4], spans[:, 5])]
        return BufferRows.packed(reads, writes, acts, self.numbers)

    def keep(self, blocks: Sequence) -> None:
        """Keep only the rows of ``blocks`` (stored), moving their spans."""
        spans = np.array(list(map(attrgetter("span"), blocks)), np.int64).reshape(-1, 6)
        moved: List[Any] = [None, None, None]  # each an array once the loop below has run
        for k, (first, count) in enumerate(((0, 1), (2, 3), (4, 5))):
            kept = self.arrays[k][:, _ranges(spans[:, first], spans[:, count])]
            self.arrays[k] = np.concatenate([kept, np.zeros((kept.shape[0], max(1024, kept.shape[1])), np.int64)],
                                            axis=1)
            self.fill[k] = kept.shape[1]
            moved[k] = np.cumsum(spans[:, count]) - spans[:, count]
        for block, span in zip(blocks, zip(*(part.tolist() for part in (
                moved[0], spans[:, 1], moved[1], spans[:, 3], moved[2], spans[:, 5])))):
            block.span = span


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The columns ``starts[i]`` to ``starts[i] + counts[i]`` (excluded),
    for each ``i`` in turn."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(starts - (ends - counts), counts)
