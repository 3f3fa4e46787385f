"""Run the whole step, forward and backward, in the order the simulator replayed.

The simulator predicts a plan's peak by replaying its actions in one order
(:attr:`memsaving.sim.simulate.Simulation.labels`): the forward ops in the
model's order, then each backward unit's recomputed copies and its ops'
gradients, last op first.  TensorFlow's executor, with its default thread
pools, runs every ready op at once and in an order that changes from run to
run: weight gradients and side computations wait while a thread follows a
chain, parallel branches interleave.  What is alive at the peak then moves,
and so does where TensorFlow's allocator places each buffer: the allocator
hands a request a free chunk of up to twice its size whole, so one order
can waste megabytes another does not.  The same budget plan measured 12.9
to 15.7 MiB from run to run (a DenseNet, predicted 12.4).

:func:`pin_step` makes the executor follow the replay: it lists the step's
ops in the replay's order (:func:`replayed_ops`), completes that list into a
topological order of every op the step runs (:func:`run_order`: ops the
replay does not name run next to the ops they feed or, with side effects
such as Keras' moving averages, as soon as they can), and makes each op wait
for the op before it (:func:`chain`).  Only control edges are added: values,
and so gradients, are unchanged.  With one op runnable at a time the order,
and the allocator's, repeats from run to run.

Some ops carry no edge, or wait another way:

* ops that allocate nothing worth ordering (:data:`FREE`: constants,
  shapes, ``Identity``, variable reads): Grappler folds or removes them, and
  an edge on them changes which rewrites it makes (on ``Identity`` it made
  the arithmetic optimizer fail a topological sort);
* bias gradients that oneDNN may merge into a convolution's filter
  gradient (:func:`merged_bias_gradients`): neither they nor what reads
  them are waited on, and they wait for nothing;
* ``Pow`` (:data:`WAIT_ON_INPUT`) waits through an ``Identity`` on its first
  input, which Grappler's rewrite of ``x ** 3`` tolerates where it does not
  tolerate a control input on the ``Pow`` itself;
* ops no result, loss or side effect needs: the function runtime prunes
  them, and a wait on one would make it run.

And ops TensorFlow fuses run next to each other (:class:`_Schedule`), so
that no op is chained between the two halves of a fused op.

What the order cannot fix: the caller's ops that read the gradients (made
after :func:`memsaving.gradients` returns) run whenever the executor gets to
them, and buffers that outlive a step (a variable's new value) land where
the allocator finds room, so the layout the next step starts from may
differ.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import tensorflow as tf

FILTER_GRADIENTS = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter"})
"""Convolutions' filter gradients: oneDNN's graph pass merges one with the
bias gradient (``BiasAddGrad``) that reads the same incoming gradient."""

METADATA = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank"})
"""Op types that make constants or read only shapes: not work to order."""

FREE = METADATA | {"NoOp", "Identity", "IdentityN", "Placeholder", "VarHandleOp", "ReadVariableOp"}
"""Op types left out of the chain: they allocate nothing (or a shape's few
bytes), and Grappler folds, removes or rewrites them."""

WAIT_ON_INPUT = frozenset({"Pow"})
"""Op types that wait through an ``Identity`` on their first input, never
by control edges of their own.  Grappler's arithmetic optimizer rewrites
``x ** 3`` as ``square(x) * x`` and, on a ``Pow`` that carries control
inputs, leaves a node it then cannot find ("ConvertPow__inner_Pow does not
exist"); the whole function then runs unoptimized (seen on recomputed
tanh-Gelu in a keras_hub BERT budget plan)."""

SIDE_EFFECT_FREE_STATEFUL = frozenset({"ReadVariableOp", "VarHandleOp", "Placeholder"})
"""Stateful op types that change nothing: the function runtime prunes them
when nothing reads them."""

CONTRACTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul"})
"""Op types TensorFlow fuses with the bias addition that reads them."""

BIAS_ADDITIONS = frozenset({"BiasAdd", "AddV2", "Add"})
"""Op types that add a bias to a contraction's output."""

AS_SOON_AS_READY = -1
"""Rank of the ops the replay does not name that have a side effect (and
of the ops only they read): run as soon as they can."""


