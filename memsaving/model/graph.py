"""The framework-neutral graph model of one gradient computation.

Planning and simulation work on this model only, so they are tested without
TensorFlow.  :mod:`memsaving.tf.extract` builds it from a TensorFlow graph.

Ops are listed in a topological order.  Tensors are integers; each has a size
in bytes and, for forward tensors, whether gradients flow through it.  Each op
records which of its inputs and outputs its *gradient* reads: those are the
forward tensors backprop keeps alive, which is what checkpointing saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

BACKWARD_COST_FACTOR = 2.0
"""Backward of an op costs about twice its forward (two products for a
matmul or convolution); used to report compute, not to pick plans."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor: who produces it (-1 for tensors that exist before the step)."""

    name: str
    nbytes: int
    producer: int = -1
    trainable: bool = True
    constant: bool = False  # an external tensor that is not data: a constant or a variable handle
    value_bytes: Optional[int] = None
    """Bytes of the value when ``nbytes`` is 0 because the tensor shares
    another buffer (a view, a variable read, a variable handle)."""
    folded_gradient: bool = False
    """Its gradient is a constant the runtime computes once and keeps for
    the life of the step function (the loss's seed passed back through
    gradients that read no data): part of the resident memory, allocated by
    no action."""
    shape: Optional[Tuple[int, ...]] = None
    """The static shape (unknown dimensions sized as the batch), when the
    extractor was asked for shapes: splitting needs to know which tensors
    have the rows a split region cuts (:mod:`memsaving.model.splitting`)."""
    numeric: bool = True
    """Its value is an array of numbers (or bools), which a copy moves byte
    for byte.  False for a TensorList (a loop's accumulator, of dtype
    variant), a resource handle or a string: the emitter has no copy for
    those, so swapping never picks them (:func:`memsaving.sim.swap.swappable`)."""

    @property
    def gradient_bytes(self) -> int:
        """Bytes of this tensor's gradient: a buffer of its own, even when
        the tensor is a view."""
        return self.nbytes if self.value_bytes is None else self.value_bytes


@dataclass(frozen=True)
class OpInfo:
    """An op of the forward step.

    Attributes
    ----------
    forward
        gradients flow through it (it lies between xs and ys).
    copyable
        recomputing it gives the same values (not stateful).
    grad_reads
        the tensors (inputs or outputs) its gradient function reads.
    input_grad_reads
        for ops whose gradient with respect to each input
        is a kernel of its own (a product's two matmuls), per input the
        tensors that kernel reads (empty for an input whose gradient is not
        used); empty when the gradient is taken as one kernel reading
        ``grad_reads``.
    cost
        compute cost in arbitrary units (FLOPs by default).
    forwards_input
        an elementwise op: its kernel, and its gradient's
        kernels, write an output into the buffer of an input of the same
        size that nothing reads afterwards, allocating nothing
        (TensorFlow's ``forward_input_or_allocate_output``).
    temp_bytes
        memory the forward kernel holds while it runs, beyond
        its inputs and outputs (work buffers); counted during each forward
        and recompute action of the op.
    grad_temp_bytes
        the same for the op's gradient, beyond what its
        backward action reads and writes; counted during that action.
    saved_bytes
        memory the forward op keeps for its gradient that is no
        tensor of the model (a loop's accumulated intermediates, added to
        the op when its gradient is built): written by the op's forward
        (or recompute) action and freed after its backward action.
    seconds, grad_seconds
        measured run times of the op and of its
        gradient; when present they time the action instead of ``cost``.
    """

    name: str
    type: str
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    forward: bool = True
    copyable: bool = True
    grad_reads: Tuple[int, ...] = ()
    input_grad_reads: Tuple[Tuple[int, ...], ...] = ()
    cost: float = 1.0
    forwards_input: bool = False
    temp_bytes: int = 0
    grad_temp_bytes: int = 0
    saved_bytes: int = 0
    seconds: Optional[float] = None
    grad_seconds: Optional[float] = None
    row_splits: Tuple[Tuple[int, Tuple[int, ...]], ...] = ()
    """Ways the op can be computed in pieces: ``(rows, positions)`` says
    that row ``r`` of every output (its first dimensions, whose sizes
    multiply to ``rows``) depends only on row ``r`` of the inputs at
    ``positions`` and on its other inputs whole (a product's weight, a
    bias).  Empty for ops that mix rows (a batch statistic, attention over
    the sequence) or whose rows were not asked for
    (:mod:`memsaving.model.splitting`)."""
    chunks: int = 0
    """For a split region's op (:mod:`memsaving.model.splitting`): the
    pieces it runs in.  Its gradient recomputes each piece before
    differentiating it, so the backward costs its forward once more."""
    checkpointed_grad_temp_bytes: Optional[int] = None
    """For a loop whose gradient can keep one state every k iterations
    instead of every one (:mod:`memsaving.model.loops`): that gradient's
    temporaries, its stored states and the chunk it runs again included
    (0 when not profiled); None for every other op."""
    checkpointed_grad_seconds: Optional[float] = None
    """That gradient's measured run time, when profiled."""

    @property
    def gradient_cost(self) -> float:
        """Compute of the op's gradient: ``BACKWARD_COST_FACTOR`` times the
        forward, plus the forward again for a split region, which
        recomputes its pieces."""
        return BACKWARD_COST_FACTOR * self.cost + (self.cost if self.chunks else 0.0)

    @property
    def work_buffer_bytes(self) -> int:
        """The larger of the forward kernel's and the gradient's work
        buffers: what running this op, either way, may add beyond the
        tensors it reads and writes."""
        return max(self.temp_bytes, self.grad_temp_bytes)


