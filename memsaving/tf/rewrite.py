"""The segment-by-segment backward pass with recomputation.

Given the forward graph and a set of *kept* ops (checkpoints, plus ops that
must never be recomputed), the backward pass is built unit by unit, from the
outputs back to the inputs:

* the **output unit**: the ops between the last kept tensors and ``ys``.  They
  are differentiated in place (their activations are alive at the end of the
  forward pass anyway), stopping at the kept tensors.
* one **segment** per copyable kept op ``P``: ``P`` and the non-kept forward
  ops it depends on, back to the previous kept tensors, are *copied*.  The
  copies read the kept tensors through fresh proxies and carry control
  dependencies on the ops producing the gradient of ``P``'s outputs and the
  gradients made by the unit built just before, so they run only when the
  backward pass reaches this segment (and after the previous segment's weight
  gradients, which the executor would otherwise defer), and their memory is
  freed right after.  ``tf.gradients`` is then called on the copies alone,
  and the gradient ops that read the copy of ``P`` itself are pointed at
  ``P``'s kept outputs, so that copy never runs (``P`` is not recomputed,
  except for function calls and functional control flow, whose gradients
  need outputs the kept original lacks).
* one **pass-through unit** per non-copyable kept op (stateful ops, control
  flow), and per kept op whose inputs are all kept (nothing to recompute):
  the original op is differentiated directly.
* for multi-level plans, an **advance** unit before a segment: the ops up to
  the segment's inner checkpoints are copied (after the segment's output
  gradients exist) and not differentiated; the sub-segments that follow read
  the inner checkpoints from these copies instead of the forward pass.

Gradients of each unit's inputs are accumulated and become the ``grad_ys`` of
the units before it.  Because every unit's ``tf.gradients`` call starts from
proxies that only the unit's copies consume, each call walks only its own
segment; the total work stays linear in the graph size.
"""

from __future__ import annotations

import re
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.framework.ops import get_gradient_function
from tensorflow.python.ops import default_gradient
from tensorflow.python.util import object_identity

from memsaving.tf.aggregation import Gradient, aggregate, producing_ops
from memsaving.tf.order import WAIT_ON_INPUT, UnitOps, chain_gradient_groups, feeding_results, gradient_groups, waiting
from memsaving.tf.extract import has_custom_gradient
from memsaving.tf.forward import ForwardGraph, is_copyable, is_trainable, ops_made_in
from memsaving.model.schedule import UnitKind, recomputes_anchor
from memsaving.tf.split_rewrite import SplitEmitter

GradientsFn = Callable[..., list]


CONVOLUTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative"})
"""Forward ops whose filter gradient oneDNN's graph pass can fuse with a
bias gradient that reads the same incoming gradient (see
:func:`_fusable_bias_gradient`)."""


def _convolution_output(t: tf.Tensor) -> bool:
    """A convolution's output, or its sum with a bias (whose gradient a
    convolution's filter gradient reads unchanged)."""
    op = t.op
    if op.type in ("BiasAdd", "AddV2", "Add"):
        return any(x.op.type in CONVOLUTIONS for x in op.inputs)
    return op.type in CONVOLUTIONS


class _Accumulator:
    """Gradient contributions received by each forward tensor."""

    def __init__(self):
        self._contributions = object_identity.ObjectIdentityDictionary()
        # incoming gradients of convolutions, Identity stripped: what their
        # filter gradients will read once Grappler removes the Identity ops
        self.convolution_gradients = object_identity.ObjectIdentitySet()

    def add(self, tensor: tf.Tensor, gradient: Optional[Gradient]) -> None:
        if gradient is None:
            return
        self._contributions.setdefault(tensor, []).append(gradient)
        if _convolution_output(tensor) and isinstance(gradient, tf.Tensor):
            self.convolution_gradients.add(_without_identities(gradient))

    def total(self, tensor: tf.Tensor) -> Optional[Gradient]:
        """The summed gradient of ``tensor``; later calls reuse the sum."""
        contributions = self._contributions.get(tensor)
        if not contributions:
            return None
        if len(contributions) > 1:
            contributions[:] = [aggregate(contributions)]
        return contributions[0]