# -- the ops of the replay ------------------------------------------------------------------------


class UnitOps:
    """The TF ops the backward pass made for each action of the replay.

    The rewrite records them as it builds (:meth:`copied`, :meth:`differentiated`);
    :func:`replayed_ops` then looks each action of the replay up here.  A
    forward op may be recomputed in several units: its copies are handed
    out in the order they were made, which is the replay's order of units.
    """

    def __init__(self):
        self.copies: Dict[Tuple[str, str], deque] = defaultdict(deque)
        self.gradients: Dict[str, List[tf.Operation]] = {}

    def copied(self, kind: str, original: str, copy: tf.Operation) -> None:
        """``copy`` recomputes the forward op named ``original`` (``kind``:
        ``"recompute"`` for a segment's copy, ``"advance"`` for an advance unit's)."""
        self.copies[(kind, original)].append(copy)

    def differentiated(self, made: Sequence[tf.Operation], forward_ops: Sequence[tf.Operation],
                       originals: Sequence[str]) -> None:
        """One ``tf.gradients`` call made ``made`` for ``forward_ops`` (the
        forward ops or their copies), whose original names are ``originals``."""
        for name, group in zip(originals, gradient_groups(made, forward_ops)):
            if group:
                self.gradients.setdefault(name, []).extend(group)


def gradient_groups(made: Sequence[tf.Operation], forward_ops: Sequence[tf.Operation]) -> List[List[tf.Operation]]:
    """The ops in ``made`` grouped by the op of ``forward_ops`` they
    differentiate, one (possibly empty) group per forward op, in order.

    An op belongs to forward op ``F`` when its name contains the scope
    ``F.name + "_grad/"`` that ``tf.gradients`` opens around ``F``'s
    gradient function; ops outside every group (sums of gradient
    contributions, zeros for unconnected inputs) are left out.
    """
    index: Dict[str, int] = {op.name: n for n, op in enumerate(forward_ops)}
    groups: List[List[tf.Operation]] = [[] for _ in forward_ops]
    for op in made:
        owner = _owner(op.name, index)
        if owner is not None:
            groups[owner].append(op)
    return groups


def _owner(name: str, index: Dict[str, int]) -> Optional[int]:
    """Index of the forward op whose ``_grad`` scope ``name`` lies in, or None."""
    end = name.find("_grad/")
    while end >= 0:
        start = name.find("/")
        while 0 <= start < end:
            owner = index.get(name[start + 1:end])
            if owner is not None:
                return owner
            start = name.find("/", start + 1)
        end = name.find("_grad/", end + 1)
    return None


def replayed_ops(labels: Sequence[str], graph_ops: Mapping[str, tf.Operation], units: UnitOps) -> List[List[tf.Operation]]:
    """The TF ops of each action the simulator replayed, in its order.

    ``labels`` name the actions (``"forward <op>"``, ``"recompute <op>"``,
    ``"advance <op>"``, ``"backward <op>"``; a gradient run as one kernel
    per input is named once per kernel); ``graph_ops`` maps the forward
    ops' names to the ops.  Actions with no op of their own (the seed, a
    split region's pieces, a copy that was never made) give nothing.

    Examples
    --------
    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with graph.as_default():
    ...     x = tf.constant(1.0, name="x")
    ...     y = tf.square(x, name="y")
    >>> units = UnitOps()
    >>> [[op.name for op in ops] for ops in replayed_ops(["forward x", "forward y", "seed gradients"],
    ...                                                  {op.name: op for op in graph.get_operations()}, units)]
    [['x'], ['y']]
    """
    found: List[List[tf.Operation]] = []
    given: Set[str] = set()
    for label in labels:
        kind, _, name = label.partition(" ")
        if kind == "forward":
            ops = [graph_ops[name]] if name in graph_ops else []
        elif kind in ("recompute", "advance"):
            waiting = units.copies.get((kind, name))
            ops = [waiting.popleft()] if waiting else []
        elif kind == "backward" and name not in given:
            given.add(name)  # the later kernels of the same gradient add nothing
            ops = units.gradients.get(name, [])
        else:
            ops = []
        if ops:
            found.append(ops)
    return found