@dataclass(frozen=True)
class ProfileSummary:
    """How the kernel profiles of a model were obtained.

    Attributes
    ----------
    mode
        ``"measure"`` (missing signatures measured), ``"cached"`` (only
        profiles already cached were used) or ``"off"``.
    measured
        op signatures measured for this model.
    cached
        op signatures found in the cache.
    missing
        signatures without a profile (cache-only runs).
    seconds
        time spent profiling (cache look-ups included).
    ops
        ops of the model that carry a profile.
    """

    mode: str = "off"
    measured: int = 0
    cached: int = 0
    missing: int = 0
    seconds: float = 0.0
    ops: int = 0


@dataclass
class GraphModel:
    """One forward step: ops in topological order, tensors, what is differentiated.

    Attributes
    ----------
    ops
        the ops ``ys`` depend on, in topological order.
    tensors
        tensor id -> info.
    xs
        tensor ids gradients are taken with respect to.
    ys
        tensor ids being differentiated.
    resident_bytes
        memory in use before the step starts (parameters,
        inputs), included in every predicted peak.
    profile
        how the ops' measured temporaries and times were obtained
        (:class:`ProfileSummary`), when they were.
    separate_result_kernels
        an op's gradient with respect to an ``x`` (a
        weight gradient) is made by a kernel of its own and, unless the
        caller keeps the results, consumed before the op's other gradient
        kernels allocate (TensorFlow, see
        :func:`memsaving.model.buffers.consumed_at_once`); otherwise all of an
        op's gradients are held together, as Checkmate's MILP counts them.
    ready_gradients_early
        the executor runs several kernels at once (more
        than one inter-op thread, TensorFlow's default): an op's gradient
        with respect to each input is a kernel of its own, each run when it
        is ready, and the rewrite pins the whole step to the replay
        (:mod:`memsaving.tf.order`); with one thread, an op's gradient
        kernels are counted together.
    """

    ops: List[OpInfo]
    tensors: Dict[int, TensorInfo]
    xs: List[int]
    ys: List[int]
    resident_bytes: int = 0
    separate_result_kernels: bool = False
    ready_gradients_early: bool = False
    profile: Optional[ProfileSummary] = None
    """How kernel temporaries were profiled (None: never asked)."""
    splits: Tuple[Any, ...] = ()
    """The split regions this model computes in pieces, each one op of the
    model (:class:`memsaving.model.splitting.SplitRegion`)."""
    update_factor: float = 0.0
    """Bytes an optimizer's update of a weight holds while it runs, per byte
    of the weight's gradient: a gradient made as a result is consumed by
    such an update, at once (Adam's ``(g - m)`` and ``g * g`` make two
    temporaries the size of the weight: :data:`UPDATE_FACTOR`)."""
    unfolded: Optional["GraphModel"] = field(default=None, repr=False, compare=False)
    """The model before its regions were folded (what plain ``tf.gradients``
    runs), when this one has split regions."""
    _derived: Dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, name: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, run once per model and kept under ``name``.

        For what depends on the model alone and is asked for again and
        again (the consumers of each tensor; the forward pass's actions,
        which every simulated plan would rebuild).  A model is not changed
        once built; ``dataclasses.replace`` gives a new model, which starts
        with nothing derived.
        """
        if name not in self._derived:
            self._derived[name] = compute()
        return self._derived[name]

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled (or deep-copied) without what was derived: the memo holds
        replay structures whose classes may change between versions, and it
        is rebuilt on demand."""
        state = dict(self.__dict__)
        state["_derived"] = {}
        return state

    @property
    def folded_gradient_bytes(self) -> int:
        """Bytes of the gradients folded into constants
        (:attr:`TensorInfo.folded_gradient`), part of ``resident_bytes``."""
        return sum(t.gradient_bytes for t in self.tensors.values() if t.folded_gradient)

    def consumers(self, tensor: int) -> List[int]:
        """Indices of the ops reading ``tensor``."""
        return self.derived("consumers", self._consumer_table).get(tensor, [])

    def _consumer_table(self) -> Dict[int, List[int]]:
        table: Dict[int, List[int]] = {}
        for i, op in enumerate(self.ops):
            for t in set(op.inputs):
                table.setdefault(t, []).append(i)
        return table

    def op_index(self) -> Dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    def forward_cost(self) -> float:
        """Compute of one run of every op, in the ops' cost units."""
        return sum(op.cost for op in self.ops)

    def backward_cost(self) -> float:
        """Compute of the backward pass: each forward op's
        :attr:`OpInfo.gradient_cost`.  With :meth:`forward_cost` it is what every plan
        pays; a plan only adds recomputation."""
        return sum(op.gradient_cost for op in self.ops if op.forward)

    def activation_bytes(self) -> int:
        return sum(self.tensors[t].nbytes for op in self.ops if op.forward for t in op.outputs)


