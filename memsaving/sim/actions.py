"""The actions of one gradient step on the neutral graph model: the forward
ops, then each backward unit's recomputation and gradient ops, with the
buffers each reads and writes (:mod:`memsaving.model.buffers`).

The simulator replays these lists to score a plan; the swap planner reads
them to find what a plan keeps between the passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Container, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple, Union

from memsaving.model.buffers import Action, BufferRows, Key, on_buffers, with_reads
from memsaving.model.graph import (
    GraphModel, OpInfo, gradient_sinks, receives_gradient, shared_results,
)
from memsaving.model.schedule import RECOMPUTING, Unit, UnitKind, recomputes_anchor
from memsaving.sim.blocks import UnitBlock, UnitMemo, runs


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
        return Action(label, reads, writes, op.gradient_cost / share,
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
    are results, one buffer each (``("g", x)``), except that the contributions
    to a result several sinks feed (:func:`memsaving.model.graph.shared_results`:
    a variable read twice) are summed as they arrive, each partial sum in a
    buffer of its own (``("g", x, "partial", k)``) held until the next, and
    the last writes the result.  A gradient folded into a
    constant (:attr:`memsaving.model.graph.TensorInfo.folded_gradient`) takes
    no bytes in the step: it is counted in the model's resident bytes.

    Examples
    --------
    >>> from memsaving.model.graph import chain_model
    >>> grads = GradientBuffers(chain_model([4, 4]))
    >>> y = grads.model.ys[0]
    >>> reads, writes = [], []
    >>> grads.add(y, reads, writes); grads.add(y, reads, writes)
    >>> reads, [key for key, _ in writes], grads.current([1, y])
    ([('g', 2, 0)], [('g', 2, 0), ('g', 2, 1)], [('g', 2, 1)])
    """

    def __init__(self, model: GraphModel):
        self.model = model
        self.sinks, self.nbytes = model.derived("gradient buffers", lambda: _gradient_buffers(model))
        self.shared = shared_results_of(model)
        self.latest: Dict[int, Key] = {}
        """Each tensor's running sum so far (the key object itself, so the
        replay's look-ups of a buffer written and read find the same one)."""
        self.partial: Dict[int, Tuple[int, Key, int]] = {}
        """For each shared result (by its ``x``): the contributions summed so
        far, the buffer holding their sum and its bytes."""

    def has(self, t: int) -> bool:
        """Whether a contribution to ``t``'s gradient (not a result's) was written."""
        return t in self.latest

    def key(self, t: int) -> Key:
        """The buffer holding ``t``'s gradient so far."""
        return ("g", t) if t in self.sinks else self.latest[t]

    def current(self, tensors: Iterable[int]) -> List[Key]:
        """The buffers holding the gradients so far of those of ``tensors``
        that have a contribution (:meth:`has`), in order."""
        latest = self.latest
        return [latest[t] for t in tensors if t in latest]

    def add(self, t: int, reads: List[Key], writes: List[Tuple[Key, int]]) -> None:
        """One contribution to ``t``'s gradient, by the action whose
        ``reads`` and ``writes`` are given: it reads the running sum, if
        any, and writes the new sum."""
        if t in self.sinks:
            shared = self.shared.get(t)
            if shared is None:
                writes.append((("g", t), self.nbytes[t]))
            else:
                self._add_to_shared(t, *shared, reads, writes)
            return
        previous = self.latest.get(t)
        if previous is None:
            key = ("g", t, 0)
        else:
            reads.append(previous)
            key = ("g", t, previous[2] + 1)
        self.latest[t] = key
        writes.append((key, self.nbytes[t]))

    def _add_to_shared(self, t: int, x: int, contributions: int, reads: List[Key],
                       writes: List[Tuple[Key, int]]) -> None:
        """One contribution, through sink ``t``, to the result of ``x`` that
        ``contributions`` gradients sum into: it reads the partial sum, if
        any, and writes the next one, or the result when it is the last.  A
        sum is as large as its largest term (a lookup's sparse gradient
        added to a dense one is made dense)."""
        done, held, nbytes = self.partial.get(x, (0, None, 0))
        nbytes = max(nbytes, self.nbytes[t])
        if held is not None:
            reads.append(held)
        key = ("g", t) if done + 1 >= contributions else ("g", x, "partial", done)
        self.partial[x] = (done + 1, key, nbytes)
        writes.append((key, nbytes))