class BackwardBuilder:
    """Builds the backward pass of one ``memsaving.gradients`` call."""

    def __init__(
        self,
        fwd: ForwardGraph,
        kept: set,
        steps: List[Tuple[str, Optional[tf.Operation], List[tf.Operation]]],
        gradients_fn: GradientsFn,
        gradient_kwargs: dict,
        probe: Optional[Callable[[str, list], object]] = None,
        chain_groups: bool = False,
    ):
        """``kept`` and ``steps`` come from the plan (memsaving.planners.planning):
        ``kept`` holds every op whose outputs are checkpoints (inner ones
        included), ``steps`` the units in execution order as ``(kind, anchor
        op, ops in topological order)``, so the rewrite copies exactly what
        was scored.  ``chain_groups``: chain each unit's gradient ops group
        by group (:func:`memsaving.tf.order.chain_gradient_groups`, for an
        executor with one inter-op thread)."""
        self.fwd = fwd
        self.kept = kept
        self.steps = steps
        # inner checkpoints rebuilt by advance units: forward tensor -> copy
        self.sources = object_identity.ObjectIdentityDictionary()
        self.gradients_fn = gradients_fn
        self.gradient_kwargs = gradient_kwargs
        self.probe = probe
        self.grads = _Accumulator()
        self.recomputed_ops = 0
        self.segments = 0
        # gradients made by the unit built last: the next segment's copies
        # also wait on them, so a unit's weight gradients are computed before
        # the next segment is recomputed (else the executor may defer them
        # and keep every segment's activations alive at once)
        self.previous_results: list = []
        # the ops made for each action the simulator replays, for memsaving.tf.order
        self.units = UnitOps()
        self.chain_groups = chain_groups

    # -- predicates ---------------------------------------------------------
    def is_kept(self, tensor: tf.Tensor) -> bool:
        return self.fwd.is_x(tensor) or tensor.op in self.kept

    def needs_proxy(self, tensor: tf.Tensor) -> bool:
        """Kept forward tensors through which gradient flows to earlier units."""
        return is_trainable(tensor) and self.fwd.contains_tensor(tensor) and self.is_kept(tensor)

    # -- units --------------------------------------------------------------
    def output_unit(self, ys: Sequence[tf.Tensor], grad_ys: Sequence, ops: List[tf.Operation]) -> None:
        """Differentiate the ops after the last kept tensors, in place."""
        inner, inner_grads = [], []
        for y, gy in zip(ys, grad_ys):
            if not self.fwd.contains_tensor(y):
                continue
            if gy is None:
                gy = _seed(y)
            if self.is_kept(y):
                self.grads.add(y, gy)
            else:
                inner.append(y)
                inner_grads.append(gy)
        if not inner:
            return
        boundary = self._boundary(ops)
        if not boundary:
            return
        stops = stop_before_function_calls(ops, boundary + _outside_inputs(ops, boundary))
        results = self._differentiate(ops, ops, inner, [stops.get(t, t) for t in boundary], grad_ys=inner_grads,
                                      stop_gradients=[stops.get(t, t) for t in stops.originals])
        for t, g in zip(boundary, results):
            self.grads.add(t, g)
        self.previous_results = [g for g in results if g is not None]

    def _output_gradients(self, op: tf.Operation) -> tuple:
        outs, out_grads = [], []
        for t in op.outputs:
            g = self.grads.total(t) if is_trainable(t) else None
            if g is not None:
                outs.append(t)
                out_grads.append(g)
        return outs, out_grads

    def unit(self, op, ops: Sequence[tf.Operation]) -> None:
        """Propagate the gradients of kept op ``op``'s outputs to its inputs
        (``ops``: the segment to copy when ``op`` is copyable; ``op`` may
        be a split region's :class:`~memsaving.tf.split_rewrite.SplitEmitter`)."""
        if isinstance(op, SplitEmitter) and len(ops) <= 1:
            self._split_region(op)  # its inputs are kept: nothing to recompute
            return
        outs, out_grads = self._output_gradients(op)
        if not outs:
            return
        if isinstance(op, SplitEmitter) or is_copyable(op):
            self._segment(op, ops, outs, out_grads)
        elif op.type == "ReadVariableOp":
            handle = op.inputs[0]
            if self.fwd.contains_tensor(handle):
                # The gradient of a variable read is the gradient of the value.
                self.grads.add(handle, out_grads[0])
        else:
            self._pass_through(op, outs, out_grads)

    def _split_region(self, region: SplitEmitter) -> None:
        """Differentiate a split region piece by piece, once the gradients
        of its outputs exist (:meth:`SplitEmitter.backward`)."""
        out_grads = object_identity.ObjectIdentityDictionary()
        for t in region.outputs:
            g = self.grads.total(t) if is_trainable(t) else None
            if g is not None:
                out_grads[t] = g
        if not out_grads:
            return
        self.segments += 1
        results = region.backward(out_grads, self._wait_for(list(out_grads.values())), self.gradients_fn,
                                  sources=self.sources, gradient_kwargs=self.gradient_kwargs)
        for t, g in results.items():
            self.grads.add(t, g)
        self._unit_results(list(results.values()), waited=True)

    def _boundary(self, ops: Sequence[tf.Operation]) -> list:
        seen = object_identity.ObjectIdentitySet()
        boundary = []
        members = set(ops)
        for op in ops:
            for t in op.inputs:
                if t.op not in members and t not in seen and self.needs_proxy(t):
                    seen.add(t)
                    boundary.append(t)
        return boundary

    def _pass_through(self, op, outs, out_grads) -> None:
        inputs = []
        seen = object_identity.ObjectIdentitySet()
        for t in op.inputs:
            if t not in seen and is_trainable(t) and self.fwd.contains_tensor(t):
                seen.add(t)
                inputs.append(t)
        if not inputs:
            return
        stops = stop_before_function_calls([op], inputs)
        readers = [stops.get(t, t) for t in inputs]
        results = self._differentiate([op], [op], outs, readers, grad_ys=out_grads, stop_gradients=readers)
        for t, g in zip(inputs, results):
            self.grads.add(t, g)
        self._unit_results(results, waited=False)

    def _wait_for(self, out_grads) -> list:
        """Ops a unit's first copies wait on: its output gradients and the
        previous unit's results, bias gradients included (except those
        Grappler may fuse into the next unit, see _fusable_bias_gradient)."""
        handed_on = object_identity.ObjectIdentitySet(
            _without_identities(g) for g in self.previous_results if not isinstance(g, tf.IndexedSlices))
        shared = (handed_on, self.grads.convolution_gradients)
        wait_for = []
        for g in list(out_grads) + [g for g in self.previous_results
                                    if not _fusable_bias_gradient(g, shared)]:
            wait_for.extend(producing_ops(g))
        return list({id(o): o for o in wait_for}.values())

    def _copy_ops(self, ops, proxies, wait_for, prefix, kind: str) -> dict:
        """Copies of ``ops`` reading each other, ``proxies``, rebuilt inner
        checkpoints, or else the forward tensors; roots wait on ``wait_for``.
        ``kind``: ``"recompute"`` (a segment's) or ``"advance"``, as the
        simulator names their actions."""
        copies = {}
        regions = object_identity.ObjectIdentityDictionary()  # a recomputed region's output -> its copy

        def read(t: tf.Tensor) -> tf.Tensor:
            if t in regions:
                return regions[t]
            if t.op in copies:
                return copies[t.op].outputs[t.value_index]
            if t in proxies:
                return proxies[t]
            return self.sources.get(t, t)

        def copied(t: tf.Tensor) -> bool:
            return t in regions or t.op in copies

        for original in ops:
            if isinstance(original, SplitEmitter):
                waits = () if any(copied(t) for t in original.inputs) else wait_for
                copy = original.recompute(read, waits, self.gradients_fn, self.gradient_kwargs, prefix)
                copies[original] = copy
                for t, c in zip(original.outputs, copy.outputs):
                    regions[t] = c
                continue
            inputs = [read(t) for t in original.inputs]
            control = [copies.get(c, c) for c in original.control_inputs]
            if not any(copied(t) for t in original.inputs):
                if original.type in WAIT_ON_INPUT and wait_for:
                    inputs[0] = waiting(inputs[0], wait_for, prefix)
                else:
                    control.extend(wait_for)
            copies[original] = copy_op(original, inputs, control, prefix)
            self.units.copied(kind, original.name, copies[original])
            if has_custom_gradient(original):
                copies[original]._gradient_function = self._reading_copies(  # pylint: disable=protected-access
                    get_gradient_function(original), copies)
        self.recomputed_ops += len(ops)
        return copies

    def _reading_copies(self, grad_fn: Callable, copies: dict) -> Callable:
        """``grad_fn`` (a ``tf.custom_gradient`` closure) made to read the
        recomputed copies instead of the forward tensors it captured.

        The closure reads the forward tensors it was built with (silu reads
        its argument), not the op it differentiates: left alone, the
        gradient of a copy keeps the original activations alive through the
        whole forward pass, which is what recomputing was meant to free.
        The copies hold the same values, so the gradients do not change."""
        def copied(t):
            if isinstance(t, tf.Tensor) and t.op in copies:
                return copies[t.op].outputs[t.value_index]
            return self.sources.get(t, t) if isinstance(t, tf.Tensor) else t

        def gradient(op, *grads):
            with ops_made_in(op.graph) as made:
                results = grad_fn(op, *grads)
            for new_op in made:
                for index, value in enumerate(new_op.inputs):
                    target = copied(value)
                    if target is not value:
                        new_op._update_input(index, target)  # pylint: disable=protected-access
            return [copied(g) for g in results] if isinstance(results, (list, tuple)) else copied(results)

        return gradient

    def advance(self, op: tf.Operation, ops: Sequence[tf.Operation]) -> None:
        """Rebuild the inner checkpoints of ``op``'s segment (multi-level)."""
        _, out_grads = self._output_gradients(op)
        if not out_grads:
            return
        self.segments += 1
        copies = self._copy_ops(ops, object_identity.ObjectIdentityDictionary(), self._wait_for(out_grads),
                                f"advance_{self.segments}/", "advance")
        for original, copy in copies.items():
            for source, target in zip(original.outputs, copy.outputs):
                self.sources[source] = target

    def _segment(self, op, ops, outs, out_grads) -> None:
        """Recompute ``op``'s segment after its output gradients exist."""
        wait_for = self._wait_for(out_grads)
        self.segments += 1
        prefix = f"recompute_{self.segments}/"
        boundary = self._boundary(ops)
        proxies = object_identity.ObjectIdentityDictionary()
        for t in boundary:
            with tf.device(t.op.device):
                proxies[t] = tf.identity(self.sources.get(t, t), name=f"segment_inputs_{self.segments}/{_PROXY_NAME}")
        copies = self._copy_ops(ops, proxies, wait_for, prefix, "recompute")
        copied_outs = [copies[op].outputs[_output_index(op, t)] for t in outs]
        results = self._differentiate(ops, [copies[o] for o in ops], copied_outs, list(proxies.values()),
                                      grad_ys=out_grads, first_wait_for=wait_for)
        if not recomputes_anchor(op.type):
            self._read_kept_outputs(op, copies[op])
        for t, g in zip(boundary, results):
            self.grads.add(t, g)
        # a kept anchor whose inputs are all kept recomputes nothing (its copy
        # never runs), so nothing in this unit waited: pass the wait on
        nothing_recomputed = len(ops) == 1 and not recomputes_anchor(op.type)
        self._unit_results(results, waited=not nothing_recomputed)

    def _differentiate(self, originals: Sequence, forward_ops: Sequence[tf.Operation], ys, xs, first_wait_for=(),
                       **kwargs) -> list:
        """``tf.gradients`` of one unit whose forward ops (in topological
        order) are ``forward_ops``, copies of ``originals`` or the originals
        themselves.  The ops it makes are recorded per forward op, for the
        order of the whole step (:mod:`memsaving.tf.order`); with
        ``chain_groups``, they are chained last op first, as the simulator
        runs them, the first ones also waiting on ``first_wait_for``, as
        the unit's copies do (a kept anchor's gradient reads only kept
        tensors and would otherwise start while earlier units still run)."""
        with ops_made_in(ys[0].graph) as made:
            results = self.gradients_fn(ys, xs, **kwargs, **self.gradient_kwargs)
        release_gradient_constants(made)
        self.units.differentiated(made, forward_ops, [op.name for op in originals])
        if self.chain_groups:
            chain_gradient_groups(gradient_groups(made, list(reversed(forward_ops))), list(first_wait_for),
                                  useful=feeding_results(made, results))
        return results

    def _unit_results(self, results: list, waited: bool) -> None:
        """Remember a unit's gradients for the next unit's copies to wait on.

        A unit whose copies waited for the earlier results replaces them; a
        unit that waited for nothing (differentiated in place, or a segment
        that recomputes nothing) adds to them.  Otherwise nothing would make
        the step wait for those earlier gradients, and TensorFlow's executor
        may defer them, weight gradients especially, to the end of the step
        with the activations they read; on residual and conv nets with
        Grappler's arithmetic optimizer on, budget plans then measured far
        above their prediction."""
        made = [g for g in results if g is not None]
        self.previous_results = made if waited else made + self.previous_results

    def _read_kept_outputs(self, op: tf.Operation, copy: tf.Operation) -> None:
        """Point the gradient ops that read ``copy``'s outputs at the kept
        outputs of ``op`` (or their rebuilt inner-checkpoint copies), so the
        copy of the kept anchor has no reader and is never run."""
        for original, copied in zip(op.outputs, copy.outputs):
            kept = self.sources.get(original, original)
            for consumer in list(copied.consumers()):
                for index, value in enumerate(consumer.inputs):
                    if value is copied:
                        consumer._update_input(index, kept)  # pylint: disable=protected-access
        self.recomputed_ops -= 1

    def _probe(self, label: str) -> None:
        """Let the probe observe the unit just built.

        Nothing waits on the probe, so the schedule stays that of an
        unprobed run (a probe may run a little after the next unit starts;
        the peaks it reads still partition the step)."""
        if self.probe is not None:
            self.probe(label, list(self.previous_results))

    # -- driver -------------------------------------------------------------
    def build(self, ys, grad_ys, xs, unconnected_zero: bool) -> list:
        output_ops = [ops for kind, _, ops in self.steps if kind == UnitKind.OUTPUT]
        # always first: it also seeds the gradients of ys that are kept
        self.output_unit(ys, grad_ys, output_ops[0] if output_ops else [])
        self._probe("output")
        for kind, op, ops in self.steps:
            if kind == UnitKind.ADVANCE:
                self.advance(op, ops)
            elif kind == UnitKind.INPLACE:
                outs, out_grads = self._output_gradients(op)
                if outs:
                    self._pass_through(op, outs, out_grads)
            elif kind != UnitKind.OUTPUT:
                self.unit(op, ops)
            if kind != UnitKind.OUTPUT:
                self._probe(f"{kind} {op.name}")
        results = []
        for x in xs:
            g = self.grads.total(x)
            if g is None and unconnected_zero:
                g = default_gradient.zeros_like(x)
            results.append(g)
        return results