# -- the order every op runs in --------------------------------------------------------------------


def must_run(roots: Iterable[tf.Operation]) -> Set[tf.Operation]:
    """``roots`` and every op they read, by data or control edges: the ops
    the function runtime runs when it needs ``roots``."""
    return _reachable(roots, lambda op: [t.op for t in op.inputs] + list(op.control_inputs))


def _reachable(start: Iterable[tf.Operation], neighbours) -> Set[tf.Operation]:
    """``start`` and every op ``neighbours(op)`` leads to from them."""
    found: Set[tf.Operation] = set()
    stack = list(start)
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(neighbours(op))
    return found


def has_side_effect(op: tf.Operation) -> bool:
    """Whether ``op`` changes state (assigns a variable...): the function
    runtime runs it even when nothing reads it."""
    return op._is_stateful and op.type not in SIDE_EFFECT_FREE_STATEFUL  # pylint: disable=protected-access


def run_order(replayed: Sequence[Sequence[tf.Operation]], ops: Iterable[tf.Operation],
              side: Iterable[tf.Operation] = ()) -> List[tf.Operation]:
    """``ops`` in an order that follows their data and control edges and,
    where those leave a choice, the replay.

    The ops of ``replayed`` (one list per action) take their action's
    place.  Every other op of ``ops`` takes the place of the earliest op it
    feeds (it runs right before it), or, when it feeds none of them, of the
    latest op it reads (right after); the ops of ``side`` (side effects and
    what only they read) run as soon as they can.  Stateful ops keep the
    order they were made in, as TensorFlow's automatic control dependencies
    will order them.

    One exception keeps TensorFlow's fusions possible: an op read by one op
    only runs right before it, once that reader's other inputs are made
    (:class:`_Schedule`).

    Examples
    --------
    Two independent chains; the replay runs ``b`` before ``a``:

    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with graph.as_default():
    ...     a = tf.square(tf.constant(1.0), name="a")
    ...     b = tf.square(tf.constant(2.0), name="b")
    ...     c = tf.add(a, b, name="c")
    >>> [op.name for op in run_order([[b.op], [a.op], [c.op]], graph.get_operations()) if op.type != "Const"]
    ['b', 'a', 'c']
    """
    members = list(dict.fromkeys(ops))
    return _Schedule(members, _ranks(replayed, members, set(side))).run()


