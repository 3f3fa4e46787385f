"""Predicting the peak memory and compute of a gradient computation.

Every strategy (plain backprop, any checkpoint choice) is scored here, on the
neutral graph model, by replaying the step as a list of actions: the forward
ops, then each backward unit's recomputation and gradient ops.  A buffer lives
from the action that produces it to the last action that reads it, which is
how TensorFlow's executor frees memory (reference counts), so the predicted
peak is the largest sum of live buffers during any action, plus the memory
resident before the step.  Two reuses of TensorFlow's kernels are followed
when the model asks for them: elementwise kernels write into a dying input's
buffer (:func:`donations`), and weight gradients are made and consumed by
kernels of their own (:func:`consumed_at_once`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from memsaving.executor import unpinned_orders
from memsaving.graph import GraphModel, OpInfo, gradient_sinks, receives_gradient
from memsaving.schedule import Inner, Unit, backward_units, kept_set, recomputes_anchor
from memsaving.swap import CostModel, add_swaps, timed_replay

Key = Tuple


@dataclass
class Action:
    """One op run: the buffers it reads and the buffers it creates."""

    label: str
    reads: List[Key]
    writes: List[Tuple[Key, int]]
    cost: float = 0.0  # FLOPs for compute actions, bytes for transfers
    stream: str = "compute"  # or "d2h" / "h2d" (swap-out / swap-in)
    forwards_buffers: bool = False
    """The kernel may write an output into the buffer of an input of the same
    size that no later action reads (:attr:`memsaving.graph.OpInfo.forwards_input`)."""
    results: Tuple[Key, ...] = ()
    """Written result gradients made by kernels of their own
    (:attr:`memsaving.graph.GraphModel.separate_result_kernels`)."""
    temp: int = 0
    """Bytes the kernel holds only while it runs (work buffers): in use
    during the action on top of its reads and writes, freed at its end."""
    seconds: Optional[float] = None
    """Measured run time; timed replays use it instead of ``cost``."""


def op_action(op: OpInfo, label: str, reads: List[Key], writes: List[Tuple[Key, int]], backward: bool = False,
              results: Tuple[Key, ...] = (), share: int = 1) -> Action:
    """The action running ``op`` (forward or recompute) or its gradient
    (``backward``): the one place that says what an op's kernels cost.

    A forward or recompute action holds the op's forward temporary and is
    timed by its forward seconds; the backward action holds the gradient's
    temporary and is timed by the gradient's seconds.  Costs stay FLOP
    estimates (the backward ``BACKWARD_COST_FACTOR`` times the forward).
    A gradient run as ``share`` kernels (one per input) gives each kernel
    that share of the cost and time, and the whole temporary (the measured
    peak of the gradient, which one of its kernels reached)."""
    if backward:
        seconds = op.grad_seconds / share if op.grad_seconds is not None else None
        return Action(label, reads, writes, BACKWARD_COST_FACTOR * op.cost / share,
                      forwards_buffers=op.forwards_input, results=results, temp=op.grad_temp_bytes, seconds=seconds)
    return Action(label, reads, writes, op.cost, forwards_buffers=op.forwards_input, temp=op.temp_bytes,
                  seconds=op.seconds)


def saved_key(i: int, *version) -> Key:
    """Key of the memory op ``i`` keeps for its gradient
    (:attr:`memsaving.graph.OpInfo.saved_bytes`); ``version`` tells
    recomputations apart."""
    return ("w", i) + tuple(version)


@dataclass
class Simulation:
    """Result of replaying one plan.

    Attributes:
      peak_bytes: predicted peak (resident + live buffers).
      forward_cost, recompute_cost, backward_cost: compute in the model's units.
      timeline: bytes in use after each action (without resident memory).
      labels: the action names, aligned with ``timeline``.
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

    @property
    def compute_ratio(self) -> float:
        """Total compute relative to plain backprop (forward + backward)."""
        plain = self.forward_cost + self.backward_cost
        return (plain + self.recompute_cost) / plain if plain else 1.0


def donations(actions: Sequence[Action], last_read: Dict[Key, int], pinned: Set[Key] = frozenset(),
              last_end: Optional[Dict[Key, float]] = None,
              finished: Optional[Sequence[float]] = None) -> Dict[Tuple[int, Key], Key]:
    """Buffers handed over in place: ``(action index, written key) -> read
    key`` whose buffer the write takes over.

    An in-place action hands each read buffer that dies with it (it is its
    last reader by ``last_read``, the buffer is not pinned, sizes match) to
    at most one of its writes.  In timed replays (``last_end``: when each
    buffer's last reader ends; ``finished``: when each action ends), a
    buffer is handed over only if no reader ends after the action.
    """
    size: Dict[Key, int] = {key: nbytes for action in actions for key, nbytes in action.writes}
    given: Dict[Tuple[int, Key], Key] = {}
    for i, action in enumerate(actions):
        if not action.forwards_buffers:
            continue
        written = {key for key, _ in action.writes}
        donors = [key for key in dict.fromkeys(action.reads)
                  if last_read.get(key) == i and key not in pinned and key not in written and size.get(key, 0) > 0
                  and (last_end is None or last_end[key] <= finished[i])]
        for key, nbytes in action.writes:
            donor = next((d for d in donors if size[d] == nbytes), None)
            if donor is not None and nbytes > 0:
                given[i, key] = donor
                donors.remove(donor)
    return given