def _output_index(op, t: tf.Tensor) -> int:
    """Which output of ``op`` (an op or a split region) ``t`` is."""
    if isinstance(op, SplitEmitter):
        return next(k for k, u in enumerate(op.outputs) if u is t)
    return t.value_index


def _outside_inputs(ops: Sequence[tf.Operation], boundary: list) -> list:
    """Trainable inputs of ``ops`` made by ops outside them, except ``boundary``.

    The output unit differentiates the original ops in place; stopping at
    these keeps that call from walking past the unit into ops that are not
    forward, such as those behind the caller's ``stop_gradients``, whose
    gradient tf.gradients does not take (it would reach ``xs`` through them).
    """
    members = set(ops)
    seen = object_identity.ObjectIdentitySet(boundary)
    outside = []
    for op in ops:
        for t in op.inputs:
            if t.op not in members and t not in seen and is_trainable(t):
                seen.add(t)
                outside.append(t)
    return outside


FUNCTION_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
"""Ops that call a graph function (Keras runs grouped convolutions through one)."""


class StopTensors(object_identity.ObjectIdentityDictionary):
    """The tensors a ``tf.gradients`` call stops at (``originals``, in order),
    mapped to the Identity that stands for them where they need one."""

    def __init__(self, originals: Sequence[tf.Tensor]):
        super().__init__()
        self.originals = list(originals)