def shared_results_of(model: GraphModel) -> Dict[int, Tuple[int, int]]:
    """:func:`memsaving.model.graph.shared_results`, found once per model."""
    return model.derived("shared results", lambda: shared_results(model))


def _gradient_buffers(model: GraphModel) -> Tuple[FrozenSet[int], Dict[int, int]]:
    """The gradient sinks and each tensor's gradient buffer bytes (a
    result's full size; 0 for other folded gradients), for :class:`GradientBuffers`."""
    sinks = frozenset(gradient_sinks(model))

    def nbytes(t: int) -> int:
        info = model.tensors[t]
        return info.gradient_bytes if t in sinks or not info.folded_gradient else 0

    return sinks, _Memo(nbytes)


class _Memo(dict):
    """A dict filling itself with ``compute(key)`` on a miss (tensor ids
    may be the keys of a dict or the indices of a list)."""

    def __init__(self, compute: Callable[[Any], Any]):
        super().__init__()
        self.compute = compute

    def __missing__(self, key: Any) -> Any:
        value = self[key] = self.compute(key)
        return value


@dataclass(frozen=True)
class _GradientKernel:
    """One kernel of an op's gradient that writes gradients: the inputs it
    makes them for and the forward tensors it reads."""

    targets: Tuple[int, ...]
    reads: Tuple[int, ...]
    makes_results: bool
    """Some target is a gradient sink and the model makes results with
    kernels of their own (:func:`result_keys` may find some)."""
    reads_views: bool
    """Some tensor it reads is a view (:func:`_pin_view_bases` looks at it)."""


@dataclass(frozen=True)
class _OpKernels:
    """What an op's actions are in every plan, made once per model: each
    kind of run with its label and cost (:func:`op_action`, on no buffers
    yet), the buffers it reads and writes by tensor, the gradient's
    kernels.  A plan only chooses which buffers they are
    (:func:`memsaving.model.buffers.on_buffers`)."""

    recompute: Action
    advance: Action
    backward: Action
    updating: Tuple[Action, ...]
    """Per gradient kernel, its backward action with the optimizer's update
    of the results it makes (:attr:`memsaving.model.graph.GraphModel.update_factor`)."""
    inputs: Tuple[int, ...]
    """The inputs some op of the step makes (the others are resident)."""
    outputs: Tuple[int, ...]
    output_bytes: Tuple[Tuple[int, int], ...]
    """Each output and its bytes."""
    saved_bytes: int
    kernels: Tuple[_GradientKernel, ...]
    recomputed_as_anchor: bool
    """A segment recomputes the op even when it anchors it (:func:`recomputes_anchor`)."""
    reads_views: bool
    """Some input is a view (:func:`_pin_view_bases` looks at its copies)."""
    targets: Tuple[int, ...]
    """The tensors its gradient kernels add gradient to."""
    gradient_tensors: Tuple[int, ...]
    """The outputs and the targets: the tensors whose gradient buffers its
    gradient reads or adds to."""


def _op_kernels(model: GraphModel) -> List[_OpKernels]:
    """:class:`_OpKernels` of every op.

    The gradient runs a kernel per input gradient when the executor runs
    each when it is ready (:attr:`memsaving.model.graph.OpInfo.input_grad_reads`
    with ``ready_gradients_early``), else one for all; each kernel has its
    share of the cost, and kernels making no gradient are left out."""
    sinks = frozenset(gradient_sinks(model))
    views = model.derived("view bases", lambda: _view_bases(model))
    found = []
    for op in model.ops:
        split = bool(op.input_grad_reads) and model.ready_gradients_early
        groups = [(k,) for k in range(len(op.inputs))] if split else [tuple(range(len(op.inputs)))]
        kernels = []
        for inputs in groups:
            targets = tuple(op.inputs[k] for k in inputs if receives_gradient(model, op.inputs[k], sinks))
            if targets:
                reads = op.input_grad_reads[inputs[0]] if split else op.grad_reads
                kernels.append(_GradientKernel(
                    targets, reads, makes_results=model.separate_result_kernels and not sinks.isdisjoint(targets),
                    reads_views=any(t in views for t in reads)))
        if all(t in sinks for t in op.outputs):
            kernels = []  # no gradient ever reaches the op: a result's is the result itself
        inputs = tuple(t for t in op.inputs if model.tensors[t].producer >= 0)
        backward = op_action(op, f"backward {op.name}", [], [], backward=True, share=len(groups))
        found.append(_OpKernels(
            recompute=op_action(op, f"recompute {op.name}", [], []),
            advance=op_action(op, f"advance {op.name}", [], []),
            backward=backward,
            updating=tuple(_with_update(backward, model, kernel, sinks) for kernel in kernels),
            inputs=inputs,
            outputs=op.outputs,
            output_bytes=tuple((t, model.tensors[t].nbytes) for t in op.outputs),
            saved_bytes=op.saved_bytes,
            kernels=tuple(kernels),
            recomputed_as_anchor=recomputes_anchor(op.type),
            reads_views=any(t in views for t in inputs),
            targets=tuple(t for kernel in kernels for t in kernel.targets),
            gradient_tensors=tuple(op.outputs) + tuple(t for kernel in kernels for t in kernel.targets)))
    return found


