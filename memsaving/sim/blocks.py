"""The backward pass in blocks of actions, remembered per model.

The planners score long runs of neighbouring plans: the per-op refinements
(:mod:`memsaving.planners.refine`) try the accepted plan with one op more
or one op less, the budget search moves one cut at a time.  Such plans run
mostly the same backward units (:func:`memsaving.model.schedule.backward_units`)
in the same state, and the actions of a run of units depend only on

* the units themselves (their kinds, anchors and ops);
* the buffers holding, so far, the gradients of the tensors they read or
  add to (their versions: :class:`memsaving.sim.actions.GradientBuffers`);
* the copies the advance units before them made (multi-level plans),
  which they read and whose views' bases they pin.

So the actions made for a run of units in one state are those of any plan
that reaches the run in that state: :class:`UnitMemo` keeps them per
model, as a :class:`UnitBlock`, with what the run changes in the state,
the action labels and recomputed costs a simulation reports, and the rows
the memory replay reads (in a :class:`~memsaving.sim.row_store.RowStore`;
the actions themselves are dropped once their rows are made).  A plan is
then mostly replayed by gathering blocks made for earlier plans.

The units are cut into runs where the content says (:func:`runs`), not
every so many units, so that a plan that has one unit more or less than
another has all the other runs of it; a run is a block's worth of work
(a few units), so that remembering and finding it costs little next to
running it.  A run seen for the first time gets no block of its own: the
plans of a search that share nothing pay next to nothing for the memo.
The memo is bounded (in actions, and in buffer numbers) and forgets the
runs used least recently.
"""

from __future__ import annotations

from itertools import chain, compress
from operator import attrgetter, methodcaller
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

from memsaving.model.buffers import Action, BufferRows, Key
from memsaving.model.schedule import Unit
from memsaving.sim.row_store import RowStore, Span

RECOMPUTED_LABELS = ("recompute ", "advance ")
"""The label prefixes of the actions whose cost is recomputation."""

Run = Tuple[Unit, ...]
"""Consecutive units of a plan's backward pass (:func:`runs`)."""


def runs(units: Sequence[Unit]) -> List[Run]:
    """``units`` cut into runs: after each unit whose anchor's hash falls
    in the lowest :data:`RUN_UNITS`-th of the hashes (so that a run has
    that many units on average, and where it ends depends on its units
    alone), and after ``4 * RUN_UNITS`` units without such an anchor.

    Examples
    --------
    >>> from memsaving.model.schedule import UnitKind
    >>> units = [Unit(UnitKind.PASS, i, (i,)) for i in range(40)]
    >>> [run[-1].anchor for run in runs(units)]
    [0, 5, 13, 18, 26, 34, 39]
    >>> [run[-1].anchor for run in runs(units[3:])]  # the same cuts
    [5, 13, 18, 26, 34, 39]
    """
    found: List[Run] = []
    start, end = 0, (1 << 32) // RUN_UNITS
    for k, unit in enumerate(units):
        if (unit.anchor * 2654435761) & 0xFFFFFFFF < end or k - start == 4 * RUN_UNITS - 1:
            found.append(tuple(units[start:k + 1]))
            start = k + 1
    if start < len(units):
        found.append(tuple(units[start:]))
    return found


RUN_UNITS = 8
"""The units of a run, on average."""


class UnitBlock:
    """The actions of a run of units of a plan's backward pass (or of the
    forward pass, or the seed of the gradients), and what a replay needs
    of them."""

    __slots__ = ("actions", "gradients", "sources", "token", "ends", "labels", "recomputed_costs", "span")

    def __init__(self, actions: List[Action], gradients: Optional[Dict[int, Key]] = None,
                 sources: Optional[Dict] = None, token: int = 0, ends: Tuple[int, ...] = ()):
        self.actions: Optional[List[Action]] = actions
        """The actions, until their rows are stored (:meth:`UnitMemo.rows`)."""
        self.gradients = gradients or {}
        """Each tensor the units add gradient to, with the buffer holding
        its gradient after them."""
        self.sources = sources
        """The copies the advance units among them made (tensor or saved key
        -> the copy's key), which the units after them read; None if none."""
        self.token = token
        """The advance units run up to the block's end (:meth:`UnitMemo.token`)."""
        self.ends = ends
        """The last action of each of the units (in a remembered block)."""
        self.labels: Tuple[str, ...] = tuple(map(attrgetter("label"), actions))
        self.recomputed_costs: Tuple[float, ...] = tuple(compress(
            map(attrgetter("cost"), actions), map(methodcaller("startswith", RECOMPUTED_LABELS), self.labels)))
        """The costs of the actions that recompute (:data:`RECOMPUTED_LABELS`), in order."""
        self.span: Optional[Span] = None
        """Where its rows are in the memo's :class:`~memsaving.sim.row_store.RowStore`, once there."""


class _Entry:
    """A run's blocks, by the state the run starts in."""

    __slots__ = ("run", "tensors", "targets", "blocks", "size", "used")

    def __init__(self, run: Run, tensors: Tuple[int, ...], targets: Tuple[int, ...], used: int):
        self.run = run
        self.tensors = tensors
        """The tensors whose gradient buffers the run reads or adds to."""
        self.targets = targets
        """The tensors it adds gradient to."""
        self.blocks: Dict[tuple, UnitBlock] = {}
        self.size = 1
        """The actions of its blocks, and one per block and one for itself."""
        self.used = used
        """The last plan that used it (:attr:`UnitMemo.clock`)."""