class _Schedule:
    """Kahn's algorithm over ``members``, the ready op of lowest rank first,
    except that an op TensorFlow may fuse into the op that reads it
    (:meth:`_partner`: an op's only reader, such as the product of a
    SiLU reading a sigmoid; a convolution's bias addition) is held until
    that reader waits for nothing else, then runs, and the reader right
    after it.

    TensorFlow fuses such pairs into one op (oneDNN's graph pass merges a
    ``Conv2D`` with its ``BiasAdd`` whatever control edges they carry) and
    the fused op takes both ops' edges: an op chained between the two
    (Keras reshapes a convolution's bias after the convolution) would then
    wait on the fused op and feed it, a cycle ("828 nodes in a cycle" on a
    depthwise-separable net)."""

    def __init__(self, members: List[tf.Operation], ranks: Dict[tf.Operation, float]):
        self.ranks = ranks
        self.creation = {op: n for n, op in enumerate(sorted(members, key=lambda o: o._id))}  # pylint: disable=protected-access
        preds = _predecessors(members)
        self.succs: Dict[tf.Operation, List[tf.Operation]] = defaultdict(list)
        self.pending = {op: len(before) for op, before in preds.items()}
        for op, before in preds.items():
            for p in before:
                self.succs[p].append(op)
        self.held: Dict[tf.Operation, List[tf.Operation]] = defaultdict(list)
        self.ready: List[tuple] = []
        self.members = members

    def run(self) -> List[tf.Operation]:
        for op in self.members:
            if not self.pending[op]:
                self._ready(op)
        order = []
        while self.ready or self.held:
            if not self.ready:
                self._release_all()
            op = heapq.heappop(self.ready)[-1]
            order.append(op)
            for s in self.succs[op]:
                self.pending[s] -= 1
                if not self.pending[s]:
                    partner = self._partner(op)
                    self._ready(s, at_once=partner is not None and partner in (s, self._partner(s)))
                else:
                    self._release(s)
        if len(order) != len(self.members):
            raise ValueError("the step's ops form a cycle: no order runs them")
        return order

    def _release_all(self) -> None:
        """Queue every held op: nothing else can run (a held op's reader
        waits, through other ops, on the held op itself)."""
        for held in list(self.held.values()):
            for op in held:
                self._queue(op, 0)
        self.held.clear()

    def _partner(self, op: tf.Operation) -> Optional[tf.Operation]:
        """The op TensorFlow may fuse ``op`` into: the only op that reads
        it (control edges aside, through the ``Identity`` ops Grappler
        removes), or the bias addition that reads a contraction (oneDNN
        merges a ``Conv2D`` into its ``BiasAdd`` even when the convolution
        is also kept for the backward pass)."""
        readers = {c for t in op.outputs for c in _readers_through_identities(t) if c in self.pending}
        if len(readers) == 1:
            return readers.pop()
        if op.type in CONTRACTIONS:
            return next((c for c in readers if c.type in BIAS_ADDITIONS and c.inputs
                         and _without_identities(c.inputs[0]) is op.outputs[0]), None)
        return None

    def _ready(self, op: tf.Operation, at_once: bool = False) -> None:
        """``op`` may run: queue it (first, ``at_once``), or hold it while
        the op it may be fused into waits for other ops."""
        successor = self._partner(op) if op.type not in FREE else None
        if successor is not None and self.pending[successor] > 1:
            self.held[successor].append(op)
            self._release(successor)
            return
        self._queue(op, 0 if at_once else 1)

    def _queue(self, op: tf.Operation, urgency: int, last: int = 0) -> None:
        """Queue ``op``: by ``urgency``, then ``last``, then rank and creation."""
        heapq.heappush(self.ready, (urgency, last, self.ranks[op], self.creation[op], op._id, op))  # pylint: disable=protected-access

    def _release(self, successor: tf.Operation) -> None:
        """Queue the ops held for ``successor`` once it waits for them alone."""
        held = self.held.get(successor)
        if held and len(held) == self.pending[successor]:
            del self.held[successor]
            first = _without_identities(successor.inputs[0]).op if successor.inputs else None
            for op in held:  # the op fused with the successor (its first input) last, right before it
                self._queue(op, 0, int(op is first))


def _predecessors(members: List[tf.Operation]) -> Dict[tf.Operation, Set[tf.Operation]]:
    """Each op's predecessors among ``members``: its data and control inputs,
    and, for a stateful op, the stateful op made before it (the order
    TensorFlow's automatic control dependencies add)."""
    inside = set(members)
    preds = {op: {t.op for t in op.inputs if t.op in inside} | {c for c in op.control_inputs if c in inside}
             for op in members}
    stateful = sorted((op for op in members if op._is_stateful), key=lambda o: o._id)  # pylint: disable=protected-access
    for earlier, later in zip(stateful, stateful[1:]):
        preds[later].add(earlier)
    for op in members:
        preds[op].discard(op)
    return preds


def _ranks(replayed: Sequence[Sequence[tf.Operation]], members: List[tf.Operation],
           side: Set[tf.Operation]) -> Dict[tf.Operation, float]:
    """Each op's place in :func:`run_order` (see there)."""
    ranks: Dict[tf.Operation, float] = {}
    for position, ops in enumerate(replayed):
        for op in ops:
            ranks.setdefault(op, position)
    inside = set(members)
    topological = _topological(members)
    for op in reversed(topological):  # before the earliest op it feeds
        if op in ranks:
            continue
        if op in side:
            ranks[op] = AS_SOON_AS_READY
            continue
        fed = [ranks[c] for t in op.outputs for c in t.consumers() if c in inside and c in ranks]
        fed += [ranks[c] for c in _control_outputs(op) if c in inside and c in ranks]
        if fed:
            ranks[op] = min(fed)
    for op in topological:  # else right after the latest op it reads
        if op not in ranks:
            read = [ranks[t.op] for t in op.inputs if t.op in ranks] + [ranks[c] for c in op.control_inputs
                                                                        if c in ranks]
            ranks[op] = max(read, default=AS_SOON_AS_READY)
    return ranks