def _with_update(backward: Action, model: GraphModel, kernel: "_GradientKernel", sinks: FrozenSet[int]) -> Action:
    """``backward`` for one kernel: a kernel that makes results (weight
    gradients) also holds the temporaries of their optimizer update, which
    runs as each result is made; the larger of the two counts."""
    results = sum(model.tensors[t].gradient_bytes for t in kernel.targets if t in sinks)
    update = int(model.update_factor * results)
    if update <= backward.temp:
        return backward
    return Action(backward.label, [], [], backward.cost, backward.stream, backward.forwards_buffers, (), update,
                  backward.seconds)


def step_actions(model: GraphModel, kept: Set[int], units: List[Unit]) -> Tuple[List[Action], List[int]]:
    """The step's actions when ``kept`` ops' outputs are kept and the
    backward pass runs ``units`` (:func:`memsaving.model.schedule.backward_units`),
    and the index of the last action of each unit (the first entry is the
    end of the forward pass when the first unit is not the output unit)."""
    forward, forward_written = model.derived("forward actions", lambda: _forward_actions(model))
    step = _BackwardPass(model)
    unit_ends: List[int] = []
    for unit in units:
        step.run(unit)
        unit_ends.append(len(forward) + len(step.actions) - 1)
    if not units or units[0].kind != UnitKind.OUTPUT:
        unit_ends.insert(0, len(model.ops))  # the seed: the forward pass ends there
    step.pin_view_bases(forward_written)
    return forward + step.actions, unit_ends


def step_blocks(model: GraphModel, units: List[Unit]) -> Optional[Tuple[List[UnitBlock], List[int]]]:
    """The step of :func:`step_actions` in blocks of actions, and its unit
    ends: the forward pass, the seed of the gradients, then the units'.

    The units are cut into runs (:func:`memsaving.sim.blocks.runs`).  A run
    that the plans of this model ran before has a block of its own,
    remembered per model and reused by the plans that reach the run in the
    same state (see :mod:`memsaving.sim.blocks`); the runs seen for the
    first time share blocks made for this plan alone.  The blocks' actions
    are only there until their rows are made (:func:`block_rows`).

    None when the plan is better replayed as one list of actions
    (:func:`step_actions`): when most of its runs were never seen (the
    first plans of a search, which share little: making blocks for them
    would cost more than it saves), when two of its units copy with
    the same tag and anchor (inner checkpoints shared by two segments: a
    unit's views would pin the bases the other unit copies), and when the
    model has shared results (:func:`memsaving.model.graph.shared_results`:
    which contribution to one comes last depends on the whole plan, not
    on the state the memo keys its blocks by)."""
    if shared_results_of(model):
        return None
    memo = model.derived("unit blocks", lambda: _unit_memo(model))
    memo.begin()
    step = _BackwardPass(model)
    latest, tensors, store = step.grads.latest, step.tensors, memo.store
    cut = runs(units)
    entries = [memo.entry(run, tensors) for run in cut]
    if 2 * entries.count(None) > len(entries):
        return None
    blocks = [memo.fixed[0], memo.fixed[1]]
    unit_ends: List[int] = []
    count = len(model.ops) + 1  # actions in the blocks so far: the forward pass and the seed
    token = 0
    running = False  # runs seen for the first time are being run into one block
    for run, entry in zip(cut, entries):
        if entry is None:
            if not running:
                step.begin_run()
                running = True
            for unit in run:
                token = step.run_unit(unit, token, memo)
                unit_ends.append(count + len(step.actions) - 1)
            continue
        if running:
            blocks.append(step.end_run(token))
            count += len(step.actions)
            running = False
        state = (token, *map(latest.get, entry.tensors))
        block = entry.blocks.get(state)
        if block is None:
            block = step.block(run, entry.targets, token, memo)
            store(entry, state, block)
        else:
            latest.update(block.gradients)
            if block.sources is not None:
                step.advance(block.sources)
        token = block.token
        blocks.append(block)
        unit_ends.extend(map(count.__add__, block.ends))
        count += len(block.labels)
    if running:
        blocks.append(step.end_run(token))
    if token and not _copies_distinct(units):
        return None
    if not units or units[0].kind != UnitKind.OUTPUT:
        unit_ends.insert(0, len(model.ops))  # the seed: the forward pass ends there
    return blocks, unit_ends


