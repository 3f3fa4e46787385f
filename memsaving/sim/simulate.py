"""Predicting the peak memory and compute of a gradient computation.

Every strategy (plain backprop, any checkpoint choice) is scored here, on the
neutral graph model, by replaying the step as a list of actions: the forward
ops, then each backward unit's recomputation and gradient ops.  A buffer lives
from the action that produces it to the last action that reads it, which is
how TensorFlow's executor frees memory (reference counts), so the predicted
peak is the largest sum of live buffers during any action, plus the memory
resident before the step.  The actions come from :mod:`memsaving.sim.actions`,
the buffer rules from :mod:`memsaving.model.buffers`.  The planners score
long runs of neighbouring plans, so a plan is mostly replayed from blocks
of actions that earlier plans of the model made (:mod:`memsaving.sim.blocks`),
with the same result as from its own list.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress
from operator import attrgetter, methodcaller
from typing import FrozenSet, Iterable, Iterator, List, Optional, Set, Tuple, cast

from memsaving.sim.actions import block_rows, forward_actions, step_actions, step_blocks
from memsaving.sim.allowance import charge
from memsaving.sim.blocks import RECOMPUTED_LABELS
from memsaving.model.buffers import Action, BufferRows, Key, memory_replay, replay_rows, replay_with_events
from memsaving.sim.allocator import replay as replay_allocations
from memsaving.sim.executor import unpinned_orders
from memsaving.model.graph import GraphModel, gradient_sinks
from memsaving.model.schedule import Inner, Unit, backward_units, kept_set, plain_units
from memsaving.sim.swap import CostModel, add_swaps, timed_replay


@dataclass
class Simulation:
    """Result of replaying one plan.

    Attributes
    ----------
    peak_bytes
        predicted peak (resident + live buffers).
    forward_cost, recompute_cost, backward_cost
        compute in the model's units.
    timeline
        bytes in use after each action (without resident memory).
    labels
        the action names, aligned with ``timeline``.
    """

    peak_bytes: int
    forward_cost: float
    recompute_cost: float
    backward_cost: float
    timeline: List[int] = field(repr=False, default_factory=list)
    labels: List[str] = field(repr=False, default_factory=list)
    unit_ends: List[int] = field(repr=False, default_factory=list)
    """Index in ``timeline`` of the last action of the forward pass plus
    output unit, then of each later backward unit (advance units included)."""
    step_seconds: Optional[float] = None
    """Predicted step time under the cost model (when one was given)."""
    swapped_bytes: int = 0
    """Bytes copied to the host and back (each swapped tensor once out, and
    once in per swap-in)."""
    chunk_peak_bytes: Optional[int] = None
    """With ``simulate(..., allocator=True)``: the peak as TensorFlow's BFC
    allocator counts it, whole chunks (:mod:`memsaving.sim.allocator`),
    plus resident memory; None otherwise."""

    @property
    def compute_ratio(self) -> float:
        """Total compute relative to plain backprop (forward + backward)."""
        plain = self.forward_cost + self.backward_cost
        return (plain + self.recompute_cost) / plain if plain else 1.0


def simulate(
    model: GraphModel,
    checkpoint_ops: Iterable[int] = (),
    *,
    keep_x_gradients: bool = False,
    kept: Optional[Set[int]] = None,
    inner: Optional[Inner] = None,
    swapped: Iterable[int] = (),
    cost: Optional[CostModel] = None,
    inplace: Optional[bool] = None,
    unpinned: bool = False,
    plain: bool = False,
    allocator: bool = False,
) -> Simulation:
    """Replay the gradient computation that keeps ``checkpoint_ops``.

    With no checkpoints this is plain backprop (tf.gradients).

    Parameters
    ----------
    model
        the graph model.
    checkpoint_ops
        indices of ops whose outputs are kept.
    keep_x_gradients
        True when the gradients of ``xs`` stay alive until
        the end (returned to the caller); False when each is consumed as soon
        as it is made (e.g. applied or reduced).
    kept
        the full kept set, when already computed.
    inner
        multi-level plans (:data:`memsaving.model.schedule.Inner`): inner
        checkpoints recomputed at the start of a segment's backward.
    swapped
        tensor ids copied to the host after the forward pass and back
        before the backward pass reads them (:mod:`memsaving.sim.swap`).
    cost
        speeds of compute and transfers; with it (or with swaps) the
        step is also timed on three streams, and the peak is the timed one.
    inplace
        differentiate kept ops whose inputs are all kept where they
        are instead of recomputing them (default: only when swapping).
    unpinned
        the step runs with no order added (plain ``tf.gradients``):
        on a model whose executor runs several kernels at once, replay the
        actions in the orders :func:`memsaving.sim.executor.unpinned_orders`
        gives instead of the order they were written in, and score the one
        of median peak.
    plain
        score plain ``tf.gradients`` (:func:`memsaving.model.schedule.plain_units`):
        nothing recomputed, not even between the ops the rewrite always
        keeps; ``checkpoint_ops``, ``kept``, ``inner`` and ``swapped`` must
        be left empty.
    allocator
        also replay the step's allocations and frees through the model of
        TensorFlow's BFC allocator (:mod:`memsaving.sim.allocator`), from a
        fresh allocator, and report the peak of whole chunks in
        :attr:`Simulation.chunk_peak_bytes`; ``peak_bytes`` is unchanged.
        Not with ``swapped`` or ``cost`` (timed replays).
    """
    if plain and (kept or inner or swapped or list(checkpoint_ops)):
        raise ValueError("simulate(plain=True) scores tf.gradients itself: pass no checkpoints, kept ops, "
                         "inner checkpoints or swaps")
    if allocator and (swapped or cost is not None):
        raise ValueError("simulate(allocator=True) replays the actions in the order they are listed; a timed "
                         "replay (swapped= or cost=) overlaps them on three streams: leave allocator off there")
    if kept is None:
        kept = kept_set(model, checkpoint_ops)
    swapped = frozenset(swapped)
    key = (frozenset(kept), tuple(sorted((a, tuple(v)) for a, v in (inner or {}).items() if v)),
           keep_x_gradients, swapped, cost, inplace, unpinned, plain, allocator)
    done = model.derived("simulations", dict)
    if key not in done:
        if len(done) >= _REMEMBERED:
            del done[next(iter(done))]  # the oldest
        done[key] = _replay(model, kept, keep_x_gradients, inner, swapped, cost, inplace, unpinned, plain,
                            allocator)
    return done[key]


def peak_lower_bound(model: GraphModel) -> int:
    """Bytes below which no plan's simulated peak can go: the resident
    memory plus the largest outputs and work buffer one forward op holds
    while it runs.

    Every plan runs the whole forward pass once, and an op's outputs and
    work buffers are in use together while it runs, whatever is kept or
    recomputed later (an output written in place of a dying input still
    holds its bytes).  A budget under this bound needs no search to refuse.

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> model = chain_model([4, 16, 8])
    >>> peak_lower_bound(model)
    16
    >>> simulate(model).peak_bytes >= peak_lower_bound(model)
    True
    """
    tensors = model.tensors
    held = (sum(tensors[t].nbytes for t in op.outputs) + op.temp_bytes for op in model.ops)
    return model.resident_bytes + max(held, default=0)


_REMEMBERED = 128
"""Simulations kept per model.  The planners score the same plan from
several searches (the budget search and the lowest-peak search share their
greedy and evenly spaced plans; ``plan`` then ``gradients`` score the
chosen plan again), and a model never changes, so a plan is replayed once."""


def _replay(model: GraphModel, kept: Set[int], keep_x_gradients: bool, inner: Optional[Inner],
            swapped: FrozenSet[int], cost: Optional[CostModel], inplace: Optional[bool],
            unpinned: bool, plain: bool = False, allocator: bool = False) -> Simulation:
    """The replay behind :func:`simulate`, run once per model and plan."""
    with collector_paused():
        return _replayed(model, kept, keep_x_gradients, inner, swapped, cost, inplace, unpinned, plain, allocator)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a plan is replayed or
    searched for (and, in :func:`memsaving.gradients`, while the step is
    planned and rewritten).

    A replay makes tens of thousands of actions, lists and tuples that live
    until it returns and form no reference cycles (reference counting frees
    them); the collections their allocations trigger would only walk them
    and the rest of the heap (a traced model's graph: a full collection
    takes most of a second on a 6,000-op graph).  A collector that was off
    stays off; cycles made meanwhile are collected once it runs again."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _replayed(model: GraphModel, kept: Set[int], keep_x_gradients: bool, inner: Optional[Inner],
              swapped: FrozenSet[int], cost: Optional[CostModel], inplace: Optional[bool],
              unpinned: bool, plain: bool = False, allocator: bool = False) -> Simulation:
    """:func:`_replay`'s work."""
    if plain:
        units = plain_units(model)
    else:
        units = backward_units(model, kept, inner, inplace=bool(swapped) if inplace is None else inplace)
    pinned = {("g", x) for x in gradient_sinks(model)} if keep_x_gradients else set()
    reordered = unpinned and model.ready_gradients_early and not swapped
    # the blocks of the units earlier plans ran in the same state, and their rows, are reused
    stepped = None if swapped or reordered or cost is not None else step_blocks(model, units)
    if stepped is None:
        return _replayed_list(model, kept, units, pinned, swapped, cost, reordered, allocator)
    blocks, unit_ends = stepped
    timeline, peak, chunk_peak = _replayed_rows(block_rows(model, blocks), pinned, allocator)
    labels = list(chain.from_iterable(map(attrgetter("labels"), blocks)))
    charge(len(labels))
    # what every plan pays, summed once per model
    forward_cost, backward_cost = model.derived("step costs", lambda: (model.forward_cost(), model.backward_cost()))
    return Simulation(
        peak_bytes=model.resident_bytes + peak,
        forward_cost=forward_cost,
        recompute_cost=sum(chain.from_iterable(map(attrgetter("recomputed_costs"), blocks))),
        backward_cost=backward_cost,
        timeline=timeline,
        labels=labels,
        unit_ends=unit_ends,
        chunk_peak_bytes=None if chunk_peak is None else model.resident_bytes + chunk_peak,
    )


