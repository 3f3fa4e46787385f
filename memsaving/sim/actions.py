"""The actions of one gradient step on the neutral graph model: the forward
ops, then each backward unit's recomputation and gradient ops, with the
buffers each reads and writes (:mod:`memsaving.model.buffers`).

The simulator replays these lists to score a plan; the swap planner reads
them to find what a plan keeps between the passes.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

from memsaving.model.buffers import Action, Key, with_reads
from memsaving.model.graph import BACKWARD_COST_FACTOR, GraphModel, OpInfo, gradient_sinks, receives_gradient
from memsaving.model.schedule import RECOMPUTING, Unit, UnitKind, recomputes_anchor


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
    (:attr:`memsaving.model.graph.OpInfo.saved_bytes`); ``version`` tells
    recomputations apart."""
    return ("w", i) + tuple(version)


def result_keys(model: GraphModel, writes: Sequence[Tuple[Key, int]]) -> Tuple[Key, ...]:
    """The result gradients (``("g", x)`` keys) among a backward action's
    ``writes`` that kernels of their own make
    (:attr:`memsaving.model.graph.GraphModel.separate_result_kernels`)."""
    if not model.separate_result_kernels:
        return ()
    return tuple(key for key, _ in writes if len(key) == 2)


class GradientBuffers:
    """The gradient buffers of one step, with eager accumulation: the one
    rule for how gradient contributions are named and summed.

    A tensor with several consumers gets one contribution from each
    consumer's gradient; each contribution reads the running sum and writes
    the new sum into a new buffer (``("g", t, version)``), so the previous
    version dies with it.  The gradients of :func:`memsaving.model.graph.gradient_sinks`
    are results, one buffer each (``("g", x)``).  A gradient folded into a
    constant (:attr:`memsaving.model.graph.TensorInfo.folded_gradient`) takes
    no bytes in the step: it is counted in the model's resident bytes.

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> grads = GradientBuffers(chain_model([4, 4]))
    >>> y = grads.model.ys[0]
    >>> reads, writes = [], []
    >>> grads.add(y, reads, writes); grads.add(y, reads, writes)
    >>> reads, [key for key, _ in writes]
    ([('g', 2, 0)], [('g', 2, 0), ('g', 2, 1)])
    """

    def __init__(self, model: GraphModel):
        self.model = model
        self.sinks = gradient_sinks(model)
        self.version: Dict[int, int] = {}

    def has(self, t: int) -> bool:
        """Whether a contribution to ``t``'s gradient (not a result's) was written."""
        return t in self.version

    def key(self, t: int) -> Key:
        """The buffer holding ``t``'s gradient so far."""
        return ("g", t) if t in self.sinks else ("g", t, self.version[t])

    def add(self, t: int, reads: List[Key], writes: List[Tuple[Key, int]]) -> None:
        """One contribution to ``t``'s gradient, by the action whose
        ``reads`` and ``writes`` are given: it reads the running sum, if
        any, and writes the new sum."""
        info = self.model.tensors[t]
        if t in self.sinks:
            writes.append((("g", t), info.gradient_bytes))
            return
        if t in self.version:
            reads.append(self.key(t))
            self.version[t] += 1
        else:
            self.version[t] = 0
        writes.append((self.key(t), 0 if info.folded_gradient else info.gradient_bytes))


