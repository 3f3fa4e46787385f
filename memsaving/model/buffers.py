"""Buffers and how long they live: the rules every replay of a step follows.

A step is replayed as a list of :class:`Action`: each op run (or copy to or
from the host) with the buffers it reads and the buffers it writes, named by
:data:`Key`.  A buffer lives from the action that writes it to the last
action that reads it, which is how TensorFlow's executor frees memory
(reference counts).  Two reuses of TensorFlow's kernels are followed when an
action asks for them: elementwise kernels write into a dying input's buffer
(:func:`donations`), and weight gradients are made and consumed by kernels
of their own (:func:`consumed_at_once`).  The simulator, the swap timing,
the schedule replays and the custom-gradient sizing in the graph extractor
all use these rules, so a buffer rule is written once.  The rules run over
numpy arrays of the actions' reads and writes (:class:`BufferRows`), since a
replayed step has thousands of actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress, count as itertools_count, repeat
from operator import attrgetter, is_, itemgetter
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

Key = Tuple
"""A buffer's name: its kind (``"f"`` forward output, ``"g"`` gradient,
``"c"``/``"a"`` recomputed copy, ``"w"`` saved by an op for its gradient,
``"h"``/``"s"`` host copy and swapped-in copy) followed by indices."""


@dataclass(slots=True)
class Action:
    """One op run: the buffers it reads and the buffers it creates.

    Slotted: a replay makes thousands of actions and reads their fields in
    its inner loops."""

    label: str
    reads: List[Key]
    writes: List[Tuple[Key, int]]
    cost: float = 0.0  # FLOPs for compute actions, bytes for transfers
    stream: str = "compute"  # or "d2h" / "h2d" (swap-out / swap-in)
    forwards_buffers: bool = False
    """The kernel may write an output into the buffer of an input of the same
    size that no later action reads (:attr:`memsaving.model.graph.OpInfo.forwards_input`)."""
    results: Tuple[Key, ...] = ()
    """Written result gradients made by kernels of their own
    (:attr:`memsaving.model.graph.GraphModel.separate_result_kernels`)."""
    temp: int = 0
    """Bytes the kernel holds only while it runs (work buffers): in use
    during the action on top of its reads and writes, freed at its end."""
    seconds: Optional[float] = None
    """Measured run time; timed replays use it instead of ``cost``."""


def with_reads(action: Action, reads: List[Key]) -> Action:
    """A copy of ``action`` that reads ``reads`` (``dataclasses.replace``
    without its per-call field checks: replays make thousands)."""
    return on_buffers(action, reads, action.writes, action.results)


def on_buffers(kernel: Action, reads: List[Key], writes: List[Tuple[Key, int]],
               results: Tuple[Key, ...] = ()) -> Action:
    """``kernel`` (its label, cost, stream, temporary and time) run on other
    buffers: an op's actions differ from plan to plan only in these, so a
    replay copies what the op's kernel costs from one action made per model.

    Examples
    --------
    >>> kernel = Action("backward dense", [], [], cost=6.0, temp=8)
    >>> run = on_buffers(kernel, [("g", 2, 0)], [(("g", 1, 0), 4)])
    >>> run.label, run.reads, run.writes, run.cost, run.temp
    ('backward dense', [('g', 2, 0)], [(('g', 1, 0), 4)], 6.0, 8)
    """
    return Action(kernel.label, reads, writes, kernel.cost, kernel.stream, kernel.forwards_buffers,
                  results, kernel.temp, kernel.seconds)


def donations(actions: Sequence[Action], last_read: Dict[Key, int], pinned: Set[Key] = frozenset(),
              last_end: Optional[Dict[Key, float]] = None,
              finished: Optional[Sequence[float]] = None,
              size: Optional[Dict[Key, int]] = None) -> Dict[Tuple[int, Key], Key]:
    """Buffers handed over in place: ``(action index, written key) -> read
    key`` whose buffer the write takes over.

    An in-place action hands each read buffer that dies with it (it is its
    last reader by ``last_read``, the buffer is not pinned, sizes match) to
    at most one of its writes.  In timed replays (``last_end``: when each
    buffer's last reader ends; ``finished``: when each action ends), a
    buffer is handed over only if no reader ends after the action.
    ``size``: each key's bytes as its last write gives them, when the
    caller has them already.
    """
    buffers = BufferRows(actions)
    last = buffers.per_buffer(last_read, -1)
    sizes = buffers.sizes() if size is None else buffers.per_buffer(size, 0)
    timing = None
    if last_end is not None:
        timing = (buffers.per_buffer(last_end, np.inf, float), np.asarray(finished, dtype=float))
    given: Dict[Tuple[int, Key], Key] = {}
    for taker, write, donor in zip(*(part.tolist() for part in buffers.handovers(last, sizes, pinned, timing))):
        given[taker, buffers.write_keys[write]] = buffers.reads[donor]
    return given


class BufferRows:
    """The reads and writes of a list of actions as rows of arrays: for each
    read, the action and the buffer's number; for each write, the action,
    the buffer's number and its bytes.  The buffer rules then run over
    arrays, not action by action (a replay has thousands of actions).
    Rows follow the list: actions in order, each one's reads (or writes)
    in its order.

    ``prefix``: the rows of actions the list starts with (the same objects,
    as a plan's forward pass in every replay of a model), numbered once
    and reused; ignored when the list does not start with them.

    Examples
    --------
    >>> forward = [Action("a", [], [(("f", 0), 4)]), Action("b", [("f", 0)], [(("f", 1), 4)])]
    >>> rows = BufferRows(forward + [Action("c", [("f", 1)], [])], prefix=BufferRows(forward))
    >>> rows.read_action.tolist(), rows.write_action.tolist(), rows.last_reads()[rows.write_id].tolist()
    ([1, 2], [0, 1], [1, 2])
    """

    def __init__(self, actions: Sequence[Action], prefix: Optional["BufferRows"] = None):
        self.actions = actions
        if prefix is not None and not _starts_with(actions, prefix.actions):
            prefix = None
        known = len(prefix.actions) if prefix is not None else 0
        rest = actions[known:]
        read_lists = list(map(attrgetter("reads"), rest))
        write_lists = list(map(attrgetter("writes"), rest))
        writes = list(chain.from_iterable(write_lists))
        reads: List[Key] = list(chain.from_iterable(read_lists))
        write_keys: List[Key] = list(map(itemgetter(0), writes))
        # a key's number: the row of its first write or read (numbers have gaps)
        self.number: Dict[Key, int] = dict(prefix.number) if prefix is not None else {}
        first = prefix.numbers if prefix is not None else 0
        rows = itertools_count(first)
        self.numbers = first + len(writes) + len(reads)
        parts = {
            "write_id": np.fromiter(map(self.number.setdefault, write_keys, rows), np.intp, len(writes)),
            "read_id": np.fromiter(map(self.number.setdefault, reads, rows), np.intp, len(reads)),
            "write_action": np.repeat(np.arange(known, len(actions)),
                                      np.fromiter(map(len, write_lists), np.intp, len(rest))),
            "read_action": np.repeat(np.arange(known, len(actions)),
                                     np.fromiter(map(len, read_lists), np.intp, len(rest))),
            "write_bytes": np.fromiter(map(itemgetter(1), writes), np.int64, len(writes)),
            "forwards": np.fromiter(map(attrgetter("forwards_buffers"), rest), bool, len(rest)),
        }
        if prefix is not None:
            parts = {name: np.concatenate([getattr(prefix, name), part]) for name, part in parts.items()}
            reads, write_keys = prefix.reads + reads, prefix.write_keys + write_keys
        self.reads, self.write_keys = reads, write_keys
        self.write_id, self.read_id = parts["write_id"], parts["read_id"]
        self.write_action, self.read_action = parts["write_action"], parts["read_action"]
        self.write_bytes, self.forwards = parts["write_bytes"], parts["forwards"]

    def last_reads(self) -> np.ndarray:
        """Per buffer, the index of the last action reading it (-1: none)."""
        last = np.full(self.numbers, -1, np.intp)
        np.maximum.at(last, self.read_id, self.read_action)
        return last

    def sizes(self) -> np.ndarray:
        """Per buffer, the bytes its last write gives it (0: never written)."""
        sizes = np.zeros(self.numbers, np.int64)
        ids, last_rows = np.unique(self.write_id[::-1], return_index=True)
        sizes[ids] = self.write_bytes[::-1][last_rows]
        return sizes

    def per_buffer(self, values: Dict[Key, float], default: float, dtype: type = np.intp) -> np.ndarray:
        """``values`` (by key) as an array by buffer number."""
        found = np.full(self.numbers, default, dtype)
        found[np.fromiter(self.number.values(), np.intp, len(self.number))] = np.fromiter(
            map(values.get, self.number, repeat(default)), dtype, len(self.number))
        return found

    def mask(self, keys: Set[Key]) -> np.ndarray:
        """Per buffer, whether its key is one of ``keys``."""
        found = np.zeros(self.numbers, bool)
        found[[self.number[key] for key in keys if key in self.number]] = True
        return found

    def handovers(self, last: np.ndarray, sizes: np.ndarray, pinned: Set[Key],
                  timing: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> Tuple[np.ndarray, ...]:
        """The rule of :func:`donations` on the arrays: ``(action, write row,
        read row of the buffer handed over)`` of each hand-over, in the
        order of the writes.  ``last`` and ``sizes``: per buffer, its last
        reader and its bytes; ``timing``: per buffer when its last reader
        ends, and per action when it ends (timed replays).

        An in-place action offers the buffers it reads last (each once, in
        the order it reads them) that are not pinned, not written by it,
        and hold bytes; its writes with bytes take them in order, each the
        first offered one of its size.  So the k-th write of a size takes
        the k-th offered buffer of that size, which is how the rows are
        paired."""
        read_id, read_action = self.read_id, self.read_action
        offered = np.flatnonzero(self.forwards[read_action] & (last[read_id] == read_action)
                                 & (sizes[read_id] > 0) & ~self.mask(pinned)[read_id])
        if timing is not None:
            last_end, finished = timing
            offered = offered[last_end[read_id[offered]] <= finished[read_action[offered]]]
        pair = read_action[offered] * self.numbers + read_id[offered]
        _, first = np.unique(pair, return_index=True)  # each buffer once, at its first read
        first.sort()
        offered, pair = offered[first], pair[first]
        offered = offered[~_among(pair, self.write_action * self.numbers + self.write_id)]  # rewritten in place
        offering = np.zeros(len(self.actions), bool)
        offering[read_action[offered]] = True
        takers = np.flatnonzero((self.write_bytes > 0) & offering[self.write_action])
        offered_size = sizes[read_id[offered]]
        taken_size = self.write_bytes[takers]
        # pair rows by (action, size, rank among the action's rows of that size)
        size_code = np.unique(np.concatenate([offered_size, taken_size]), return_inverse=True)[1].reshape(-1)
        offered_key = (read_action[offered], size_code[:len(offered)])
        taken_key = (self.write_action[takers], size_code[len(offered):])
        offered_key += (_ranks(*offered_key),)
        taken_key += (_ranks(*taken_key),)
        bounds = [int(max(np.max(a, initial=0), np.max(b, initial=0))) + 1 for a, b in zip(offered_key, taken_key)]
        _, by_offer, by_write = np.intersect1d(np.ravel_multi_index(offered_key, bounds),
                                               np.ravel_multi_index(taken_key, bounds),
                                               assume_unique=True, return_indices=True)
        order = np.argsort(takers[by_write])
        writes = takers[by_write][order]
        return self.write_action[writes], writes, offered[by_offer][order]


def _starts_with(actions: Sequence[Action], prefix: Sequence[Action]) -> bool:
    """Whether ``actions`` starts with the very objects of ``prefix``."""
    return len(prefix) <= len(actions) and all(map(is_, prefix, actions))


def _among(values: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Per value, whether it is one of ``candidates`` (``np.isin`` without
    its lookup table, which spans the whole range of the values)."""
    candidates = np.sort(candidates)
    found = np.searchsorted(candidates, values)
    if not len(candidates):
        return np.zeros(len(values), bool)
    return candidates[np.minimum(found, len(candidates) - 1)] == values


def _ranks(groups: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each row's rank among the earlier rows of the same group and size."""
    if not len(groups):
        return np.zeros(0, np.intp)
    order = np.lexsort((sizes, groups))  # stable: equal rows keep their order
    group, size = groups[order], sizes[order]
    starts = np.ones(len(order), bool)
    starts[1:] = (group[1:] != group[:-1]) | (size[1:] != size[:-1])
    position = np.arange(len(order))
    rank = np.empty(len(order), np.intp)
    rank[order] = position - np.maximum.accumulate(np.where(starts, position, 0))
    return rank


def consumed_at_once(key: Key, action: Action, i: int, last_read: Dict[Key, int], pinned: Set[Key]) -> bool:
    """A result gradient (one of ``action.results``) that action ``i`` writes, nothing
    reads afterwards and the caller does not keep (``keep_x_gradients``
    False): it is made and consumed (applied, reduced) by its own kernel,
    before the op's other gradient kernels allocate, so it adds to the peak
    on its own.  A weight gradient and the gradient of the layer's input are
    separate kernels, and TensorFlow runs the weight gradient and its
    reduction first (README, "Swapping to host memory", compares the
    prediction with the measured peak of a swapping MLP)."""
    return key in action.results and key not in pinned and last_read.get(key, i) <= i


def memory_replay(actions: List[Action], pinned: Set[Key],
                  prefix: Optional[BufferRows] = None) -> Tuple[List[int], int]:
    """Bytes in use after each action and the peak during any action.

    A buffer is freed after the last action that reads it (right after it is
    written when nothing reads it), or handed to an in-place write
    (:func:`donations`); ``pinned`` buffers are never freed.  An action's
    temporary (:attr:`Action.temp`) is in use while it runs, not after.

    Each buffer adds its bytes to the action that writes it and takes them
    off the action that frees it; the bytes in use are the running sum
    (:class:`_Changes`).  ``prefix``: the rows of the actions every list
    given starts with, when the caller keeps them (:class:`BufferRows`).
    """
    if not actions:
        return [], 0
    buffers = BufferRows(actions, prefix)
    return _Changes(buffers, pinned).totals()


class _Changes:
    """How each action of a replay changes the bytes in use: its writes add
    (``allocated``, net of the buffers they take over or replace), its end
    frees (``freed``); the results it consumes at once
    (:func:`consumed_at_once`) add to the peak only, before its writes
    (``consumed``)."""

    def __init__(self, buffers: BufferRows, pinned: Set[Key]):
        count = len(buffers.actions)
        self.buffers, self.pinned = buffers, pinned
        self.last = buffers.last_reads()
        self.allocated = np.zeros(count, np.int64)
        self.freed = np.zeros(count, np.int64)
        self.consumed = np.zeros(count, np.int64)
        taker = np.full(buffers.numbers, -1, np.intp)
        actions, writes, donors = buffers.handovers(self.last, buffers.sizes(), pinned)
        # a write listed twice in an action keeps the buffer of its last hand-over
        _, last_first = np.unique((actions * buffers.numbers + buffers.write_id[writes])[::-1], return_index=True)
        kept = len(writes) - 1 - last_first
        taker[buffers.read_id[donors[kept]]] = actions[kept]
        rows = np.ones(len(buffers.write_id), bool)  # the writes that allocate
        rows[self._consumed_rows()] = False
        once = np.bincount(buffers.write_id, minlength=buffers.numbers)[buffers.write_id] == 1
        self._add_written_once(np.flatnonzero(rows & once), taker)
        for rows_of_key in _groups(buffers.write_id, np.flatnonzero(~once)):
            self._follow(rows_of_key, rows, taker)

    def _consumed_rows(self) -> List[int]:
        """The write rows of results consumed at once; ``consumed`` gets
        each action's largest."""
        buffers, found = self.buffers, []
        with_results = list(compress(range(len(buffers.actions)), map(attrgetter("results"), buffers.actions)))
        if not with_results:
            return found
        start = np.concatenate([[0], np.cumsum(np.bincount(buffers.write_action, minlength=len(buffers.actions)))])
        last_read = self._last_reads(chain.from_iterable(buffers.actions[i].results for i in with_results))
        for i in with_results:
            action = buffers.actions[i]
            consumed: Dict[Key, int] = {}
            for key, nbytes in action.writes:
                if consumed_at_once(key, action, i, last_read, self.pinned):
                    consumed[key] = nbytes
            if consumed:
                self.consumed[i] = max(consumed.values())
                first = int(start[i])
                found += [first + k for k, (key, _) in enumerate(action.writes) if key in consumed]
        return found

    def _last_reads(self, keys: Iterable[Key]) -> Dict[Key, int]:
        """The last reader of each of ``keys`` that is read (a dict, as
        :func:`consumed_at_once` takes)."""
        number = self.buffers.number
        keys = [key for key in keys if key in number]
        readers = self.last[[number[key] for key in keys]].tolist()
        return {key: reader for key, reader in zip(keys, readers) if reader >= 0}

    def _add_written_once(self, rows: np.ndarray, taker: np.ndarray) -> None:
        """Buffers written once (``rows``: their allocating writes): their
        bytes from the write to their last read, or to the write that
        takes them over; pinned ones stay."""
        buffers = self.buffers
        ids, actions, nbytes = buffers.write_id[rows], buffers.write_action[rows], buffers.write_bytes[rows]
        np.add.at(self.allocated, actions, nbytes)
        dying = ~buffers.mask(self.pinned)[ids]
        ids, actions, nbytes = ids[dying], actions[dying], nbytes[dying]
        handed = taker[ids] > actions
        np.add.at(self.allocated, taker[ids[handed]], -nbytes[handed])
        ends = np.maximum(self.last[ids[~handed]], actions[~handed])
        np.add.at(self.freed, ends, nbytes[~handed])

    def _follow(self, rows: np.ndarray, allocating: np.ndarray, taker: np.ndarray) -> None:
        """A buffer written more than once (a result several kernels write;
        ``rows``: its writes), event by event: a write replaces the bytes in
        use under the key; the write it is handed to and the frees after
        last reads take them off."""
        buffers = self.buffers
        key_id = int(buffers.write_id[rows[0]])
        pinned = buffers.write_keys[int(rows[0])] in self.pinned
        events = []  # (action, phase: 0 writes and hand-overs / 1 frees, row, bytes written or None)
        for row in rows.tolist():
            i = int(buffers.write_action[row])
            if allocating[row]:
                events.append((i, 0, row, int(buffers.write_bytes[row])))
            if not pinned:
                events.append((max(int(self.last[key_id]), i), 1, row, None))
        if taker[key_id] >= 0:
            events.append((int(taker[key_id]), 0, -1, None))
        live = None
        for i, phase, _, nbytes in sorted(events, key=lambda event: event[:3]):
            if nbytes is not None:
                self.allocated[i] += nbytes - (live or 0)
                live = nbytes
            elif live is not None:
                if phase == 0:
                    self.allocated[i] -= live
                else:
                    self.freed[i] += live
                live = None

    def totals(self) -> Tuple[List[int], int]:
        """Bytes in use after each action, and the peak: before an action
        (plus a result it consumes at once) or during it (its writes and
        its temporary)."""
        in_use = np.cumsum(self.allocated - self.freed)
        before = np.concatenate([[0], in_use[:-1]])
        temp = np.fromiter(map(attrgetter("temp"), self.buffers.actions), np.int64, len(in_use))
        peak = max(0, int((before + self.consumed).max()), int((before + self.allocated + temp).max()))
        return in_use.tolist(), peak


def _groups(ids: np.ndarray, rows: np.ndarray) -> List[np.ndarray]:
    """``rows`` grouped by ``ids[rows]``, each group in row order."""
    order = np.argsort(ids[rows], kind="stable")
    rows = rows[order]
    splits = np.flatnonzero(np.diff(ids[rows])) + 1
    return np.split(rows, splits) if len(rows) else []