def receives_gradient(model: GraphModel, t: int, xs: AbstractSet[int]) -> bool:
    """Whether backprop makes a gradient for tensor ``t``: a float tensor
    that is one of ``xs`` or made by a forward op (an input fed from outside
    the forward graph gets none)."""
    info = model.tensors[t]
    return info.trainable and (t in xs or (info.producer >= 0 and model.ops[info.producer].forward))


UPDATE_FACTOR = 2.0
"""The update allowance :func:`memsaving.tf.extract.graph_model` gives a
step's model (:attr:`GraphModel.update_factor`): an Adam update, which
holds two temporaries the size of the weight beside its gradient (measured:
SGD 0, SGD with momentum 1, Adam and RMSprop 2, AdamW 3).  The planner
never sees the update (it is built after the gradients), and a budget must
hold with it."""


def gradient_sinks(model: GraphModel) -> Set[int]:
    """The tensors whose gradients are results: ``xs``, and the views of
    ``xs`` (a variable's read, an Identity of an x).

    TensorFlow's gradient of a view is the gradient of its output itself, so
    the gradient made where a variable's read is consumed (a weight gradient)
    is already the variable's: no op waits for the rest of the backward pass
    before it is handed on, unless the variable is read more than once
    (:func:`shared_results`)."""
    xs = set(model.xs)
    sinks = set(xs)
    for op in model.ops:
        if op.inputs and all(t in xs for t in op.inputs) and all(
                model.tensors[t].nbytes == 0 and model.tensors[t].value_bytes is not None for t in op.outputs):
            sinks.update(op.outputs)
    return sinks