def _calls_a_function(op: tf.Operation) -> bool:
    return op.type in FUNCTION_CALLS or op.graph._is_function(op.type)  # pylint: disable=protected-access


def stop_before_function_calls(ops: Sequence[tf.Operation], stops: Sequence[tf.Tensor]) -> StopTensors:
    """Put an Identity between each of ``stops`` made by a function call and
    its readers among ``ops`` (forward ops differentiated in place).

    ``tf.gradients`` never calls the gradient function of an op it stops at,
    but for a function call it then builds a ``SymbolicGradient`` instead and
    adds its results to the call's inputs' gradients.  That op cannot run
    on a function that carries its own gradient (Keras' grouped convolution
    on CPU, a nested ``tf.function(jit_compile=True)``: "NotFoundError ...
    SymbolicGradient"), and were it to run, it would count the call's
    gradient twice: once here and once in the unit that owns the call.
    Stopping at an Identity reading the call's output stops the walk there;
    the Identity forwards the buffer (nothing is copied) and Grappler removes
    it."""
    result = StopTensors(stops)
    for t in stops:
        if t in result or not _calls_a_function(t.op):
            continue
        with tf.device(t.op.device), tf.control_dependencies(None):
            stand_in = tf.identity(t, name=f"{t.op.name.split('/')[-1]}_stop")
        for op in ops:
            for index, value in enumerate(op.inputs):
                if value is t:
                    op._update_input(index, stand_in)  # pylint: disable=protected-access
        result[t] = stand_in
    return result


