"""The order TensorFlow's executor runs a step in when nothing pins it.

Plain ``tf.gradients`` adds no control dependencies, so the order its ops
run in is the executor's choice, and with more than one thread that choice
changes the peak: on a network of two Dense towers, each thread runs one
tower's chain of data gradients, and a weight gradient it pushed to its
queue (holding the incoming gradient and the activation it reads) waits
there until the chain ends.  Replaying the step in the order it was written misses
that.  This module plays the executor's scheduling rules over the
simulator's actions and returns the order the actions start in; the
simulator replays that order for the plain prediction.

The rules followed (TensorFlow's ``ExecutorState::ScheduleReady`` and the
work-stealing queues of its inter-op thread pool):

- a thread that finishes an op looks at the ops it made ready; it keeps one
  of the expensive ones to run next itself and pushes the others to the
  front of its own queue;
- a thread with nothing to run takes the front of its own queue (the op it
  pushed last), else steals from the back of another thread's queue (the
  oldest waiting op there);
- ops start when all their inputs exist; each takes its profiled time (or a
  time proportional to its cost estimate).

Which of the ready ops a thread keeps is the last expensive one in the
order of the finished op's edges, and that order comes from the rewrites
the graph went through (Grappler, then the runtime's passes, which replace
nodes in place), which the graph model does not have (README, "What is
left", has the measurements).  So the edge order is drawn at
random (seeded: the same actions give the same order), and
:func:`unpinned_orders` gives several such orders for the simulator to
take the median peak of.  Drawn uniformly, a chain runs ahead at about half
of its links.

Examples
--------
Two branches, each a chain whose ops also make a side result; with two
threads busy with the chains, a side result left in a thread's queue waits
until its chain ends:

>>> from memsaving.model.buffers import Action
>>> actions = [Action("a1", [], [("a1", 1)], cost=1), Action("b1", [], [("b1", 1)], cost=1),
...            Action("a2", ["a1"], [("a2", 1)], cost=1), Action("side a", ["a1"], [], cost=1),
...            Action("b2", ["b1"], [("b2", 1)], cost=1), Action("side b", ["b1"], [], cost=1)]
>>> [actions[i].label for i in executor_order(actions, seed=1)]
['a1', 'b1', 'a2', 'b2', 'side a', 'side b']
>>> [actions[i].label for i in executor_order(actions, seed=0)]  # edges drawn the other way round
['a1', 'b1', 'side a', 'side b', 'a2', 'b2']
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Deque, Dict, List, Optional, Sequence, Tuple, cast

THREADS = 2
"""Threads of TensorFlow's default inter-op pool on this kind of machine
(one per core); :func:`executor_order` takes the number as an argument."""


@dataclass
class _Thread:
    queue: Deque[int] = field(default_factory=deque)
    inline: Deque[int] = field(default_factory=deque)
    running: Optional[int] = None


def dependencies(actions: Sequence) -> List[List[int]]:
    """For each action, the earlier actions that wrote what it reads (the
    last writer of each key before it)."""
    writer: Dict[Tuple, int] = {}
    preds: List[List[int]] = []
    for i, action in enumerate(actions):
        preds.append(sorted({writer[key] for key in action.reads if key in writer}))
        for key, _ in action.writes:
            writer[key] = i
    return preds


def durations(actions: Sequence) -> List[float]:
    """Each action's time: its measured seconds, else its cost scaled by the
    median seconds per unit of cost of the actions that have both."""
    rates = [a.seconds / a.cost for a in actions if a.seconds is not None and a.cost > 0]
    scale = median(rates) if rates else 1.0
    return [a.seconds if a.seconds is not None else a.cost * scale for a in actions]


ORDERS = 5
"""Edge orders drawn by :func:`unpinned_orders`."""


def unpinned_orders(actions: Sequence, count: int = ORDERS, threads: int = THREADS) -> List[List[int]]:
    """``count`` orders the executor may run ``actions`` in, one per edge
    order drawn (seeds 0, 1, ...)."""
    step = _Step.of(actions)
    return [_executor_order(step, threads, seed) for seed in range(count)]


@dataclass
class _Step:
    """What every order of one list of actions starts from: each action's
    predecessors and successors, and its time."""

    preds: List[List[int]]
    succs: List[List[int]]
    seconds: List[float]

    @classmethod
    def of(cls, actions: Sequence) -> "_Step":
        preds = dependencies(actions)
        succs: List[List[int]] = [[] for _ in actions]
        for i, ps in enumerate(preds):
            for p in ps:
                succs[p].append(i)
        return cls(preds, succs, durations(actions))


def executor_order(actions: Sequence, threads: int = THREADS, seed: int = 0) -> List[int]:
    """Indices of ``actions`` in the order a ``threads``-thread executor
    starts them (a topological order of their reads and writes), with the
    edges of each finished action in an order drawn with ``seed``.

    Actions that take no time (views, shape ops) run inline, before the
    thread's next expensive op, as TensorFlow runs inexpensive kernels.
    """
    return _executor_order(_Step.of(actions), threads, seed)


def _executor_order(step: _Step, threads: int, seed: int) -> List[int]:
    """:func:`executor_order` on the actions ``step`` describes."""
    draw = random.Random(seed)
    preds, succs, seconds = step.preds, step.succs, step.seconds
    n = len(preds)
    pending = [len(ps) for ps in preds]
    pool = [_Thread() for _ in range(max(1, threads))]
    for k, i in enumerate(i for i in range(n) if not preds[i]):
        pool[k % len(pool)].queue.append(i)  # the caller hands the roots to the pool
    running: List[Tuple[float, int, int]] = []  # (finish time, start number, thread)
    order: List[int] = []
    now = 0.0

    def take(t: int) -> Optional[int]:
        me = pool[t]
        if me.inline:
            return me.inline.popleft()
        if me.queue:
            return me.queue.popleft()
        for other in pool[t + 1:] + pool[:t]:
            if other.queue:
                return other.queue.pop()
        return None

    def schedule_ready(me: _Thread, ready: List[int]) -> None:
        """Inexpensive ops run inline; of the expensive ones the last is kept
        (unless inline work is waiting), the others go to the thread's queue."""
        draw.shuffle(ready)
        keep = None
        for i in ready:
            if seconds[i] <= 0:
                me.inline.append(i)
                continue
            if keep is not None:
                me.queue.appendleft(keep)
            keep = i
        if keep is not None:
            if me.inline:
                me.queue.appendleft(keep)
            else:
                me.inline.append(keep)

    def start_idle(first: int) -> None:
        """Idle threads take work, the one that just finished first (it goes
        on with its own ops while the others wake up and steal)."""
        for t in [first] + [t for t in range(len(pool)) if t != first]:
            if pool[t].running is None:
                i = take(t)
                if i is not None:
                    pool[t].running = i
                    order.append(i)
                    heapq.heappush(running, (now + seconds[i], len(order), t))

    start_idle(0)
    while running:
        now, _, t = heapq.heappop(running)
        me = pool[t]
        done, me.running = cast(int, me.running), None  # the op it was running
        ready = []
        for s in succs[done]:
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
        schedule_ready(me, ready)
        start_idle(t)
    if len(order) != n:
        raise ValueError("the actions' reads and writes form a cycle")
    return order