def block_rows(model: GraphModel, blocks: List[UnitBlock]) -> BufferRows:
    """The rows of the list of actions ``blocks`` (from :func:`step_blocks`)
    make up, with those of the blocks made for earlier plans reused
    (:meth:`memsaving.sim.blocks.UnitMemo.rows`)."""
    return model.derived("unit blocks", lambda: _unit_memo(model)).rows(blocks)


def _copies_distinct(units: List[Unit]) -> bool:
    """No two units copy with the same tag and anchor (:func:`step_blocks`)."""
    copying = [(unit.kind, unit.anchor) for unit in units if unit.kind in RECOMPUTING]
    return len(set(copying)) == len(copying)


def _unit_memo(model: GraphModel) -> UnitMemo:
    """The memo of :func:`step_blocks`, with the forward pass's block and
    the seed's (the same in every plan)."""
    fixed = [UnitBlock(forward_actions(model)), UnitBlock(_BackwardPass(model).actions)]
    return UnitMemo(max(MIN_REMEMBERED_ACTIONS, REMEMBERED_ACTIONS_PER_OP * len(model.ops)), fixed)


REMEMBERED_ACTIONS_PER_OP = 8
"""The actions of the blocks :func:`step_blocks` remembers, per op of the
model: a plan has about three actions per op, so this holds the blocks of
two or three plans (the plan a search moves from and its neighbours'
new runs).  The memo then holds at most some 4 kB per op (the blocks'
labels and rows, the buffer numbers, the states they start in): about
40 MB on a graph of 10,000 ops."""

MIN_REMEMBERED_ACTIONS = 4096
"""The capacity of the memo of small graphs."""