def _control_outputs(op: tf.Operation) -> List[tf.Operation]:
    return op._control_outputs  # pylint: disable=protected-access


def _topological(members: List[tf.Operation]) -> List[tf.Operation]:
    """``members`` in an order that follows their edges (creation order, repaired)."""
    from memsaving.tf.forward import topological_order  # pylint: disable=import-outside-toplevel

    return topological_order(sorted(members, key=lambda o: o._id))  # pylint: disable=protected-access


# -- the edges ------------------------------------------------------------------------------------


def chain(order: Sequence[tf.Operation], needed: Set[tf.Operation]) -> int:
    """Make each op of ``order`` wait for the op before it; return the
    number of control edges added.

    Only ops of ``needed`` (what the step runs) are chained, and neither
    :data:`FREE` ops nor ops inside TF1 control-flow contexts;
    :data:`WAIT_ON_INPUT` ops wait through their first input; a bias
    gradient oneDNN may merge into a filter gradient
    (:func:`merged_bias_gradients`) neither waits nor is waited on, nor
    is what reads it."""
    merged = merged_bias_gradients(order)
    unwaitable = _after(merged, order)
    added = 0
    last: Optional[tf.Operation] = None
    for op in order:
        if op not in needed or op.type in FREE or op._control_flow_context is not None:  # pylint: disable=protected-access
            continue
        if last is not None and op not in merged:
            added += _wait(op, last)
        if op not in unwaitable:
            last = op
    return added


def merged_bias_gradients(ops: Sequence[tf.Operation]) -> Set[tf.Operation]:
    """The bias gradients among ``ops`` that oneDNN's graph pass may merge
    into a filter gradient: one reads the same incoming gradient, once
    Grappler has removed the ``Identity`` ops between.

    The pass merges whatever control edges the two carry, and the filter
    gradient it picks may belong to another unit, far from the bias
    gradient in the order: an op waiting on the bias gradient may then feed
    the merged op (a cycle, seen on VGG16 and ResNet50V2), and a wait given
    to the bias gradient would make the merged op wait on ops after it.  So
    they are left out of the chain; the filter gradient they merge into
    runs them.  Other bias gradients (a Dense layer's) are chained like any
    op: left alone, the executor may defer them to the end of the step,
    holding every layer's incoming gradient until then."""
    merged = set()
    for op in ops:
        if op.type == "BiasAddGrad" and op.inputs:
            incoming = _without_identities(op.inputs[0])
            if any(c.type in FILTER_GRADIENTS and _without_identities(c.inputs[2]) is incoming
                   for c in _readers_through_identities(incoming)):
                merged.add(op)
    return merged


def _without_identities(t: tf.Tensor) -> tf.Tensor:
    """``t`` with the Identity ops it was passed through skipped."""
    while t.op.type == "Identity" and t.op.inputs:
        t = t.op.inputs[0]
    return t


def _readers_through_identities(t: tf.Tensor) -> List[tf.Operation]:
    """The ops that read ``t``, directly or through Identity ops."""
    found, stack = [], [t]
    while stack:
        for reader in stack.pop().consumers():
            if reader.type == "Identity":
                stack.append(reader.outputs[0])
            else:
                found.append(reader)
    return found


def _wait(op: tf.Operation, last: tf.Operation) -> int:
    """Make ``op`` wait for ``last`` unless it already reads it; 1 if an edge was added."""
    if last in op.control_inputs or any(t.op is last for t in op.inputs):
        return 0
    if op.type in WAIT_ON_INPUT:
        if not op.inputs:
            return 0
        op._update_input(0, waiting(op.inputs[0], [last], f"{op.name}_"))  # pylint: disable=protected-access
        return 1
    op._add_control_inputs([last])  # pylint: disable=protected-access
    return 1