def _seed(y: tf.Tensor) -> tf.Tensor:
    """The default gradient of ``y`` (ones), made after ``y``.

    Grappler folds a seed that does not wait for ``y`` into a constant, and
    the gradient ops it feeds (``g * b`` for a loss ``sum(a * b)``) then
    become ready during the forward pass: TensorFlow ran them there and held
    their results through the rest of it, above the predicted peak."""
    with tf.control_dependencies([y]):
        return default_gradient.ones_like(y)


def _fusable_bias_gradient(gradient, shared: Sequence[object_identity.ObjectIdentitySet]) -> bool:
    """True for a bias gradient (BiasAddGrad, possibly reshaped or cast) that
    Grappler may fuse into a later unit: its incoming gradient is, up to
    Identity ops (which Grappler removes), in one of the sets ``shared``: the
    previous unit's results, and the incoming gradients of convolutions.

    oneDNN's graph pass fuses BiasAddGrad with a Conv2DBackpropFilter that
    reads the same incoming gradient, whichever convolution that filter
    gradient belongs to, and which one it picks varies from run to run.  When
    a checkpoint sits between a convolution and its BiasAdd, the two ops
    belong to consecutive units (a cycle, seen on VGG16).  When a residual
    ``Add`` sums a biased convolution and a shortcut convolution, both
    receive the same gradient, and the shortcut may be recomputed in a later
    unit (ResNet50V2: "1937 nodes in a cycle" in some runs of one plan).  A
    later unit waiting on the fused op would wait on itself, so such bias
    gradients are not waited on.

    Every other bias gradient is: nothing else makes the step run it before
    the end, and TensorFlow's executor may defer it there, holding the
    incoming gradient (an activation-sized buffer) of every biased layer to
    the end of the step, which cancels the saving on biased layers (Keras
    Dense, EinsumDense) when the executor runs one op at a time.
    """
    if gradient is None or isinstance(gradient, tf.IndexedSlices):
        return False
    op = gradient.op
    while op.type in ("Reshape", "Identity", "Cast") and op.inputs:
        op = op.inputs[0].op
    if op.type != "BiasAddGrad":
        return False
    incoming = _without_identities(op.inputs[0])
    return any(incoming in tensors for tensors in shared)