class _BackwardPass:
    """The backward actions of one step, unit by unit: the seed, then each
    unit's recomputation and gradient kernels.

    A unit reads a tensor from its own copy (``local``), else from the copy
    an advance unit made (``sources``), else from the forward pass."""

    def __init__(self, model: GraphModel):
        self.model = model
        self.ops = model.derived("op kernels", lambda: _op_kernels(model))
        self.grads = GradientBuffers(model)
        # inner checkpoints rebuilt by advance units (by tensor, or by saved_key(i) for saved memory)
        self.sources: Dict[Union[int, Key], Key] = {}
        self.forward = forward_keys(model)
        self.view_readers: List[Action] = []
        """The actions that read a tensor that may be a view."""
        self.copies: Set[Key] = set()
        """The keys of the recomputed copies (and of what they save)."""
        self.advance_copies: Set[Key] = set()
        """The keys of the advance units' copies (:meth:`block`)."""
        self.forward_written = model.derived("forward actions", lambda: _forward_actions(model))[1]
        seed_writes: List[Tuple[Key, int]] = []
        for y in model.ys:
            if model.tensors[y].trainable:
                self.grads.add(y, [], seed_writes)
        self.actions: List[Action] = [Action("seed gradients", [], seed_writes)]

    def run(self, unit: Unit) -> Dict[Union[int, Key], Key]:
        """Append ``unit``'s actions, in the order the step runs them
        (:mod:`memsaving.tf.order` pins the step to this replay): its
        copies in topological order, then its ops' gradients, last op
        first; return its copies (``local``)."""
        local: Dict[Union[int, Key], Key] = {}  # by tensor, or by saved_key(i)
        if unit.kind in RECOMPUTING:
            self.recompute(unit, local)
        if unit.kind == UnitKind.ADVANCE:
            self.sources.update(local)
            return local
        differentiate = self.differentiate
        for i in reversed(unit.ops):
            differentiate(i, local)
        return local

    def run_unit(self, unit: Unit, token: int, memo: UnitMemo, made: Optional[Dict] = None) -> int:
        """Append ``unit``'s actions (:meth:`run`) to the block being made;
        return the token of the advance units run so far (``token``: before).
        An advance unit's copies are added to ``made``, when given."""
        local = self.run(unit)
        if unit.kind is not UnitKind.ADVANCE:
            return token
        self.advance_copies.update(local.values())
        if made is not None:
            made.update(local)
        return memo.token(token, unit)

    def block(self, units: Tuple[Unit, ...], targets: Tuple[int, ...], token: int, memo: UnitMemo) -> UnitBlock:
        """The block of the run ``units``, made in the current state
        (``token``: the advance units run so far; ``targets``: the tensors
        the units add gradient to), its views pinned to the bases the
        forward pass, the advance units so far and the run itself wrote:
        in a plan whose units copy under distinct tags and anchors, the
        keys that name the same copy as a view the run reads."""
        self.begin_run()
        ends = []
        made: Dict = {}
        for unit in units:
            token = self.run_unit(unit, token, memo, made)
            ends.append(len(self.actions) - 1)
        block = self.end_run(token)
        latest = self.grads.latest
        block.gradients = {t: latest[t] for t in targets if t in latest}
        block.sources, block.ends = made or None, tuple(ends)
        return block

    def begin_run(self) -> None:
        """Start a block (:func:`step_blocks`)."""
        self.actions, self.view_readers = [], []
        self.copies = set(self.advance_copies) if self.advance_copies else set()

    def end_run(self, token: int) -> UnitBlock:
        """The block of the units run since :meth:`begin_run` (``token``:
        the advance units run so far), its views pinned as in :meth:`block`."""
        if self.view_readers:
            self.pin_view_bases(self.forward_written)
        return UnitBlock(self.actions, token=token)

    def advance(self, copies: Dict) -> None:
        """The state after advance units that made ``copies`` (a block's
        :attr:`~memsaving.sim.blocks.UnitBlock.sources`)."""
        self.sources.update(copies)
        self.advance_copies.update(copies.values())

    def tensors(self, units: Tuple[Unit, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The tensors whose gradient buffers the actions of ``units`` read
        or add to (the outputs of the anchors they recompute from, of their
        ops, the targets of their ops' gradient kernels), and those targets
        (some may be listed twice)."""
        touched, targets = self.model.derived("gradient tensors", lambda: (
            list(map(attrgetter("gradient_tensors"), self.ops)), list(map(attrgetter("targets"), self.ops))))
        ops = list(chain.from_iterable(map(attrgetter("ops"), units)))
        anchors = [self.model.ops[unit.anchor].outputs for unit in units if unit.kind in RECOMPUTING]
        return (tuple(chain(chain.from_iterable(anchors), chain.from_iterable(map(touched.__getitem__, ops)))),
                tuple(chain.from_iterable(map(targets.__getitem__, ops))))

    def recompute(self, unit: Unit, local: Dict[Union[int, Key], Key]) -> None:
        """The copies of ``unit``'s ops, writing ``local`` buffers (keyed by
        the unit's tag and anchor)."""
        segment = unit.kind == UnitKind.SEGMENT
        tag, anchor, sources, forward = ("c" if segment else "a"), unit.anchor, self.sources, self.forward
        anchor_gradients = None
        for i in unit.ops:
            op = self.ops[i]
            if i == anchor and segment and not op.recomputed_as_anchor:
                continue  # kept: its gradient reads the kept outputs
            if anchor_gradients is None:  # the copies wait on the anchor's output gradient
                anchor_gradients = self.grads.current(self.model.ops[anchor].outputs)
            reads = [local.get(t) or sources.get(t) or forward[t] for t in op.inputs]
            reads += anchor_gradients
            writes = []
            for t, nbytes in op.output_bytes:
                key = local[t] = (tag, anchor, t)
                writes.append((key, nbytes))
            if op.saved_bytes and segment:  # advance copies are not differentiated
                key = local[saved_key(i)] = saved_key(i, tag, anchor)
                writes.append((key, op.saved_bytes))
            action = on_buffers(op.recompute if segment else op.advance, reads, writes)
            if op.reads_views:
                self.view_readers.append(action)
            self.actions.append(action)
        if local:
            self.copies.update(local.values())

    def differentiate(self, i: int, local: Dict[Union[int, Key], Key]) -> None:
        """The gradient kernels of op ``i``, once its outputs have gradients."""
        op = self.ops[i]
        if not op.kernels:
            return
        grads, sources, forward = self.grads, self.sources, self.forward
        incoming = grads.current(op.outputs)
        if not incoming:
            return
        saved = []
        if op.saved_bytes:
            key = saved_key(i)
            saved.append(local.get(key) or sources.get(key) or key)
        for kernel, backward in zip(op.kernels, op.updating):
            reads: List[Key] = incoming + [local.get(t) or sources.get(t) or forward[t] for t in kernel.reads]
            if saved:
                reads += saved
            writes: List[Tuple[Key, int]] = []
            for t in kernel.targets:
                grads.add(t, reads, writes)
            action = on_buffers(backward, reads, writes,
                                result_keys(self.model, writes) if kernel.makes_results else ())
            if kernel.reads_views:
                self.view_readers.append(action)
            self.actions.append(action)


    def pin_view_bases(self, forward_written: Set[Key]) -> None:
        """Make the reads of views also read their bases
        (:func:`_pin_view_bases`), once every unit ran: the actions of this
        step are its own, so their reads are extended in place."""
        written = _Written(forward_written, self.copies)
        base = self.model.derived("view bases", lambda: _view_bases(self.model))
        for action in self.view_readers:
            extra = _view_base_reads(base, action, written)
            if extra:
                action.reads = action.reads + extra


def forward_actions(model: GraphModel) -> List[Action]:
    """The forward pass's actions, which every plan's list starts with (the
    same objects, made once per model)."""
    return model.derived("forward actions", lambda: _forward_actions(model))[0]


def forward_keys(model: GraphModel) -> Dict[int, Key]:
    """Each tensor's forward buffer ``("f", t)``, one key object per model:
    a replay looks every read up among the writes, and equal keys that are
    the same object compare at once."""
    return model.derived("forward keys", lambda: _Memo(lambda t: ("f", t)))


def _forward_actions(model: GraphModel) -> Tuple[List[Action], Set[Key]]:
    """The forward pass's actions, the same in every plan (views pinned,
    see :func:`_pin_view_bases`), and the keys they write."""
    tensors = model.tensors
    keys = forward_keys(model)
    actions: List[Action] = []
    for i, op in enumerate(model.ops):
        reads = [keys[t] for t in op.inputs if tensors[t].producer >= 0]
        writes = [(keys[t], tensors[t].nbytes) for t in op.outputs]
        if op.saved_bytes and op.forward:
            writes.append((saved_key(i), op.saved_bytes))
        actions.append(op_action(op, f"forward {op.name}", reads, writes))
    written = {key for action in actions for key, _ in action.writes}
    return _pin_view_bases(model, actions, written), written


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


def _pin_view_bases(model: GraphModel, actions: List[Action], written: Container[Key]) -> List[Action]:
    """Make every read of a view also read the buffer it shares.

    A view has no bytes of its own, but TensorFlow frees a buffer only when
    its last view is gone: a kept view (a checkpoint on a Reshape, as Keras
    puts around a Dense on 3-D inputs, Conv1D's ExpandDims/Squeeze, attention
    heads) keeps the activation it views alive until its segment.  Counted
    free, such views would look like the cheapest checkpoints of all.

    ``written``: the keys written in the step.
    """
    base = model.derived("view bases", lambda: _view_bases(model))
    pinned = []
    for action in actions:
        extra = _view_base_reads(base, action, written)
        pinned.append(with_reads(action, list(action.reads) + extra) if extra else action)
    return pinned


def _view_base_reads(base: Dict[int, int], action: Action, written: Container[Key]) -> List[Key]:
    """The buffers ``action`` must read besides its reads, for the views it
    reads (:func:`_pin_view_bases`; ``base``: :func:`_view_bases`): of each
    view's base, the copy made with the view, else the forward pass's."""
    extra: List[Key] = []
    for key in action.reads:
        if key[-1] not in base or key[0] not in ("f", "c", "a"):
            continue
        same_copy = key[:-1] + (base[key[-1]],)  # the base recomputed with the view
        target = same_copy if same_copy in written else ("f", base[key[-1]])
        if target in written and target not in action.reads and target not in extra:
            extra.append(target)
    return extra


class _Written:
    """The keys a step writes that a read of a view may name: the forward
    pass's (a set kept per model) and the backward pass's copies, without
    copying the first."""

    def __init__(self, forward: Set[Key], copies: Set[Key]):
        self.forward, self.copies = forward, copies

    def __contains__(self, key: object) -> bool:
        return key in self.forward or key in self.copies