def _replayed_rows(rows: BufferRows, pinned: Set[Key], allocator: bool) -> Tuple[List[int], int, Optional[int]]:
    """The replay's bytes in use after each action and its peak, and, with
    ``allocator``, its peak of whole chunks in a fresh model of the BFC
    allocator (None without)."""
    if not allocator:
        return (*replay_rows(rows, pinned), None)
    timeline, peak, events = replay_with_events(rows, pinned)
    return timeline, peak, replay_allocations(events).peak


def _replayed_list(model: GraphModel, kept: Set[int], units: List[Unit], pinned: Set[Key],
                   swapped: FrozenSet[int], cost: Optional[CostModel], reordered: bool,
                   allocator: bool = False) -> Simulation:
    """:func:`_replayed` on the whole list of actions, made for the plan
    alone: a plan that is timed (swaps, a cost model), whose actions are
    replayed in the executor's order, or that is not made of blocks
    (:func:`memsaving.sim.actions.step_blocks`)."""
    actions, unit_ends = step_actions(model, kept, units)
    if reordered:
        actions, unit_ends = _median_executor_order(actions, unit_ends, pinned)
    step_seconds = timed_peak = None
    if swapped or cost is not None:
        cost = cost or CostModel()
        if swapped:
            actions = add_swaps(actions, model, swapped, len(model.ops), cost)
            unit_ends = _shifted(unit_ends, actions)
        step_seconds, timed_peak, _ = timed_replay(actions, cost, pinned)
    # the forward pass's buffers are numbered once per model
    forward = model.derived("forward buffer rows", lambda: BufferRows(forward_actions(model)))
    timeline, peak, chunk_peak = _replayed_rows(BufferRows(actions, forward), pinned, allocator)
    charge(len(actions))
    if swapped:
        peak = cast(int, timed_peak)  # swapped plans are timed above
    labels = list(map(attrgetter("label"), actions))
    forward_cost, backward_cost = model.derived("step costs", lambda: (model.forward_cost(), model.backward_cost()))
    recomputed = map(methodcaller("startswith", RECOMPUTED_LABELS), labels)
    return Simulation(
        peak_bytes=model.resident_bytes + peak,
        forward_cost=forward_cost,
        recompute_cost=sum(compress(map(attrgetter("cost"), actions), recomputed)),
        backward_cost=backward_cost,
        timeline=timeline,
        labels=labels,
        unit_ends=unit_ends,
        step_seconds=step_seconds,
        swapped_bytes=int(sum(a.cost for a in actions if a.stream != "compute")) if swapped else 0,
        chunk_peak_bytes=None if chunk_peak is None else model.resident_bytes + chunk_peak,
    )


def _median_executor_order(actions: List[Action], unit_ends: List[int],
                           pinned: Set[Key]) -> Tuple[List[Action], List[int]]:
    """The actions in the executor's order (:func:`memsaving.sim.executor.unpinned_orders`)
    whose replay has the median peak, and the unit ends in that order (a
    unit ends when all its actions have started)."""
    runs = []
    for order in unpinned_orders(actions):
        reordered = [actions[i] for i in order]
        runs.append((memory_replay(reordered, pinned)[1], order, reordered))
    runs.sort(key=lambda run: run[0])
    _, order, reordered = runs[len(runs) // 2]
    position = [0] * len(order)
    for k, j in enumerate(order):
        position[j] = k
    last_started = list(accumulate(position, max))
    return reordered, [last_started[end] for end in unit_ends]


def _shifted(unit_ends: List[int], actions: List[Action]) -> List[int]:
    """Unit boundaries after swap actions were inserted: the same compute
    actions, counted in the new list."""
    positions = [i for i, a in enumerate(actions) if a.stream == "compute"]
    return [positions[e] if e < len(positions) else len(actions) - 1 for e in unit_ends]