def result_keys(model: GraphModel, writes: Sequence[Tuple[Key, int]]) -> Tuple[Key, ...]:
    """The result gradients (``("g", x)`` keys) among a backward action's
    ``writes`` that kernels of their own make
    (:attr:`memsaving.graph.GraphModel.separate_result_kernels`)."""
    if not model.separate_result_kernels:
        return ()
    return tuple(key for key, _ in writes if len(key) == 2)


BACKWARD_COST_FACTOR = 2.0
"""Backward of an op costs about twice its forward (two products for a
matmul or convolution); used to report compute, not to pick plans."""


def simulate(
    model: GraphModel,
    checkpoint_ops: Iterable[int] = (),
    keep_x_gradients: bool = False,
    kept: Optional[Set[int]] = None,
    inner: Optional[Inner] = None,
    swapped: Iterable[int] = (),
    cost: Optional[CostModel] = None,
    inplace: Optional[bool] = None,
    unpinned: bool = False,
) -> Simulation:
    """Replay the gradient computation that keeps ``checkpoint_ops``.

    With no checkpoints this is plain backprop (tf.gradients).

    Args:
      model: the graph model.
      checkpoint_ops: indices of ops whose outputs are kept.
      keep_x_gradients: True when the gradients of ``xs`` stay alive until
        the end (returned to the caller); False when each is consumed as soon
        as it is made (e.g. applied or reduced).
      kept: the full kept set, when already computed.
      inner: multi-level plans (:data:`memsaving.schedule.Inner`): inner
        checkpoints recomputed at the start of a segment's backward.
      swapped: tensor ids copied to the host after the forward pass and back
        before the backward pass reads them (:mod:`memsaving.swap`).
      cost: speeds of compute and transfers; with it (or with swaps) the
        step is also timed on three streams, and the peak is the timed one.
      inplace: differentiate kept ops whose inputs are all kept where they
        are instead of recomputing them (default: only when swapping).
      unpinned: the step runs with no order added (plain ``tf.gradients``):
        on a model whose executor runs several kernels at once, replay the
        actions in the orders :func:`memsaving.executor.unpinned_orders`
        gives instead of the order they were written in, and score the one
        of median peak.
    """
    if kept is None:
        kept = kept_set(model, checkpoint_ops)
    swapped = set(swapped)
    units = backward_units(model, kept, inner, inplace=bool(swapped) if inplace is None else inplace)
    actions, unit_ends = _actions(model, kept, units)
    pinned = {("g", x) for x in gradient_sinks(model)} if keep_x_gradients else set()
    if unpinned and model.ready_gradients_early and not swapped:
        actions, unit_ends = _median_executor_order(actions, unit_ends, pinned)
    step_seconds = timed_peak = None
    if swapped or cost is not None:
        cost = cost or CostModel()
        if swapped:
            actions = add_swaps(actions, model, swapped, len(model.ops), cost)
            unit_ends = _shifted(unit_ends, actions)
        step_seconds, timed_peak, _ = timed_replay(actions, cost, pinned)
    timeline, peak = memory_replay(actions, pinned)
    if swapped:
        peak = timed_peak
    forward_cost = sum(op.cost for op in model.ops)
    recompute = sum(a.cost for a in actions if a.label.startswith(("recompute ", "advance ")))
    backward = BACKWARD_COST_FACTOR * sum(op.cost for op in model.ops if op.forward)
    return Simulation(
        peak_bytes=model.resident_bytes + peak,
        forward_cost=forward_cost,
        recompute_cost=recompute,
        backward_cost=backward,
        timeline=timeline,
        labels=[a.label for a in actions],
        unit_ends=unit_ends,
        step_seconds=step_seconds,
        swapped_bytes=int(sum(a.cost for a in actions if a.stream != "compute")),
    )


