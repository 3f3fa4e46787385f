"""Scoring an arbitrary schedule with the simulator's memory rules.

:func:`memsaving.sim.simulate.simulate` scores checkpoint *plans*: it derives the
order of recomputations itself.  Exact references such as the Checkmate MILP
(:mod:`memsaving.references.milp`) produce a *schedule* instead, any order of forward
computations (first runs and recomputations) and backward ops.  Replaying
that schedule here, with the same :class:`~memsaving.model.buffers.Action` list
and the same :func:`~memsaving.model.buffers.memory_replay`, puts both kinds of results
on one scale: a buffer lives from the action that writes it to the last
action that reads it, and gradient contributions to a tensor with several
consumers are summed eagerly (each contribution writes a new version and
the previous version dies), exactly as in ``simulate``.

A schedule is a list of events ``("forward", op_index)`` (compute the op's
outputs, again if it ran before) and ``("backward", op_index)`` (run the
op's gradient once, after every op that contributes to its outputs'
gradients).  Each computation of an op writes fresh buffers, and readers see
the latest computation, so a recomputed tensor and the original are two
buffers with their own lifetimes.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Set, Tuple

from memsaving.model.graph import GraphModel, gradient_ops, gradient_sinks, receives_gradient
from memsaving.model.schedule import UnitKind, backward_units, kept_set, recomputes_anchor
from memsaving.sim.actions import GradientBuffers, op_action, result_keys, saved_key
from memsaving.model.buffers import Action, Key, memory_replay
from memsaving.sim.simulate import Simulation

Event = Tuple[str, int]


def plain_schedule(model: GraphModel) -> List[Event]:
    """Plain backprop: every op forward in order, then every gradient in
    reverse order (what ``simulate(model)`` replays when nothing is kept
    and every op can be copied)."""
    backward = sorted(gradient_ops(model), reverse=True)
    return [("forward", i) for i in range(len(model.ops))] + [("backward", i) for i in backward]


def plan_schedule(model: GraphModel, checkpoint_ops: Iterable[int] = (), drop_unread: bool = False) -> List[Event]:
    """The events ``simulate(model, checkpoint_ops)`` scores, as a schedule.

    The forward pass, then each backward unit of the single-level plan: a
    segment's recomputations followed by its gradients in reverse order
    (the kept anchor is not recomputed, except for the op types
    :func:`memsaving.model.schedule.recomputes_anchor` names).  Replayed by
    :func:`simulate_schedule` it gives ``simulate``'s peak and costs.

    With ``drop_unread``, recomputations whose outputs nothing reads before
    the op runs again are left out: what the plan would cost without them.
    """
    needed = gradient_ops(model)
    events = [("forward", i) for i in range(len(model.ops))]
    for unit in backward_units(model, kept_set(model, checkpoint_ops)):
        if unit.kind == UnitKind.SEGMENT:
            # the kept anchor is not recomputed (schedule.recomputes_anchor)
            events += [("forward", i) for i in unit.ops
                       if i != unit.anchor or recomputes_anchor(model.ops[i].type)]
        events += [("backward", i) for i in reversed(unit.ops) if i in needed]
    return _without_unread(model, events) if drop_unread else events


def _without_unread(model: GraphModel, events: List[Event]) -> List[Event]:
    """``events`` without the recomputations nobody reads (scanned from the
    end, so a recomputation only feeding dropped ones is dropped too)."""
    first: Dict[int, int] = {}  # each op's first recomputation (index into events)
    for k, (kind, i) in enumerate(events):
        if kind == "forward":
            first.setdefault(i, k)
    producers = lambda ts: {model.tensors[t].producer for t in ts if model.tensors[t].producer >= 0}  # noqa: E731
    wanted: Set[int] = set()
    kept: List[Event] = []
    for k in range(len(events) - 1, -1, -1):
        kind, i = events[k]
        if kind == "backward":
            wanted |= producers(model.ops[i].grad_reads)
        elif first[i] == k or i in wanted:
            wanted.discard(i)
            wanted |= producers(model.ops[i].inputs)
        else:
            continue
        kept.append(events[k])
    return kept[::-1]


def simulate_schedule(model: GraphModel, events: Iterable[Event], keep_x_gradients: bool = False) -> Simulation:
    """Peak memory and compute of running ``events`` in order.

    Costs are reported like ``simulate``: ``forward_cost`` is one run of
    every op, ``recompute_cost`` the cost of every further run and
    ``backward_cost`` :meth:`~memsaving.model.graph.GraphModel.backward_cost`.

    Raises
    ------
    ValueError
        the schedule reads a tensor before it is computed, runs a
        gradient twice or before its outputs' gradients are complete, or
        leaves an op never computed or a needed gradient never run.
    """
    actions = schedule_actions(model, list(events))
    pinned = {("g", x) for x in gradient_sinks(model)} if keep_x_gradients else set()
    timeline, peak = memory_replay(actions, pinned)
    recompute = sum(a.cost for a in actions if a.label.startswith("recompute "))
    return Simulation(
        peak_bytes=model.resident_bytes + peak,
        forward_cost=model.forward_cost(),
        recompute_cost=recompute,
        backward_cost=model.backward_cost(),
        timeline=timeline,
        labels=[a.label for a in actions],
    )


def schedule_actions(model: GraphModel, events: Sequence[Event]) -> List[Action]:
    """The simulator actions of ``events``; the loss seed is written just
    before the first backward event (right after the forward pass in a plain
    schedule, as in ``simulate``)."""
    needed = gradient_ops(model)
    pending = _pending_contributions(model, needed)
    runs = [0] * len(model.ops)
    grads = GradientBuffers(model)
    done: Set[int] = set()
    actions: List[Action] = []
    for kind, i in events:
        if kind == "forward":
            actions.append(_forward_action(model, i, runs))
        elif kind == "backward":
            if not done:
                actions.append(_seed_action(model, grads))
            actions.append(_backward_action(model, i, runs, grads, needed, pending, done))
        else:
            raise ValueError(f"unknown event kind {kind!r} (use 'forward' or 'backward')")
    never = [model.ops[i].name for i in range(len(model.ops)) if runs[i] == 0]
    missing = [model.ops[i].name for i in sorted(needed - done)]
    if never or missing:
        raise ValueError(f"incomplete schedule: never computed {never[:5]}, gradients never run {missing[:5]}")
    return actions


def _pending_contributions(model: GraphModel, needed: Set[int]) -> Dict[int, int]:
    """For each gradient op, how many gradient ops must run before it (the
    consumers that add to its outputs' gradients)."""
    xs = gradient_sinks(model)
    pending = {i: 0 for i in needed}
    for j in needed:
        for t in model.ops[j].inputs:  # one contribution per input slot, as ``_backward_action`` adds
            producer = model.tensors[t].producer
            if producer in pending and t not in xs and receives_gradient(model, t, xs):
                pending[producer] += 1
    return pending


def _tensor_key(model: GraphModel, t: int, runs: List[int], reader: str) -> Key:
    producer = model.tensors[t].producer
    if runs[producer] == 0:
        raise ValueError(f"{reader} reads {model.tensors[t].name} before {model.ops[producer].name} is computed")
    return ("f", t, runs[producer])


def _forward_action(model: GraphModel, i: int, runs: List[int]) -> Action:
    op = model.ops[i]
    reads = [_tensor_key(model, t, runs, op.name) for t in op.inputs if model.tensors[t].producer >= 0]
    label = "forward" if runs[i] == 0 else "recompute"
    runs[i] += 1
    writes = [(("f", t, runs[i]), model.tensors[t].nbytes) for t in op.outputs]
    if op.saved_bytes and op.forward:
        writes.append((saved_key(i, runs[i]), op.saved_bytes))
    return op_action(op, f"{label} {op.name}", reads, writes)


def _seed_action(model: GraphModel, grads: GradientBuffers) -> Action:
    writes: List[Tuple[Key, int]] = []
    for y in model.ys:
        if model.tensors[y].trainable:
            grads.add(y, [], writes)
    return Action("seed gradients", [], writes)


def _backward_action(model: GraphModel, i: int, runs: List[int], grads: GradientBuffers, needed: Set[int],
                     pending: Dict[int, int], done: Set[int]) -> Action:
    op = model.ops[i]
    if i not in needed:
        raise ValueError(f"{op.name} has no gradient to run")
    if i in done:
        raise ValueError(f"gradient of {op.name} runs twice")
    if pending[i]:
        raise ValueError(f"gradient of {op.name} runs before {pending[i]} of its consumers' gradients")
    done.add(i)
    reads = [grads.key(t) for t in op.outputs if grads.has(t)]
    reads += [_tensor_key(model, t, runs, f"gradient of {op.name}") for t in op.grad_reads
              if model.tensors[t].producer >= 0]
    if op.saved_bytes:
        reads.append(saved_key(i, runs[i]))  # what the latest computation kept
    writes: List[Tuple[Key, int]] = []
    for t in op.inputs:
        if receives_gradient(model, t, grads.sinks):
            grads.add(t, reads, writes)
            producer = model.tensors[t].producer
            if producer in pending and t not in grads.sinks:
                pending[producer] -= 1
    return op_action(op, f"backward {op.name}", reads, writes, backward=True, results=result_keys(model, writes))