def waiting(t: tf.Tensor, wait_for: Sequence[tf.Operation], prefix: str) -> tf.Tensor:
    """``t`` passed through an Identity that waits on ``wait_for`` (the
    Identity forwards ``t``'s buffer; nothing is copied)."""
    with tf.device(t.op.device), tf.control_dependencies(list(wait_for)):
        return tf.identity(t, name=f"{prefix}wait")


def _after(sources: Set[tf.Operation], ops: Sequence[tf.Operation]) -> Set[tf.Operation]:
    """``sources`` and the ops of ``ops`` that read them, directly or through each other."""
    members = set(ops)
    return _reachable(sources, lambda op: [c for t in op.outputs for c in t.consumers() if c in members])


# -- one inter-op thread: a unit's gradient groups ----------------------------------------------------


GROUP_NEVER_WAITS = METADATA | FILTER_GRADIENTS | {"BiasAddGrad"}
"""Op types :func:`chain_gradient_groups` gives no control input: constants
and shapes (Grappler folds what they feed only while they carry no edge),
and the bias gradients and filter gradients oneDNN merges."""


def chain_gradient_groups(groups: Sequence[Sequence[tf.Operation]],
                          first_wait_for: Sequence[tf.Operation] = (),
                          useful: Optional[Set[tf.Operation]] = None) -> int:
    """Make each group's first ops wait for the previous group's last ops:
    the order used with one inter-op thread, where :func:`pin_step` would
    starve the caller's ops.

    A sequential executor runs one op at a time anyway, and deterministically;
    but it follows the chain of data gradients down a unit and leaves the
    weight gradients for the unit's end, above the replay.  Chaining every
    op would be worse: an executor with one thread runs a chain of ready ops
    inline, and what it hands to its pool (the caller's reductions of the
    gradients, made after :func:`memsaving.gradients` returns) waits until
    the chain ends, holding every gradient.  So only the gradient ops of one
    ``tf.gradients`` call are chained, group by group (:func:`gradient_groups`,
    in the order given): a group's *first* ops (reading nothing made inside
    it, constants and shapes aside) wait for the previous group's *last* ops
    (feeding nothing inside it); the first group's for ``first_wait_for``.
    Bias gradients and what reads them are never waited on, and ops outside
    ``useful`` (:func:`feeding_results`) neither.  Returns the number of
    control edges added.
    """
    added = 0
    waited: List[tf.Operation] = list(first_wait_for)
    ops = [op for group in groups for op in group]
    unwaitable = _after({op for op in ops if op.type == "BiasAddGrad"}, ops)
    for group in groups:
        members = set(group)
        if waited:
            for op in group:
                if op.type not in GROUP_NEVER_WAITS and not any(t.op in members and t.op.type not in METADATA
                                                                for t in op.inputs):
                    missing = [w for w in waited if w not in op.control_inputs and w is not op]
                    if missing:
                        op._add_control_inputs(missing)  # pylint: disable=protected-access
                        added += len(missing)
        last = [op for op in group if op not in unwaitable and (useful is None or op in useful)
                and not any(c in members for t in op.outputs for c in t.consumers())]
        if last:
            waited = last
    return added


def feeding_results(made: Sequence[tf.Operation], results: Sequence) -> Set[tf.Operation]:
    """The ops of ``made`` that the gradients ``results`` are computed from
    (the others the function runtime prunes: a wait on one would make it
    run, and keep the activation it reads alive)."""
    return must_run([t.op for t in _tensors(results)]) & set(made)


# -- all together -----------------------------------------------------------------------------------