def _median_executor_order(actions: List[Action], unit_ends: List[int],
                           pinned: Set[Key]) -> Tuple[List[Action], List[int]]:
    """The actions in the executor's order (:func:`memsaving.executor.unpinned_orders`)
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


def _actions(model: GraphModel, kept: Set[int], units: List[Unit]) -> Tuple[List[Action], List[int]]:
    tensors = model.tensors
    xs = gradient_sinks(model)  # their gradients are results, one buffer each
    actions: List[Action] = []
    for i, op in enumerate(model.ops):
        reads = [("f", t) for t in op.inputs if tensors[t].producer >= 0]
        writes = [(("f", t), tensors[t].nbytes) for t in op.outputs]
        if op.saved_bytes and op.forward:
            writes.append((saved_key(i), op.saved_bytes))
        actions.append(op_action(op, f"forward {op.name}", reads, writes))

    grad_version: Dict[int, int] = {}

    def grad_key(t):
        return ("g", t, grad_version[t]) if t not in xs else ("g", t)

    def add_gradient(t: int, reads: List[Key], writes: List[Tuple[Key, int]]):
        """Contribution to the gradient of ``t``: a new buffer replacing the old sum."""
        if t in xs:
            writes.append((("g", t), tensors[t].gradient_bytes))
            return
        if t in grad_version:
            reads.append(grad_key(t))
            grad_version[t] += 1
        else:
            grad_version[t] = 0
        writes.append((grad_key(t), 0 if tensors[t].folded_gradient else tensors[t].gradient_bytes))

    seed_writes: List[Tuple[Key, int]] = []
    for y in model.ys:
        if tensors[y].trainable:
            add_gradient(y, [], seed_writes)
    actions.append(Action("seed gradients", [], seed_writes))

    sources: Dict[int, Key] = {}  # inner checkpoints rebuilt by advance units
    unit_ends: List[int] = []

    def source(t: int, local: Dict[int, Key]) -> Key:
        return local.get(t) or sources.get(t) or ("f", t)

    def differentiate(i: int, local: Dict[int, Key], label: str):
        op = model.ops[i]
        incoming = [grad_key(t) for t in op.outputs if t in grad_version]
        if not incoming:
            return
        saved = []
        if op.saved_bytes:
            key = saved_key(i)
            saved.append(local.get(key) or sources.get(key) or key)
        # a kernel per input gradient when the executor runs each when it is ready, else one for all
        split = bool(op.input_grad_reads) and model.ready_gradients_early
        kernels = [(k,) for k in range(len(op.inputs))] if split else [tuple(range(len(op.inputs)))]
        for inputs in kernels:
            targets = [op.inputs[k] for k in inputs if receives_gradient(model, op.inputs[k], xs)]
            if not targets:
                continue
            read = op.input_grad_reads[inputs[0]] if split else op.grad_reads
            reads: List[Key] = incoming + [source(t, local) for t in read] + saved
            writes: List[Tuple[Key, int]] = []
            for t in targets:
                add_gradient(t, reads, writes)
            actions.append(op_action(op, f"{label} {op.name}", reads, writes, backward=True,
                                     results=result_keys(model, writes), share=len(kernels)))

    for unit in units:
        local: Dict[int, Key] = {}
        recompute_start = len(actions)
        if unit.kind in ("segment", "advance"):
            tag = "c" if unit.kind == "segment" else "a"
            label = "recompute" if unit.kind == "segment" else "advance"
            for i in unit.ops:
                op = model.ops[i]
                if i == unit.anchor and unit.kind == "segment" and not recomputes_anchor(op.type):
                    continue  # kept: its gradient reads the kept outputs
                reads = [source(t, local) for t in op.inputs if tensors[t].producer >= 0]
                # the copies wait on the anchor's output gradient
                reads += [grad_key(t) for t in model.ops[unit.anchor].outputs if t in grad_version]
                writes = []
                for t in op.outputs:
                    local[t] = (tag, unit.anchor, t)
                    writes.append((local[t], tensors[t].nbytes))
                if op.saved_bytes and unit.kind == "segment":  # advance copies are not differentiated
                    local[saved_key(i)] = saved_key(i, tag, unit.anchor)
                    writes.append((local[saved_key(i)], op.saved_bytes))
                actions.append(op_action(op, f"{label} {op.name}", reads, writes))
        if unit.kind == "advance":
            sources.update(local)
        else:
            recompute_end = len(actions)
            for i in reversed(unit.ops):
                differentiate(i, local, "backward")
            if unit.kind == "segment" and model.ready_gradients_early:
                actions[recompute_start:] = ready_gradients_first(actions[recompute_start:recompute_end],
                                                                  actions[recompute_end:])
        unit_ends.append(len(actions) - 1)
    if not units or units[0].kind != "output":
        unit_ends.insert(0, len(model.ops))  # the seed: the forward pass ends there
    return _pin_view_bases(model, actions), unit_ends


def ready_gradients_first(recompute: List[Action], backward: List[Action]) -> List[Action]:
    """A segment's actions in the order a parallel executor runs them: the
    gradient kernels that read nothing the recomputation makes (a Dense
    layer's data gradient reads the incoming gradient and the weight), then
    the recomputation, then the rest of the segment's gradient.

    Those kernels are ready when the segment's incoming gradient is, as the
    recomputation is; a free thread runs them at once, and what they make
    is held through the recomputation.

    Examples
    --------
    >>> recompute = [Action("recompute a", [], [(("c", 1), 4)])]
    >>> backward = [Action("dW", [("g", 2), ("c", 1)], [(("g", 0), 4)]),
    ...             Action("dx", [("g", 2), ("f", 9)], [(("g", 1), 4)])]
    >>> [a.label for a in ready_gradients_first(recompute, backward)]
    ['dx', 'recompute a', 'dW']
    """
    waiting = {key for action in recompute for key, _ in action.writes}
    ready, late = [], []
    for action in backward:
        if any(key in waiting for key in action.reads):
            late.append(action)
            waiting.update(key for key, _ in action.writes)
        else:
            ready.append(action)
    return ready + recompute + late


def _view_bases(model: GraphModel) -> Dict[int, int]:
    """Each view (an output of an aliasing op: Reshape, ExpandDims, Squeeze,
    Identity..., 0 bytes of its own) -> the tensor whose buffer it shares."""
    base: Dict[int, int] = {}
    for op in model.ops:
        if not op.inputs:
            continue
        for k, t in enumerate(op.outputs):
            # IdentityN: the k-th output views the k-th input; other views their first input
            source = op.inputs[k] if len(op.inputs) == len(op.outputs) else op.inputs[0]
            if model.tensors[source].producer < 0:
                continue  # a variable read or a view of an input: resident anyway
            info = model.tensors[t]
            if info.nbytes == 0 and info.value_bytes is not None:
                base[t] = base.get(source, source)
    return base


def _pin_view_bases(model: GraphModel, actions: List[Action]) -> List[Action]:
    """Make every read of a view also read the buffer it shares.

    A view has no bytes of its own, but TensorFlow frees a buffer only when
    its last view is gone: a kept view (a checkpoint on a Reshape, as Keras
    puts around a Dense on 3-D inputs, Conv1D's ExpandDims/Squeeze, attention
    heads) keeps the activation it views alive until its segment.  Counted
    free, such views would look like the cheapest checkpoints of all."""
    base = _view_bases(model)
    if not base:
        return actions
    written = {key for action in actions for key, _ in action.writes}
    pinned = []
    for action in actions:
        extra = []
        for key in action.reads:
            if key[0] not in ("f", "c", "a") or key[-1] not in base:
                continue
            same_copy = key[:-1] + (base[key[-1]],)  # the base recomputed with the view
            target = same_copy if same_copy in written else ("f", base[key[-1]])
            if target in written and target not in action.reads and target not in extra:
                extra.append(target)
        pinned.append(replace(action, reads=list(action.reads) + extra) if extra else action)
    return pinned


def consumed_at_once(key: Key, action: Action, i: int, last_read: Dict[Key, int], pinned: Set[Key]) -> bool:
    """A result gradient (one of ``action.results``) that action ``i`` writes, nothing
    reads afterwards and the caller does not keep (``keep_x_gradients``
    False): it is made and consumed (applied, reduced) by its own kernel,
    before the op's other gradient kernels allocate, so it adds to the peak
    on its own.  A weight gradient and the gradient of the layer's input are
    separate kernels; on a swapping MLP TensorFlow ran the weight gradient
    and its reduction first (measured peak 0.76 MiB, 1.00 had both been
    held together)."""
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
    dies_at: Dict[int, List[Key]] = {}
    for i, action in enumerate(actions):
        for key, _ in action.writes:
            if key not in pinned:
                dies_at.setdefault(max(last_read.get(key, i), i), []).append(key)
    given = donations(actions, last_read, pinned)
    live: Dict[Key, int] = {}
    in_use = 0
    peak = 0
    timeline = []
    for i, action in enumerate(actions):
        transient = {key: nbytes for key, nbytes in action.writes
                     if consumed_at_once(key, action, i, last_read, pinned)}
        peak = max(peak, in_use + max(transient.values(), default=0))
        for key, nbytes in action.writes:
            if key in transient:
                continue
            donor = given.get((i, key))
            if donor is not None:
                in_use -= live.pop(donor, 0)  # the write takes over its buffer
            in_use += nbytes - live.get(key, 0)
            live[key] = nbytes
        peak = max(peak, in_use + action.temp)  # the kernel's work buffers, freed when it ends
        for key in dies_at.get(i, ()):
            in_use -= live.pop(key, 0)
        timeline.append(in_use)
    return timeline, peak
