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
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Set, Tuple, cast

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


def donations(actions: Sequence[Action], last_read: Dict[Key, int], pinned: AbstractSet[Key] = frozenset(),
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
    reads, write_keys = cast(List[Key], buffers.reads), cast(List[Key], buffers.write_keys)  # rows of actions: not None
    for taker, write, donor in zip(*(part.tolist() for part in buffers.handovers(last, sizes, pinned, timing))):
        given[taker, write_keys[write]] = reads[donor]
    return given


class BufferRows:
    """The reads and writes of a list of actions as rows of arrays: for each
    read, the action and the buffer's number; for each write, the action,
    the buffer's number and its bytes; for each action, whether it writes
    in place and its temporary.  The buffer rules then run over arrays, not
    action by action (a replay has thousands of actions).  Rows follow the
    list: actions in order, each one's reads (or writes) in its order.

    ``prefix``: the rows of actions the list starts with (the same objects,
    as a plan's forward pass in every replay of a model), numbered once
    and reused; ignored when the list does not start with them.
    :meth:`packed` makes the rows of a list from rows numbered once for
    many lists instead (:class:`RowBlock`).

    Examples
    --------
    >>> forward = [Action("a", [], [(("f", 0), 4)]), Action("b", [("f", 0)], [(("f", 1), 4)])]
    >>> rows = BufferRows(forward + [Action("c", [("f", 1)], [])], prefix=BufferRows(forward))
    >>> rows.read_action.tolist(), rows.write_action.tolist(), rows.last_reads()[rows.write_id].tolist()
    ([1, 2], [0, 1], [1, 2])
    """

    def __init__(self, actions: Sequence[Action], prefix: Optional["BufferRows"] = None):
        self.actions: Optional[Sequence[Action]] = actions
        """The actions (None in :meth:`packed` rows)."""
        self.count = len(actions)
        if prefix is not None and not _starts_with(actions, cast(Sequence[Action], prefix.actions)):  # not packed
            prefix = None
        known = prefix.count if prefix is not None else 0
        # a key's number: the row of its first write or read (numbers have gaps)
        self.number: Dict[Key, int] = dict(prefix.number) if prefix is not None else {}
        first = prefix.numbers if prefix is not None else 0
        rows = _Rows(actions[known:], self.number, first, known)
        self.numbers: int = first + rows.numbered
        reads, write_keys = rows.reads, rows.write_keys
        if prefix is not None:
            for name in _ROW_ARRAYS:
                setattr(rows, name, np.concatenate([getattr(prefix, name), getattr(rows, name)]))
            # a prefix of the same actions is not packed: it has its keys
            reads, write_keys = cast(List[Key], prefix.reads) + reads, cast(List[Key], prefix.write_keys) + write_keys
        self.reads: Optional[List[Key]] = reads
        """Each read row's key (None in :meth:`packed` rows)."""
        self.write_keys: Optional[List[Key]] = write_keys
        """Each write row's key (None in :meth:`packed` rows)."""
        self.write_id, self.read_id = rows.write_id, rows.read_id
        self.write_action, self.read_action = rows.write_action, rows.read_action
        self.write_bytes, self.forwards = rows.write_bytes, rows.forwards
        self.temp = rows.temp
        """Per action, its temporary (:attr:`Action.temp`)."""
        self.result_write = rows.result_write
        """Per write row, whether its key is one of the action's :attr:`Action.results`."""

    @classmethod
    def packed(cls, reads: np.ndarray, writes: np.ndarray, acts: np.ndarray, numbers: "KeyNumbers") -> "BufferRows":
        """The rows of a list of actions from their packed arrays (see
        :attr:`RowBlock.packed`; actions numbered in the list), its buffers
        numbered by ``numbers``.  The result has no :attr:`actions`,
        :attr:`reads` or :attr:`write_keys`: the replay
        (:func:`replay_rows`) needs none of them."""
        rows = cls.__new__(cls)
        rows.actions = rows.reads = rows.write_keys = None
        rows.number, rows.numbers = numbers, numbers.bound
        rows.count = acts.shape[1]
        rows.read_id, rows.read_action = reads[0], reads[1]
        rows.write_id, rows.write_action, rows.write_bytes = writes[0], writes[1], writes[2]
        rows.result_write, rows.forwards, rows.temp = writes[3].astype(bool), acts[0].astype(bool), acts[1]
        return rows

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

    def per_buffer(self, values: Mapping[Key, float], default: float, dtype: type = np.intp) -> np.ndarray:
        """``values`` (by key) as an array by buffer number."""
        found: np.ndarray = np.full(self.numbers, default, dtype)
        found[np.fromiter(self.number.values(), np.intp, len(self.number))] = np.fromiter(
            map(values.get, self.number, repeat(default)), dtype, len(self.number))
        return found

    def mask(self, keys: AbstractSet[Key]) -> np.ndarray:
        """Per buffer, whether its key is one of ``keys``."""
        found = np.zeros(self.numbers, bool)
        found[[self.number[key] for key in keys if key in self.number]] = True
        return found

    def handovers(self, last: np.ndarray, sizes: np.ndarray, pinned: AbstractSet[Key],
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
        offering = np.zeros(self.count, bool)
        offering[read_action[offered]] = True
        writing = offering[self.write_action]  # the writes of the actions that offer
        rewritten = self.write_action[writing] * self.numbers + self.write_id[writing]
        offered = offered[~_among(pair, rewritten)]  # rewritten in place
        offering[:] = False
        offering[read_action[offered]] = True
        takers = np.flatnonzero((self.write_bytes > 0) & offering[self.write_action])
        # pair rows by (action, size, rank among the action's rows of that size):
        # the k-th taker of a group takes the k-th offered buffer of it
        offered_group, taker_group = _size_groups(read_action[offered], sizes[read_id[offered]],
                                                  self.write_action[takers], self.write_bytes[takers])
        by_offer = np.argsort(offered_group, kind="stable")
        by_taker = np.argsort(taker_group, kind="stable")
        offered_group, taker_group = offered_group[by_offer], taker_group[by_taker]
        first_offer = np.searchsorted(offered_group, taker_group, "left")
        offers = np.searchsorted(offered_group, taker_group, "right") - first_offer
        rank = _ranks_in_runs(taker_group)
        paired = rank < offers
        writes = takers[by_taker[paired]]
        donors = offered[by_offer[first_offer[paired] + rank[paired]]]
        order = np.argsort(writes)
        return self.write_action[writes[order]], writes[order], donors[order]


def _size_groups(offered_action: np.ndarray, offered_size: np.ndarray, taker_action: np.ndarray,
                 taker_size: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """One number per (action, size) for the offered buffers and the
    takers (the same for both when action and size are)."""
    span = int(max(np.max(offered_size, initial=0), np.max(taker_size, initial=0))) + 1
    actions = int(max(np.max(offered_action, initial=0), np.max(taker_action, initial=0))) + 1
    if actions * span >= 1 << 62:  # sizes too large to number by: number the sizes instead
        codes = np.unique(np.concatenate([offered_size, taker_size]), return_inverse=True)[1].reshape(-1)
        offered_size, taker_size, span = codes[:len(offered_size)], codes[len(offered_size):], len(codes) + 1
    return offered_action * span + offered_size, taker_action * span + taker_size


def _ranks_in_runs(values: np.ndarray) -> np.ndarray:
    """Each entry's rank among the equal entries before it (``values`` sorted)."""
    position = np.arange(len(values))
    starts = np.ones(len(values), bool)
    starts[1:] = values[1:] != values[:-1]
    return position - np.maximum.accumulate(np.where(starts, position, 0)) if len(values) else position


_ROW_ARRAYS = ("write_id", "read_id", "write_action", "read_action", "write_bytes", "forwards", "temp",
               "result_write")
"""The arrays of :class:`BufferRows` that a list's rows join from its prefix's and the rest's."""


class _Rows:
    """The row arrays of a run of actions (see :class:`BufferRows`), the
    actions numbered from ``first_action``, each new key of the rows
    numbered in ``number`` from ``first``: by its row, or (``dense``) one
    after the other; :attr:`numbered` counts the numbers given."""

    def __init__(self, actions: Sequence[Action], number: Dict[Key, int], first: int, first_action: int,
                 dense: bool = False):
        read_lists = list(map(attrgetter("reads"), actions))
        write_lists = list(map(attrgetter("writes"), actions))
        writes = list(chain.from_iterable(write_lists))
        self.reads: List[Key] = list(chain.from_iterable(read_lists))
        self.write_keys: List[Key] = list(map(itemgetter(0), writes))
        if dense:
            new = [key for key in chain(self.write_keys, self.reads) if key not in number]
            number.update(zip(new, itertools_count(first)))  # a key listed twice leaves a gap
            self.numbered = len(new)
            self.write_id = np.fromiter(map(number.__getitem__, self.write_keys), np.intp, len(writes))
            self.read_id = np.fromiter(map(number.__getitem__, self.reads), np.intp, len(self.reads))
        else:
            rows = itertools_count(first)
            self.numbered = len(writes) + len(self.reads)
            self.write_id = np.fromiter(map(number.setdefault, self.write_keys, rows), np.intp, len(writes))
            self.read_id = np.fromiter(map(number.setdefault, self.reads, rows), np.intp, len(self.reads))
        self.read_counts = np.fromiter(map(len, read_lists), np.intp, len(actions))
        self.write_counts = np.fromiter(map(len, write_lists), np.intp, len(actions))
        indices = np.arange(first_action, first_action + len(actions))
        self.write_action = np.repeat(indices, self.write_counts)
        self.read_action = np.repeat(indices, self.read_counts)
        self.write_bytes = np.fromiter(map(itemgetter(1), writes), np.int64, len(writes))
        self.forwards = np.fromiter(map(attrgetter("forwards_buffers"), actions), bool, len(actions))
        self.temp = np.fromiter(map(attrgetter("temp"), actions), np.int64, len(actions))
        self.result_write = np.zeros(len(writes), bool)
        with_results = list(compress(range(len(actions)), map(attrgetter("results"), actions)))
        if with_results:
            starts = (np.cumsum(self.write_counts) - self.write_counts).tolist()
            self.result_write[[starts[i] + k for i in with_results
                               for k, (key, _) in enumerate(actions[i].writes) if key in actions[i].results]] = True


class KeyNumbers(dict):
    """Buffer numbers shared by the row blocks of many lists of actions
    (:class:`RowBlock`): a key keeps the number the first block that has
    it gave it (the next one free, so that a replay's arrays by buffer
    stay short), and every number is below :attr:`bound`.  The table
    grows with each block made: its owner starts a new one (and new
    blocks) when :attr:`bound` is too large."""

    def __init__(self):
        super().__init__()
        self.bound = 0


class RowBlock:
    """The rows of a run of actions (the arrays of :class:`BufferRows`,
    actions numbered from 0), numbered by a table shared with other runs
    (:class:`KeyNumbers`), packed by what they count: rows made once, for
    a run of actions many lists have, are gathered into the rows of any of
    those lists (:meth:`BufferRows.packed`) without numbering their keys
    again.

    Examples
    --------
    >>> numbers = KeyNumbers()
    >>> a = RowBlock([Action("a", [], [(("f", 0), 4)])], numbers)
    >>> b = RowBlock([Action("b", [("f", 0)], [(("f", 1), 4)]), Action("c", [("f", 1)], [])], numbers)
    >>> b.packed[0][1] += 1; b.packed[1][1] += 1  # b's actions come after a's
    >>> rows = BufferRows.packed(*(np.concatenate(parts, axis=1) for parts in zip(a.packed, b.packed)), numbers)
    >>> rows.read_action.tolist(), rows.write_action.tolist(), rows.last_reads()[rows.write_id].tolist()
    ([1, 2], [0, 1], [1, 2])
    """

    __slots__ = ("packed", "read_starts", "write_starts")

    def __init__(self, actions: Sequence[Action], numbers: KeyNumbers):
        rows = _Rows(actions, numbers, numbers.bound, 0, dense=True)
        numbers.bound += rows.numbered
        self.packed = (np.stack([rows.read_id, rows.read_action]),
                       np.stack([rows.write_id, rows.write_action, rows.write_bytes, rows.result_write]),
                       np.stack([rows.forwards, rows.temp]))
        """The arrays of the rows, by what they count: reads (buffer,
        action), writes (buffer, action, bytes, result), actions (in place,
        temporary); all int64."""
        self.read_starts = np.concatenate([[0], np.cumsum(rows.read_counts)])
        """Per action, its first read row (and the count of reads last)."""
        self.write_starts = np.concatenate([[0], np.cumsum(rows.write_counts)])
        """Per action, its first write row (and the count of writes last)."""


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


def consumed_at_once(key: Key, action: Action, i: int, last_read: Dict[Key, int], pinned: AbstractSet[Key]) -> bool:
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
    return replay_rows(BufferRows(actions, prefix), pinned)


def replay_rows(buffers: BufferRows, pinned: Set[Key]) -> Tuple[List[int], int]:
    """:func:`memory_replay` of the list of actions ``buffers`` holds the
    rows of (at least one action)."""
    return _Changes(buffers, pinned).totals()


ALLOCATE, FREE, HAND_OVER = 0, 1, 2
"""The kinds of :class:`AllocationEvents`: a buffer gets memory of its own
(value: its bytes); it gives its memory back (value unused); it hands its
memory to another buffer, which writes in place (value: the taker's key)."""


@dataclass(slots=True)
class AllocationEvents:
    """A replay as the allocations and frees a memory allocator sees, in
    order: ``kinds[k]`` (:data:`ALLOCATE`, :data:`FREE`, :data:`HAND_OVER`)
    done to buffer ``keys[k]`` with ``values[k]``.

    Keys are numbers: a buffer written once has its buffer number; each
    new version of a buffer written several times, a number from
    ``numbers`` on; an action's temporary ``-1 - action``; a result
    consumed at once ``-1 - actions - write row``."""

    kinds: List[int]
    keys: List[int]
    values: List[int]


def replay_with_events(buffers: BufferRows, pinned: Set[Key]) -> Tuple[List[int], int, AllocationEvents]:
    """:func:`replay_rows`, and the replay as allocations and frees
    (:meth:`_Changes.events`), for a model of the allocator that counts
    what each allocation really holds (:mod:`memsaving.sim.allocator`)."""
    changes = _Changes(buffers, pinned)
    return (*changes.totals(), changes.events())


_CONSUMED, _REPLACED, _WRITES, _TEMP, _TEMP_ENDS, _FREES = range(6)
"""When in its action an event comes: results consumed at once (made and
freed); the buffers its writes replace, or take over without taking their
memory, freed; its writes; its temporary made; its temporary freed; the
buffers it reads last freed."""


class _Changes:
    """How each action of a replay changes the bytes in use: its writes add
    (``allocated``, net of the buffers they take over or replace), its end
    frees (``freed``); the results it consumes at once
    (:func:`consumed_at_once`) add to the peak only, before its writes
    (``consumed``)."""

    def __init__(self, buffers: BufferRows, pinned: Set[Key]):
        count = buffers.count
        self.buffers = buffers
        self.pinned = buffers.mask(pinned)
        """Per buffer, whether it is pinned."""
        self.last = buffers.last_reads()
        self.allocated = np.zeros(count, np.int64)
        self.freed = np.zeros(count, np.int64)
        self.consumed = np.zeros(count, np.int64)
        taker = np.full(buffers.numbers, -1, np.intp)
        self.taker_row = np.full(buffers.numbers, -1, np.intp)
        """Per buffer, the write row that takes it over in place (-1: none)."""
        actions, writes, donors = buffers.handovers(self.last, buffers.sizes(), pinned)
        # a write listed twice in an action keeps the buffer of its last hand-over
        _, last_first = np.unique((actions * buffers.numbers + buffers.write_id[writes])[::-1], return_index=True)
        kept = len(writes) - 1 - last_first
        taker[buffers.read_id[donors[kept]]] = actions[kept]
        self.taker_row[buffers.read_id[donors[kept]]] = writes[kept]
        rows = np.ones(len(buffers.write_id), bool)  # the writes that allocate
        self.consumed_rows = self._consumed_rows()
        rows[self.consumed_rows] = False
        once = np.bincount(buffers.write_id, minlength=buffers.numbers)[buffers.write_id] == 1
        self.once_rows = np.flatnonzero(rows & once)
        """The allocating writes of buffers written once."""
        self._add_written_once(self.once_rows, taker)
        self.followed: List[Tuple[int, list]] = []
        """Each buffer written more than once, and its events in order (:meth:`_follow`)."""
        for rows_of_key in _groups(buffers.write_id, np.flatnonzero(~once)):
            self._follow(rows_of_key, rows, taker)

    def _consumed_rows(self) -> np.ndarray:
        """The write rows of results consumed at once (the rule of
        :func:`consumed_at_once`: a result the action writes, not pinned,
        read by no later action); ``consumed`` gets each action's largest."""
        buffers = self.buffers
        rows = np.flatnonzero(buffers.result_write)
        ids, actions = buffers.write_id[rows], buffers.write_action[rows]
        at_once = ~self.pinned[ids] & (self.last[ids] <= actions)
        rows = rows[at_once]
        np.maximum.at(self.consumed, actions[at_once], buffers.write_bytes[rows])
        return rows

    def _add_written_once(self, rows: np.ndarray, taker: np.ndarray) -> None:
        """Buffers written once (``rows``: their allocating writes): their
        bytes from the write to their last read, or to the write that
        takes them over; pinned ones stay."""
        buffers = self.buffers
        ids, actions, nbytes = buffers.write_id[rows], buffers.write_action[rows], buffers.write_bytes[rows]
        np.add.at(self.allocated, actions, nbytes)
        dying = ~self.pinned[ids]
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
        pinned = bool(self.pinned[key_id])
        # (action, phase: 0 writes and hand-overs / 1 frees, row, bytes written or None)
        events: List[Tuple[int, int, int, Optional[int]]] = []
        for row in rows.tolist():
            i = int(buffers.write_action[row])
            if allocating[row]:
                events.append((i, 0, row, int(buffers.write_bytes[row])))
            if not pinned:
                events.append((max(int(self.last[key_id]), i), 1, row, None))
        if taker[key_id] >= 0:
            events.append((int(taker[key_id]), 0, -1, None))
        events.sort(key=lambda event: event[:3])
        self.followed.append((key_id, events))
        live = None
        for i, phase, _, nbytes in events:
            if nbytes is not None:
                self.allocated[i] += nbytes - (live or 0)
                live = nbytes
            elif live is not None:
                if phase == 0:
                    self.allocated[i] -= live
                else:
                    self.freed[i] += live
                live = None

    def events(self) -> AllocationEvents:
        """The replay as allocations and frees (:class:`AllocationEvents`),
        by the same decisions as :meth:`totals`: summing the bytes of the
        buffers they hold gives its bytes in use and peak.

        Within an action: results consumed at once (each made and freed);
        the buffers its writes replace (a new version of a buffer written
        several times) or take over without taking their memory, freed;
        its writes in order (a write that takes over a dying input's
        buffer takes its memory); its temporary made and freed; then the
        buffers it reads last freed.  Frees before writes keep the bytes in
        use within an action from passing what :meth:`totals` counts."""
        parts: List[Tuple[np.ndarray, ...]] = []
        self._consumed_events(parts)
        self._temp_events(parts)
        self._once_events(parts)
        self._followed_events(parts)
        action, phase, seq, kind, key, value = (np.concatenate(column) for column in zip(*parts))
        order = np.lexsort((seq, phase, action))
        return AllocationEvents(kind[order].tolist(), key[order].tolist(), value[order].tolist())

    def _consumed_events(self, parts: list) -> None:
        """Each result consumed at once, made and freed before the action's writes."""
        buffers, rows = self.buffers, self.consumed_rows
        keys = -1 - buffers.count - rows
        actions = buffers.write_action[rows]
        parts.append(_event_rows(actions, _CONSUMED, 2 * rows, ALLOCATE, keys, buffers.write_bytes[rows]))
        parts.append(_event_rows(actions, _CONSUMED, 2 * rows + 1, FREE, keys, 0))

    def _temp_events(self, parts: list) -> None:
        """Each action's temporary, made after its writes and freed before its reads die."""
        actions = np.flatnonzero(self.buffers.temp > 0)
        parts.append(_event_rows(actions, _TEMP, 0, ALLOCATE, -1 - actions, self.buffers.temp[actions]))
        parts.append(_event_rows(actions, _TEMP_ENDS, 0, FREE, -1 - actions, 0))

    def _once_events(self, parts: list) -> None:
        """Buffers written once: made by their write (or taking over the
        dying buffer handed to it), freed after their last read, unless
        pinned or handed to a later write."""
        buffers, rows = self.buffers, self.once_rows
        ids, actions = buffers.write_id[rows], buffers.write_action[rows]
        row_once = np.zeros(len(buffers.write_id), bool)
        row_once[rows] = True
        takes = self.taker_row[ids]
        handed = ~self.pinned[ids] & (takes >= 0)
        handed[handed] = buffers.write_action[takes[handed]] > actions[handed]
        # a write of a buffer written once takes the memory of a donor written once
        renamed = handed.copy()
        renamed[handed] = row_once[takes[handed]]
        donor_of_row = np.full(len(buffers.write_id), -1, np.intp)
        donor_of_row[takes[renamed]] = ids[renamed]
        donors = donor_of_row[rows]
        taking = donors >= 0
        parts.append(_event_rows(actions, _WRITES, rows, np.where(taking, HAND_OVER, ALLOCATE),
                                 np.where(taking, donors, ids), np.where(taking, ids, buffers.write_bytes[rows])))
        given = handed & ~renamed  # the taker allocates: the donor is freed just before
        parts.append(_event_rows(buffers.write_action[takes[given]], _REPLACED, takes[given], FREE, ids[given], 0))
        dying = ~self.pinned[ids] & ~handed
        ends = np.maximum(self.last[ids[dying]], actions[dying])
        parts.append(_event_rows(ends, _FREES, rows[dying], FREE, ids[dying], 0))

    def _followed_events(self, parts: list) -> None:
        """Buffers written more than once (:meth:`_follow`'s events): each
        write makes a new version and frees the one it replaces (an
        earlier action's: one action's writes of a key count as its last)."""
        numbers = self.buffers.numbers
        rows: List[Tuple[int, int, int, int, int, int]] = []
        for key_id, events in self.followed:
            live = None
            for k, (i, phase, row, nbytes) in enumerate(events):
                if nbytes is not None:
                    following = events[k + 1] if k + 1 < len(events) else None
                    if following is not None and following[0] == i and following[3] is not None:
                        continue  # written again by the same action: only its last write holds memory
                    if live is not None:
                        rows.append((i, _REPLACED, row, FREE, live, 0))
                    live = numbers
                    numbers += 1
                    rows.append((i, _WRITES, row, ALLOCATE, live, nbytes))
                elif live is not None:  # handed over (phase 0) or read for the last time
                    rows.append((i, _REPLACED, int(self.taker_row[key_id]), FREE, live, 0) if phase == 0
                                else (i, _FREES, row, FREE, live, 0))
                    live = None
        parts.append(tuple(np.array(column, np.int64) for column in zip(*rows)) if rows
                     else tuple(np.zeros(0, np.int64) for _ in range(6)))

    def totals(self) -> Tuple[List[int], int]:
        """Bytes in use after each action, and the peak: before an action
        (plus a result it consumes at once) or during it (its writes and
        its temporary)."""
        in_use = np.cumsum(self.allocated - self.freed)
        before = np.concatenate([[0], in_use[:-1]])
        peak = max(0, int((before + self.consumed).max()), int((before + self.allocated + self.buffers.temp).max()))
        return in_use.tolist(), peak


def _event_rows(actions: np.ndarray, phase: int, seq, kind, keys, values) -> Tuple[np.ndarray, ...]:
    """One column each of :meth:`_Changes.events`' rows (action, phase,
    order within the phase, kind, key, value), scalars broadcast."""
    size = len(actions)
    return tuple(np.broadcast_to(np.asarray(column, np.int64), (size,))
                 for column in (actions, phase, seq, kind, keys, values))


def _groups(ids: np.ndarray, rows: np.ndarray) -> List[np.ndarray]:
    """``rows`` grouped by ``ids[rows]``, each group in row order."""
    order = np.argsort(ids[rows], kind="stable")
    rows = rows[order]
    splits = np.flatnonzero(np.diff(ids[rows])) + 1
    return np.split(rows, splits) if len(rows) else []