def step_actions(model: GraphModel, kept: Set[int], units: List[Unit]) -> Tuple[List[Action], List[int]]:
    """The step's actions when ``kept`` ops' outputs are kept and the
    backward pass runs ``units`` (:func:`memsaving.model.schedule.backward_units`),
    and the index of the last action of each unit (the first entry is the
    end of the forward pass when the first unit is not the output unit)."""
    tensors = model.tensors
    forward, forward_written = model.derived("forward actions", lambda: _forward_actions(model))
    actions: List[Action] = list(forward)

    grads = GradientBuffers(model)
    seed_writes: List[Tuple[Key, int]] = []
    for y in model.ys:
        if tensors[y].trainable:
            grads.add(y, [], seed_writes)
    actions.append(Action("seed gradients", [], seed_writes))

    sources: Dict[int, Key] = {}  # inner checkpoints rebuilt by advance units
    unit_ends: List[int] = []

    def source(t: int, local: Dict[int, Key]) -> Key:
        return local.get(t) or sources.get(t) or ("f", t)

    def differentiate(i: int, local: Dict[int, Key], label: str):
        op = model.ops[i]
        incoming = [grads.key(t) for t in op.outputs if grads.has(t)]
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
            targets = [op.inputs[k] for k in inputs if receives_gradient(model, op.inputs[k], grads.sinks)]
            if not targets:
                continue
            read = op.input_grad_reads[inputs[0]] if split else op.grad_reads
            reads: List[Key] = incoming + [source(t, local) for t in read] + saved
            writes: List[Tuple[Key, int]] = []
            for t in targets:
                grads.add(t, reads, writes)
            actions.append(op_action(op, f"{label} {op.name}", reads, writes, backward=True,
                                     results=result_keys(model, writes), share=len(kernels)))

    for unit in units:
        local: Dict[int, Key] = {}
        recompute_start = len(actions)
        if unit.kind in RECOMPUTING:
            tag = "c" if unit.kind == UnitKind.SEGMENT else "a"
            label = "recompute" if unit.kind == UnitKind.SEGMENT else "advance"
            for i in unit.ops:
                op = model.ops[i]
                if i == unit.anchor and unit.kind == UnitKind.SEGMENT and not recomputes_anchor(op.type):
                    continue  # kept: its gradient reads the kept outputs
                reads = [source(t, local) for t in op.inputs if tensors[t].producer >= 0]
                # the copies wait on the anchor's output gradient
                reads += [grads.key(t) for t in model.ops[unit.anchor].outputs if grads.has(t)]
                writes = []
                for t in op.outputs:
                    local[t] = (tag, unit.anchor, t)
                    writes.append((local[t], tensors[t].nbytes))
                if op.saved_bytes and unit.kind == UnitKind.SEGMENT:  # advance copies are not differentiated
                    local[saved_key(i)] = saved_key(i, tag, unit.anchor)
                    writes.append((local[saved_key(i)], op.saved_bytes))
                actions.append(op_action(op, f"{label} {op.name}", reads, writes))
        if unit.kind == UnitKind.ADVANCE:
            sources.update(local)
        else:
            recompute_end = len(actions)
            for i in reversed(unit.ops):
                differentiate(i, local, "backward")
            if unit.kind == UnitKind.SEGMENT and model.ready_gradients_early:
                actions[recompute_start:] = ready_gradients_first(actions[recompute_start:recompute_end],
                                                                  actions[recompute_end:])
        unit_ends.append(len(actions) - 1)
    if not units or units[0].kind != UnitKind.OUTPUT:
        unit_ends.insert(0, len(model.ops))  # the seed: the forward pass ends there
    backward = actions[len(forward):]
    return forward + _pin_view_bases(model, backward, forward_written), unit_ends


def _forward_actions(model: GraphModel) -> Tuple[List[Action], Set[Key]]:
    """The forward pass's actions, the same in every plan (views pinned,
    see :func:`_pin_view_bases`), and the keys they write."""
    tensors = model.tensors
    actions: List[Action] = []
    for i, op in enumerate(model.ops):
        reads = [("f", t) for t in op.inputs if tensors[t].producer >= 0]
        writes = [(("f", t), tensors[t].nbytes) for t in op.outputs]
        if op.saved_bytes and op.forward:
            writes.append((saved_key(i), op.saved_bytes))
        actions.append(op_action(op, f"forward {op.name}", reads, writes))
    written = {key for action in actions for key, _ in action.writes}
    return _pin_view_bases(model, actions, written), written


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


def _pin_view_bases(model: GraphModel, actions: List[Action], written_before: Set[Key]) -> List[Action]:
    """Make every read of a view also read the buffer it shares.

    A view has no bytes of its own, but TensorFlow frees a buffer only when
    its last view is gone: a kept view (a checkpoint on a Reshape, as Keras
    puts around a Dense on 3-D inputs, Conv1D's ExpandDims/Squeeze, attention
    heads) keeps the activation it views alive until its segment.  Counted
    free, such views would look like the cheapest checkpoints of all.

    ``written_before``: the keys written by the actions of the step that
    come before ``actions`` (the forward pass, for the backward actions).
    """
    base = model.derived("view bases", lambda: _view_bases(model))
    if not base:
        return actions
    written = written_before | {key for action in actions for key, _ in action.writes}
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
        pinned.append(with_reads(action, list(action.reads) + extra) if extra else action)
    return pinned
