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
all use these rules, so a buffer rule is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

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
    forwarding = [i for i, action in enumerate(actions) if action.forwards_buffers]
    if not forwarding:
        return {}
    if size is None:
        size = {key: nbytes for action in actions for key, nbytes in action.writes}
    given: Dict[Tuple[int, Key], Key] = {}
    for i in forwarding:
        action = actions[i]
        donors = [key for key in dict.fromkeys(action.reads) if last_read.get(key) == i]
        if not donors:
            continue
        written = {key for key, _ in action.writes}
        donors = [key for key in donors
                  if key not in pinned and key not in written and size.get(key, 0) > 0
                  and (last_end is None or last_end[key] <= finished[i])]
        for key, nbytes in action.writes:
            donor = next((d for d in donors if size[d] == nbytes), None)
            if donor is not None and nbytes > 0:
                given[i, key] = donor
                donors.remove(donor)
    return given


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


def memory_replay(actions: List[Action], pinned: Set[Key]) -> Tuple[List[int], int]:
    """Bytes in use after each action and the peak during any action.

    A buffer is freed after the last action that reads it (right after it is
    written when nothing reads it), or handed to an in-place write
    (:func:`donations`); ``pinned`` buffers are never freed.  An action's
    temporary (:attr:`Action.temp`) is in use while it runs, not after.
    """
    last_read: Dict[Key, int] = {}
    for i, action in enumerate(actions):
        for key in action.reads:
            last_read[key] = i
    dies_at: List[List[Key]] = [[] for _ in actions]
    size: Dict[Key, int] = {}
    for i, action in enumerate(actions):
        for key, nbytes in action.writes:
            size[key] = nbytes
            if key not in pinned:
                end = last_read.get(key, i)
                dies_at[end if end > i else i].append(key)
    given = donations(actions, last_read, pinned, size=size)
    live: Dict[Key, int] = {}
    in_use = 0
    peak = 0
    timeline = []
    for i, action in enumerate(actions):
        transient = ()
        if action.results:
            transient = {key: nbytes for key, nbytes in action.writes
                         if consumed_at_once(key, action, i, last_read, pinned)}
        if transient:
            peak = max(peak, in_use + max(transient.values()))
        elif in_use > peak:
            peak = in_use
        for key, nbytes in action.writes:
            if key in transient:
                continue
            if given:
                donor = given.get((i, key))
                if donor is not None:
                    in_use -= live.pop(donor, 0)  # the write takes over its buffer
            in_use += nbytes - live.get(key, 0)
            live[key] = nbytes
        if in_use + action.temp > peak:
            peak = in_use + action.temp  # the kernel's work buffers, freed when it ends
        for key in dies_at[i]:
            in_use -= live.pop(key, 0)
        timeline.append(in_use)
    return timeline, peak