def gradient_ops(model: GraphModel) -> Set[int]:
    """Ops whose gradient runs: forward ops with an output that receives a
    gradient (from the loss seed or a consumer's gradient), by the rule of
    ``simulate``: a gradient flows into an input that is a gradient sink
    (:func:`memsaving.model.graph.gradient_sinks`) or is produced by a forward op,
    when the input is trainable.  Views of ``xs`` run no gradient."""
    xs = gradient_sinks(model)
    given = set(model.xs)
    has_grad = {y for y in model.ys if model.tensors[y].trainable}
    found = set()
    for i in range(len(model.ops) - 1, -1, -1):
        op = model.ops[i]
        if not op.forward or not any(t in has_grad for t in op.outputs):
            continue
        if op.outputs and all(t in xs and t not in given for t in op.outputs):
            continue  # a view of xs: its output's gradient is the result
        found.add(i)
        for t in op.inputs:
            if receives_gradient(model, t, xs):
                has_grad.add(t)
    return found


def shared_results(model: GraphModel) -> Dict[int, Tuple[int, int]]:
    """The results that several gradient contributions sum into: for each
    gradient sink of such a result, ``(base, contributions)``, where
    ``base`` is the ``x`` the sink is (or is a view of) and
    ``contributions`` the number of gradients added to ``base`` in all.

    A variable read twice (a tied embedding: looked up at the input, read
    transposed by the output layer; a layer applied twice) has a sink per
    read, and TensorFlow sums their gradients into the variable's: the
    contributions made first are held until the last one arrives.  Sinks
    of a result with one contribution are left out: theirs is handed on at
    once (:func:`gradient_sinks`)."""
    sinks = gradient_sinks(model)
    xs = set(model.xs)

    def base(t: int) -> int:
        if t in xs:
            return t
        return next(x for x in model.ops[model.tensors[t].producer].inputs if x in xs)

    counts: Dict[int, int] = {}
    fed: Dict[int, int] = {}
    for j in gradient_ops(model):
        for t in model.ops[j].inputs:
            if t in sinks and receives_gradient(model, t, sinks):
                b = fed[t] = base(t)
                counts[b] = counts.get(b, 0) + 1
    return {t: (b, counts[b]) for t, b in fed.items() if counts[b] > 1}


def without_forwarding(model: GraphModel) -> GraphModel:
    """``model`` with no op writing into its inputs' buffers (every output a
    new buffer) and an op's gradients held together.  Checkmate's MILP (:mod:`memsaving.references.milp`) counts memory this
    way, so plans compared against it are scored on this model."""
    if not any(op.forwards_input for op in model.ops) and not model.separate_result_kernels:
        return model
    ops = [replace(op, forwards_input=False) for op in model.ops]
    return GraphModel(ops, model.tensors, list(model.xs), list(model.ys), model.resident_bytes)


def validate_model(model: GraphModel) -> None:
    """Raise ValueError when ``model`` is not topologically ordered or refers
    to unknown tensors (the simulator and planner rely on both)."""
    produced = {t for t, info in model.tensors.items() if info.producer == -1}
    for i, op in enumerate(model.ops):
        for t in op.inputs:
            if t not in model.tensors:
                raise ValueError(f"op {op.name} reads unknown tensor {t}")
            if t not in produced:
                raise ValueError(f"op {op.name} reads tensor {model.tensors[t].name} before it is produced")
        for t in op.outputs:
            if model.tensors[t].producer != i:
                raise ValueError(f"tensor {model.tensors[t].name} does not name op {op.name} as producer")
            produced.add(t)


def chain_model(sizes: Sequence[int], costs: Optional[Sequence[float]] = None,
                grad_reads: str = "input") -> GraphModel:
    """A chain x -> op_1 -> ... -> op_n -> loss, for tests and examples.

    ``sizes[i]`` is the bytes of op i's output; ``grad_reads`` is ``"input"``
    (like MatMul) or ``"output"`` (like Relu) or ``"both"``.
    """
    tensors = {0: TensorInfo("x", sizes[0], -1)}
    ops = []
    for i, size in enumerate(sizes):
        inp, out = i, i + 1
        tensors[out] = TensorInfo(f"t{i + 1}", size, i)
        reads = {"input": (inp,), "output": (out,), "both": (inp, out)}[grad_reads]
        cost = 1.0 if costs is None else costs[i]
        ops.append(OpInfo(f"op{i + 1}", "Op", (inp,), (out,), grad_reads=reads, cost=cost))
    return GraphModel(ops, tensors, xs=[0], ys=[len(sizes)])