def _without_identities(t: tf.Tensor) -> tf.Tensor:
    """``t`` with the Identity ops it was passed through skipped
    (``tf.gradients`` wraps each ``grad_ys`` in one)."""
    while t.op.type == "Identity" and t.op.inputs:
        t = t.op.inputs[0]
    return t


def release_gradient_constants(made: Sequence[tf.Operation]) -> None:
    """Move the wait of a gradient's constant factor to its reader, where
    the other factor is a forward ``Mul`` (outside loops).

    TensorFlow's gradient functions make constants wait on the incoming
    gradient (``SquareGrad``'s 2.0).  When a recomputed copy leaves a forward
    ``Mul`` with one reader, ``2 * (a * b)``, Grappler's constant folding
    rewrites it as ``a * (2 * b)`` and the forward ``Mul`` inherits the
    constant's wait on a backward op that itself depends on that ``Mul``: a
    cycle.  Grappler then gives up on the whole function, which runs
    unoptimized (no fused kernels, a different peak).  The reader keeps the
    wait (without it, a product of forward tensors would run in the forward
    pass and hold its buffer until the backward one); the constant itself
    costs nothing to make early.  Only this pattern is touched: freeing every
    gradient constant lets Grappler move other products into the forward
    pass, which raised a BatchNorm stack's peak.  Inside a while loop the
    wait puts the constant in the loop's frame, so it stays."""
    made_ids = {id(o) for o in made}

    def forward_product(t: tf.Tensor) -> bool:
        # a Mul this gradient call did not make: a forward op or its
        # recomputed copy (or, rarely, an earlier unit's gradient op)
        source = _behind_identities(t)
        return source.op.type == "Mul" and id(source.op) not in made_ids

    for op in made:
        if op.type != "Const" or not op.control_inputs or op._control_flow_context is not None:  # pylint: disable=protected-access
            continue
        readers = list({id(r): r for t in op.outputs for r in t.consumers()}.values())
        if not any(r.type == "Mul" and any(forward_product(t) for t in r.inputs) for r in readers):
            continue
        waits = list(op.control_inputs)
        for reader in readers:
            reader._add_control_inputs([w for w in waits if w is not reader])  # pylint: disable=protected-access
        op._remove_all_control_inputs()  # pylint: disable=protected-access