class UnitMemo:
    """The blocks of one model's runs of units (see the module docstring),
    at most about ``capacity`` actions of them, and their rows.

    ``fixed``: blocks every plan has (the forward pass, the seed), kept
    for good, with their actions; their rows are made again when the
    buffer numbers start over."""

    def __init__(self, capacity: int, fixed: Sequence[UnitBlock]):
        self.capacity = capacity
        self.fixed = list(fixed)
        self.clock = 0
        """The number of the plan being made (:meth:`begin`)."""
        self.start_over()

    def start_over(self) -> None:
        """Forget every run's blocks and every row."""
        self.entries: Dict[int, Union[_Entry, int]] = {}
        """Each run's entry, or the plan it was seen in when seen once, by
        the hash of the run's ops (so that a run seen once keeps no
        objects; an entry checks that it is the run's)."""
        self.size = 0
        """The actions of the entries' blocks, and one per block and one per run."""
        self.tokens: Dict[Tuple[int, Unit], int] = {}
        self.row_store = RowStore()
        """The rows of the blocks."""
        for block in self.fixed:
            block.span = None

    def begin(self) -> None:
        """Called before each plan: start over when the buffer numbers
        have grown past what the replays should allocate per buffer (the
        blocks of one plan share one table) or the advance units named
        are too many; keep only the rows of the blocks remembered when the
        stored rows have grown large."""
        self.clock += 1
        if self.row_store.numbers.bound > _NUMBERS_PER_ACTION * self.capacity or len(self.tokens) > self.capacity:
            self.start_over()
        elif self.row_store.actions > 2 * self.capacity:
            self.row_store.keep([block for block in chain(self.fixed, *(
                entry.blocks.values() for entry in self.entries.values() if entry.__class__ is _Entry))
                if block.span is not None])

    def entry(self, run: Run, tensors: Callable[[Run], Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> Optional[_Entry]:
        """``run``'s entry; None the first time the run is seen (it is
        remembered as seen), and when another run with the same hash has
        the entry.  The entry is made with ``tensors(run)`` (its tensors
        and targets, see :class:`_Entry`)."""
        key = hash(tuple(map(_OPS, run)))  # without the units' own hashes, written in Python
        entry = self.entries.get(key)
        if entry.__class__ is _Entry:
            if entry.run != run:
                return None
            entry.used = self.clock
            return entry
        if entry is None:
            self.entries[key] = self.clock
            self.size += 1
            if self.size > self.capacity:
                self._forget()
            return None
        entry = self.entries[key] = _Entry(run, *tensors(run), self.clock)  # counted one, as when seen once
        return entry

    def store(self, entry: _Entry, state: tuple, block: UnitBlock) -> None:
        """Remember ``block`` as ``entry``'s run's in ``state``, forgetting
        the least recently used runs beyond the capacity."""
        if len(entry.blocks) >= _STATES_PER_RUN:
            dropped = entry.blocks.pop(next(iter(entry.blocks)))
            entry.size -= len(dropped.labels) + 1
            self.size -= len(dropped.labels) + 1
        entry.blocks[state] = block
        entry.size += len(block.labels) + 1
        self.size += len(block.labels) + 1
        if self.size > self.capacity:
            self._forget()

    def _forget(self) -> None:
        """Forget the runs used least recently, down to half the capacity
        (not those of the plan being made, whose entries may still get
        blocks)."""
        def used(value: Union[_Entry, int]) -> int:
            return value if value.__class__ is int else cast(_Entry, value).used

        def size(value: Union[_Entry, int]) -> int:
            return 1 if value.__class__ is int else cast(_Entry, value).size

        excess = self.size - self.capacity // 2
        for key, value in sorted(self.entries.items(), key=lambda item: used(item[1])):
            if excess <= 0 or used(value) == self.clock:
                break
            del self.entries[key]
            excess -= size(value)
        self.size = sum(map(size, self.entries.values()))

    def token(self, before: int, unit: Unit) -> int:
        """The number naming the advance units run so far: those named by
        ``before`` (0: none), then ``unit``."""
        return self.tokens.setdefault((before, unit), len(self.tokens) + 1)

    def rows(self, blocks: Sequence[UnitBlock]) -> BufferRows:
        """The rows of the list of actions ``blocks`` make up: those of the
        blocks not stored yet are made (together) and stored, then all are
        gathered.  The stored blocks' actions are dropped (the fixed
        blocks' are the model's anyway)."""
        missing = list({id(block): block for block in blocks if block.span is None}.values())
        if missing:
            self.row_store.add(missing)
            for block in missing:
                if all(block is not fixed for fixed in self.fixed):
                    block.actions = None
        return self.row_store.rows(blocks)


_OPS = attrgetter("ops")

_STATES_PER_RUN = 4
"""Blocks remembered per run (the states it was reached in): the plans of
one search reach a run in one or two."""

_NUMBERS_PER_ACTION = 2
"""Buffer numbers per action of capacity before the memo starts over: a
replay allocates a few arrays of one entry per number, and an action
writes about one buffer."""