def one_at_a_time(made: Sequence[tf.Operation], results: Sequence) -> int:
    """Chain the ops of ``made`` that ``results`` need, in an order that
    follows their edges; return the control edges added.

    The profiler runs one op's gradient this way (:mod:`memsaving.tf.profiles`)
    because :func:`pin_step` runs the step's gradient ops one after another:
    measured with the kernels free to run at once, a convolution's two
    gradients (Eigen's, each with a 32 MiB work buffer) overlapped and the
    profile doubled a temporary the pinned step never holds.  The order
    follows every edge of the graph, not only those among ``made``: a
    loop's gradient gives the forward loop new inputs that new ops read.

    Examples
    --------
    Two independent kernels made for a gradient: the second now waits.

    >>> import tensorflow as tf
    >>> with tf.Graph().as_default():
    ...     first, second = tf.sin(tf.ones([2]), name="first"), tf.cos(tf.ones([2]), name="second")
    ...     edges = one_at_a_time([first.op, second.op], [first, second])
    >>> edges, [op.name for op in second.op.control_inputs]
    (1, ['first'])
    """
    made = list(made)
    if not made:
        return 0
    needed = must_run(t.op for t in _tensors(results)) & set(made)
    # ordered with the rest of the graph: a loop's gradient feeds new inputs
    # (its accumulators) to the forward loop, which other new ops read
    return chain(_topological(made[0].graph.get_operations()), needed)


def pin_step(labels: Sequence[str], units: UnitOps, graph: tf.Graph, made: Sequence[tf.Operation],
             results: Sequence, ys: Sequence[tf.Tensor]) -> int:
    """Make the step run in the order of the replay ``labels`` (the plan's
    :attr:`~memsaving.sim.simulate.Simulation.labels`); return the control
    edges added.

    ``units``: the ops the rewrite made for each action; ``made``: every op
    the rewrite made; ``results``: the gradients it returns; ``ys``: what
    was differentiated.  The ops ordered are the forward ops the replay
    names, what the rewrite made and, in a ``tf.function`` (which runs
    every op with a side effect), the side computations of the forward
    pass (:func:`side_ops`).

    Examples
    --------
    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with graph.as_default():
    ...     a = tf.square(tf.constant(1.0), name="a")
    ...     b = tf.square(tf.constant(2.0), name="b")
    ...     y = tf.add(a, b, name="y")
    >>> pin_step(["forward b", "forward a", "forward y"], UnitOps(), graph, [], [], [y])
    1
    >>> [op.name for op in a.op.control_inputs]
    ['b']
    """
    graph_ops = {op.name: op for op in graph.get_operations()}
    replayed = replayed_ops(labels, graph_ops, units)
    forward = [graph_ops[name] for kind, _, name in (label.partition(" ") for label in labels)
               if kind == "forward" and name in graph_ops]
    made_set = set(made)
    effects = [op for op in graph_ops.values() if has_side_effect(op) and op not in made_set] \
        if graph.building_function else []
    needed = must_run([t.op for t in _tensors(results)] + [y.op for y in ys] + effects)
    side = side_ops(forward, effects, made_set)
    members = [op for op in list(forward) + list(made) + sorted(side, key=lambda o: o._id)  # pylint: disable=protected-access
               if op in needed]
    return chain(run_order(replayed, members, side), needed)


def side_ops(forward: Sequence[tf.Operation], effects: Sequence[tf.Operation],
             made: Set[tf.Operation]) -> Set[tf.Operation]:
    """The side computations of the forward pass: the ops with a side
    effect among ``effects`` that read what the forward ops make (Keras'
    moving averages read a batch's mean), and what they read that the
    forward pass does not (the moving average's old value times the
    momentum), other than what the rewrite ``made``.  They run anyway in a
    ``tf.function``; left to the executor, they run at any time, and the new
    values they make outlive the step where the allocator found room."""
    after = _descendants(forward, made)
    before = must_run(forward)
    return {op for op in must_run([e for e in effects if e in after]) if op not in before and op not in made}


def _descendants(ops: Sequence[tf.Operation], excluded: Set[tf.Operation]) -> Set[tf.Operation]:
    """``ops`` and the ops that read them, directly or through each other, except ``excluded``."""
    return _reachable([op for op in ops if op not in excluded], lambda op: [
        c for c in [c for t in op.outputs for c in t.consumers()] + _control_outputs(op) if c not in excluded])


def _tensors(values: Iterable) -> List[tf.Tensor]:
    """The tensors of ``values`` (gradients: tensors, IndexedSlices or None)."""
    found = []
    for value in values:
        if isinstance(value, tf.IndexedSlices):
            found.extend([value.values, value.indices])
        elif value is not None:
            found.append(value)
    return found