def _behind_identities(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor an Identity/IdentityN chain forwards (Grappler bypasses them)."""
    while tensor.op.type in ("Identity", "IdentityN"):
        tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
    return tensor


def copy_op(op: tf.Operation, inputs: list, control_inputs: list, prefix: str) -> tf.Operation:
    """Create a copy of ``op`` reading ``inputs``, on ``op``'s device.

    Attributes (dtypes, function names, colocation) are taken from the NodeDef;
    the Python-side gradient function of nested function calls is carried over
    so the copy differentiates exactly like the original.
    """
    graph = op.graph
    attrs = {name: value for name, value in op.node_def.attr.items()}
    new = graph._create_op_internal(  # pylint: disable=protected-access
        op.type,
        inputs,
        dtypes=[t.dtype for t in op.outputs],
        name=prefix + op.name,
        attrs=attrs,
        op_def=op.op_def,
        compute_device=False,
    )
    new._set_device(op.device)  # pylint: disable=protected-access
    if control_inputs:
        new._add_control_inputs([c for c in control_inputs if c is not new])  # pylint: disable=protected-access
    gradient_function = getattr(op, "_gradient_function", None)
    if gradient_function is not None:
        new._gradient_function = gradient_function  # pylint: disable=protected-access
    for source, target in zip(op.outputs, new.outputs):
        target.set_shape(source.shape)
    return new


_PROXY_NAME = "proxy"
_PROXY = re.compile(rf"{_PROXY_NAME}(_\d+)?")


def is_segment_proxy(op: tf.Operation) -> bool:
    """Whether ``op`` is a recomputed segment's *proxy*: the ``Identity``
    put at each of the segment's inputs, read by the recomputed ops and
    their gradients (TensorFlow names a segment's second one ``proxy_1``...).
    Emitters that time copies by their readers look through it."""
    return op.type == "Identity" and _PROXY.fullmatch(op.name.rsplit("/", 1)[-1]) is not None
