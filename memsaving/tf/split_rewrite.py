"""Emitting split regions in the TensorFlow graph.

A split region (:mod:`memsaving.model.splitting`) is a run of ops computed
in ``k`` pieces of rows.  For each region :class:`SplitEmitter` makes:

* **the forward pieces**: the region's row inputs are reshaped so that
  their rows lie in one first dimension (a view) and split into ``k``
  pieces along it (views when the rows are aligned, as they are for float
  activations); each piece runs a copy of the region's ops
  (:func:`memsaving.tf.rows.piece_op`), the first ops of a piece waiting
  for the previous piece's results, so one piece's tensors are alive at a
  time; each region output is the concatenation of its pieces, reshaped
  back;
* **the backward pieces** (one backward unit): for each piece, the ops
  are copied again from the pieces of the region's inputs once the
  gradients of the region's outputs exist, differentiated with
  ``tf.gradients`` against the pieces of those gradients, and the results
  gathered: the gradients of whole inputs (weights) summed piece after
  piece, those of row inputs concatenated.  A weight that one product of
  the region reads (:func:`memsaving.model.splitting.in_place_weights`)
  (named, with its number of blocks, in the region's ``in_place``) is not
  differentiated by ``tf.gradients``: its gradient is made from the
  piece's input and the gradient of the product, a block of rows at a
  time, each block added in place into one buffer (``InplaceAdd`` on a
  buffer of its own from ``Empty``, which nothing else reads), so that
  neither a whole term nor a second sum is ever alive beside it;
* **the rewiring**: every reader of a region output (the ops after the
  region, the backward units that read it) reads the concatenated one, so
  the original ops of the region are read by nothing and TensorFlow prunes
  them: the region never runs whole.  Readers of the shape alone
  (``Shape``, ``Size``, ``Rank``) of any tensor of the region read a
  constant instead.

The pieces' results equal the whole ops' up to the order of float
summation (a weight gradient is a sum over rows, here summed piece by
piece).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import gen_array_ops
from tensorflow.python.util import object_identity

from memsaving.model.splitting import METADATA_OPS, SPLIT_OP_TYPE, SplitRegion, row_dims
from memsaving.tf.aggregation import producing_ops
from memsaving.tf.constant_values import from_constants
from memsaving.tf.forward import is_trainable
from memsaving.tf.rows import metadata_value, piece_op, piece_shape, row_splits, static_shape


FOLDED_BYTES = 10 * 2 ** 20
"""TensorFlow folds a value computed from constants into a constant when it
is at most this large (the limit of its constant folding); pieces of such
values up to this size are made once for every copy of a region, since
they are held as constants anyway."""


def piece_sizes(rows: int, chunks: int) -> List[int]:
    """Rows of each piece: as equal as can be, the larger ones first.

    Examples
    --------
    >>> piece_sizes(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(rows, chunks)
    return [base + 1 if c < extra else base for c in range(chunks)]


class SplitEmitter:
    """The TensorFlow side of one split region (module docstring)."""

    def __init__(self, region: SplitRegion, graph: tf.Graph, batch_size: int = 1):
        self.region = region
        self.graph = graph
        self.batch_size = batch_size
        self.ops = [graph.get_operation_by_name(name) for name in region.ops]
        self.members = set(self.ops)
        tensor = graph.get_tensor_by_name
        self.row_inputs = [tensor(name) for name in region.row_inputs]
        self.whole_inputs = [tensor(name) for name in region.whole_inputs]
        self.outputs = [tensor(name) for name in region.outputs]
        self.sizes = piece_sizes(region.rows, region.chunks)
        self.positions = {op: dict(row_splits(op, batch_size))[region.rows] for op in self.ops}
        self.merged = object_identity.ObjectIdentityDictionary()
        """Each region output -> its pieces concatenated (after :meth:`forward`)."""
        self._constant_ops: Dict[tf.Operation, bool] = {}
        """Ops known to compute (or not) values from constants alone."""
        self._constants: Dict = {}
        """(op, piece) or (tensor ref, piece) -> the piece made once for every copy."""

    @property
    def name(self) -> str:
        return self.region.name

    # -- pieces -------------------------------------------------------------
    def _rows_of(self, t: tf.Tensor, prefix: str) -> tf.Tensor:
        """``t`` (a row tensor) with its rows in one first dimension (a view)."""
        shape = static_shape(t, self.batch_size)
        with tf.device(t.op.device or None):
            return tf.reshape(t, [self.region.rows] + list(shape[row_dims(shape, self.region.rows):]),
                              name=f"{prefix}rows")

    def _piece_of(self, rows: tf.Tensor, c: int, prefix: str, waits: Sequence[tf.Operation] = ()) -> tf.Tensor:
        """Piece ``c`` of ``rows`` (from :meth:`_rows_of`; a view when the rows
        are aligned), made after ``waits``.  The slice waits, not the ops of
        the piece or the constants they read: waits on those let Grappler's
        constant folding and arithmetic optimizer close cycles."""
        start = sum(self.sizes[:c])
        rest = rows.shape.as_list()[1:]
        with tf.device(rows.op.device or None):
            piece = tf.slice(rows, [start] + [0] * len(rest), [self.sizes[c]] + rest, name=f"{prefix}piece_{c}")
        if waits:
            piece.op._add_control_inputs(list(waits))  # pylint: disable=protected-access
        return piece

    def _pieces_of_inputs(self, rows: List[tf.Tensor], c: int, prefix: str, waits: Sequence[tf.Operation]) -> Dict:
        """Piece ``c`` of each row input (``rows``: from :meth:`_rows_of`);
        the pieces of a value computed from constants are the region's own
        (:meth:`_constant_input_piece`)."""
        pieces = _by_tensor()
        for i, (t, r) in enumerate(zip(self.row_inputs, rows)):
            if self._shared_constant(t, c):
                pieces[t] = self._constant_input_piece(t, c)
            else:
                pieces[t] = self._piece_of(r, c, f"{prefix}{i}_", waits)
        return pieces

    def _shared_constant(self, t: tf.Tensor, c: int) -> bool:
        """True when piece ``c`` of ``t`` is made once for every copy of the
        region: ``t``'s value comes from constants alone and its piece is one
        TensorFlow folds (:data:`FOLDED_BYTES`)."""
        shape = static_shape(t, self.batch_size)
        if None in shape or not from_constants(t, self._constant_ops):
            return False
        return t.dtype.size * math.prod(shape) * self.sizes[c] // self.region.rows <= FOLDED_BYTES

    def _constant_input_piece(self, t: tf.Tensor, c: int) -> tf.Tensor:
        """Piece ``c`` of row input ``t``, a value computed from constants,
        made once and read by every copy of the region.  A fill (an all-true
        ``ones_like``) is made again on the piece's shape rather than cut,
        so that pieces of equal shape are equal ops (Grappler merges them
        into one); other values are cut from ``t`` itself, not from a copy."""
        key = (t.ref(), c)
        if key not in self._constants:
            prefix = f"{_scope(self.name)}/constants/{_scope(t.name)}_"
            with _outside_any_context(self.graph), tf.device(t.op.device or None):
                value = _fill_value(t)
                if value is None:
                    self._constants[key] = self._piece_of(self._rows_of(t, prefix), c, prefix)
                else:
                    shape = static_shape(t, self.batch_size)
                    self._constants[key] = tf.fill([self.sizes[c]] + list(shape[row_dims(shape, self.region.rows):]),
                                                   value, name=f"{prefix}fill_{c}")
        return self._constants[key]

    def _run_piece(self, c: int, pieces: Dict, prefix: str, whole: Optional[Dict] = None):
        """Copies of the region's ops on piece ``c``: ``pieces`` maps each row
        input to its piece, ``whole`` may map a whole input to the tensor to
        read instead of it.  Returns the piece's tensors by original tensor."""
        made = object_identity.ObjectIdentityDictionary()
        n = self.sizes[c]
        for op in self.ops:
            positions = self.positions[op]
            if op.outputs and all(self._shared_constant(t, c) for t in op.outputs):
                made.update(zip(op.outputs, self._constant_piece(op, c)))
                continue
            args = []
            for k, t in enumerate(op.inputs):
                if t in made:
                    args.append(made[t])
                elif k in positions:
                    args.append(pieces[t])
                else:
                    args.append(whole[t] if whole is not None and t in whole else t)
            with tf.device(op.device or None):
                outs = piece_op(op, args, self.region.rows, n, self.batch_size, f"{prefix}{op.name}", positions)
            for original, piece in zip(op.outputs, outs):
                made[original] = piece
        return made

    def _constant_piece(self, op: tf.Operation, c: int) -> List[tf.Tensor]:
        """The outputs of region op ``op`` on piece ``c`` when they are values
        computed from constants: made once, from the region's own pieces of
        its inputs and the original whole inputs, and read by every copy."""
        key = (op, c)
        if key not in self._constants:
            args = []
            for k, t in enumerate(op.inputs):
                if t.op in self.members:
                    args.append(self._constant_piece(t.op, c)[t.value_index])
                elif k in self.positions[op]:
                    args.append(self._constant_input_piece(t, c))
                else:
                    args.append(t)
            with _outside_any_context(self.graph), tf.device(op.device or None):
                self._constants[key] = piece_op(op, args, self.region.rows, self.sizes[c], self.batch_size,
                                                f"{_scope(self.name)}/constants/piece_{c}/{op.name}",
                                                self.positions[op])
        return self._constants[key]

    def _merge(self, pieces: List[tf.Tensor], like: tf.Tensor, name: str) -> tf.Tensor:
        shape = static_shape(like, self.batch_size)
        with tf.device(like.op.device or None):
            whole = tf.concat(pieces, axis=0, name=f"{name}_concat")
            return tf.reshape(whole, shape, name=f"{name}_merged")

    @property
    def type(self) -> str:
        return SPLIT_OP_TYPE

    @property
    def inputs(self) -> List[tf.Tensor]:
        """The region's inputs (row inputs, then whole ones), as an op's."""
        return self.row_inputs + self.whole_inputs

    # -- forward ------------------------------------------------------------
    def forward(self, wait_for: Sequence[tf.Operation] = ()) -> None:
        """Compute the region in pieces; :attr:`merged` holds its outputs."""
        self.merged.update(self._pieces_merged(lambda t: t, wait_for, f"{_scope(self.name)}/forward/"))

    def _pieces_merged(self, read: Callable, wait_for: Sequence[tf.Operation], prefix: str) -> Dict:
        """The region's outputs computed in pieces from ``read(t)`` for each
        input ``t``, put together (by output tensor)."""
        pieces = _by_tensor((t, []) for t in self.outputs)
        rows = [self._rows_of(read(t), f"{prefix}{i}_") for i, t in enumerate(self.row_inputs)]
        whole = _by_tensor((t, read(t)) for t in self.whole_inputs)
        control = list(wait_for)
        for c in range(self.region.chunks):
            # piece c's rows are sliced once the piece before is done
            inputs = self._pieces_of_inputs(rows, c, prefix, control)
            made = self._run_piece(c, inputs, f"{prefix}piece_{c}/", whole)
            for t in self.outputs:
                pieces[t].append(made[t])
            control = [made[t].op for t in self.outputs]
        return _by_tensor((t, self._merge(pieces[t], t, f"{prefix}output_{i}")) for i, t in enumerate(self.outputs))

    def recompute(self, read: Callable, wait_for: Sequence[tf.Operation], gradients_fn: Callable,
                  gradient_kwargs: Optional[dict], prefix: str) -> tf.Operation:
        """The region computed again in pieces from ``read(t)`` for each input
        ``t`` (a segment's copies), as one op whose outputs are the region's
        (in :attr:`outputs`' order) and whose gradient is :meth:`backward`
        on the same inputs: ``tf.gradients`` through a recomputed region
        differentiates it piece by piece, recomputing each piece, so the
        pieces made here are freed once put together."""
        # values computed from constants are not inputs: the pieces read the region's own
        inputs = [t for t in self.inputs if not from_constants(t, self._constant_ops)]
        given = [read(t) for t in inputs]

        @tf.custom_gradient
        def region(*args):
            copies = _by_tensor(zip(inputs, args))
            merged = self._pieces_merged(lambda t: copies.get(t, t), wait_for, f"{prefix}{_scope(self.name)}/")

            def gradient(*dys, variables=None):
                out_grads = _by_tensor((t, g) for t, g in zip(self.outputs, dys) if g is not None)
                found = self.backward(out_grads, [g.op for g in dys if g is not None], gradients_fn,
                                      sources=copies, gradient_kwargs=gradient_kwargs)
                seen = set()
                grads = []
                for t in inputs:  # an input both cut and read whole gets its gradient once
                    grads.append(None if id(t) in seen else found.get(t))
                    seen.add(id(t))
                return grads if variables is None else (grads, [None] * len(variables))

            return [merged[t] for t in self.outputs], gradient

        outputs = region(*given)
        return outputs[0].op

    # -- backward -----------------------------------------------------------
    def backward(self, out_grads: Dict, wait_for: Sequence[tf.Operation], gradients_fn: Callable,
                 sources: Optional[Dict] = None, gradient_kwargs: Optional[dict] = None) -> Dict:
        """The gradients of the region's inputs (by input tensor) given those
        of its outputs (``out_grads``, by output tensor), computed piece by
        piece; the first piece waits on ``wait_for``.  ``sources`` maps a
        forward tensor to the copy the backward pass should read instead."""
        sources = sources or {}
        gradient_kwargs = gradient_kwargs or {}
        prefix = f"{_scope(self.name)}/backward/"
        read = lambda t: sources.get(t, t) if sources else t  # noqa: E731
        wanted_rows = [t for t in self.row_inputs if is_trainable(t)]
        wanted_whole = [t for t in self.whole_inputs if is_trainable(t)]
        rows = [self._rows_of(read(t), f"{prefix}{i}_") for i, t in enumerate(self.row_inputs)]
        incoming = [(t, self._rows_of(g, f"{prefix}grad_{i}_")) for i, (t, g) in enumerate(out_grads.items())
                    if g is not None]
        whole = [read(t) for t in wanted_whole]
        blocks = dict(self.region.in_place)
        in_place = {k: self._in_place_product(t) for k, t in enumerate(wanted_whole) if t.name in blocks}
        sums: List[Optional[tf.Tensor]] = [None] * len(wanted_whole)
        slices: List[List] = [[] for _ in wanted_whole]
        row_grads: List[List] = [[] for _ in wanted_rows]
        control: List[tf.Operation] = list(wait_for)
        for c in range(self.region.chunks):
            # piece c's rows are sliced once the piece before is differentiated
            inputs = self._pieces_of_inputs(rows, c, prefix, control)
            made = self._run_piece(c, inputs, f"{prefix}piece_{c}/", _by_tensor(zip(wanted_whole, whole)))
            ys = [made[t] for t, _ in incoming]
            # a weight accumulated in place: the gradient of its product instead
            products = {k: made[reader.outputs[0]] for k, reader in in_place.items()
                        if made[reader.outputs[0]].op.type == reader.type}
            xs = ([inputs[t] for t in wanted_rows] + [products.get(k, w) for k, w in enumerate(whole)])
            grad_ys = [self._piece_of(r, c, f"{prefix}grad_{k}_") for k, (_, r) in enumerate(incoming)]
            results = gradients_fn(ys, xs, grad_ys=grad_ys, **gradient_kwargs)
            results_rows, results_whole = list(results[:len(wanted_rows)]), list(results[len(wanted_rows):])
            finished = []
            for k, product in products.items():
                grad = results_whole[k]
                results_whole[k] = None
                if grad is not None:
                    sums[k] = self._accumulate(sums[k], product.op, tf.convert_to_tensor(grad),
                                               blocks[wanted_whole[k].name], f"{prefix}in_place_{k}_{c}")
                    finished.append(sums[k])
            for k, g in enumerate(results_rows):
                row_grads[k].append(g)
                if g is not None:
                    finished.append(g)
            for k, g in enumerate(results_whole):
                if g is None:
                    continue
                if isinstance(g, tf.IndexedSlices):
                    slices[k].append(g)
                    finished.append(g.values)
                    continue
                with tf.device(g.op.device or None):
                    sums[k] = g if sums[k] is None else tf.add(sums[k], g, name=f"{prefix}sum_{k}_{c}")
                finished.append(sums[k])
            control = [op for g in finished for op in producing_ops(g)] or control
        found = object_identity.ObjectIdentityDictionary()
        for t, pieces in zip(wanted_rows, row_grads):
            if any(g is None for g in pieces):
                continue
            found[t] = self._merge([tf.convert_to_tensor(g) for g in pieces], t, f"{prefix}grad_of_{_scope(t.name)}")
        for k, t in enumerate(wanted_whole):
            if slices[k]:
                total = tf.IndexedSlices(tf.concat([s.values for s in slices[k]], 0),
                                         tf.concat([s.indices for s in slices[k]], 0), slices[k][0].dense_shape)
                found[t] = total if sums[k] is None else tf.add(sums[k], tf.convert_to_tensor(total))
            elif sums[k] is not None:
                found[t] = sums[k]
        return found

    def _in_place_product(self, weight: tf.Tensor) -> tf.Operation:
        """The product of the region whose weight ``weight`` is, which the
        model side chose to accumulate in place
        (:func:`memsaving.model.splitting.in_place_weights`: its one reader
        in the region).  Its first input is never transposed: such a
        ``MatMul`` has no rows to cut (:func:`memsaving.tf.rows.row_splits`),
        so no region takes it in."""
        return next(op for op in self.ops if any(t is weight for t in op.inputs))

    @staticmethod
    def _accumulate(total: Optional[tf.Tensor], product: tf.Operation, grad: tf.Tensor, blocks: int,
                    name: str) -> tf.Tensor:
        """``total`` (None before the first piece) plus the gradient of the
        weight of ``product`` (a piece's copy of a ``MatMul``) given
        ``grad``, the gradient of its output: made ``blocks`` blocks of
        weight rows at a time, each added into ``total``'s buffer in place."""
        x, weight = product.inputs[0], product.inputs[1]
        transposed = product.get_attr("transpose_b")  # weight is (out, in): its gradient is grad^T x
        weight_shape = weight.shape.as_list()
        step = -(-weight_shape[0] // blocks)
        with tf.device(grad.op.device or None):
            if total is None:
                with tf.control_dependencies([grad.op]):  # allocated when the first term is due
                    total = gen_array_ops.empty(weight_shape, dtype=grad.dtype, init=True, name=f"{name}_buffer")
            for b, start in enumerate(range(0, weight_shape[0], step)):
                size = min(step, weight_shape[0] - start)
                with tf.control_dependencies([total.op]):  # one block's term alive at a time
                    if transposed:
                        left, right = tf.slice(grad, [0, start], [-1, size], name=f"{name}_grad_{b}"), x
                    else:
                        left, right = tf.slice(x, [0, start], [-1, size], name=f"{name}_input_{b}"), grad
                term = tf.matmul(left, right, transpose_a=True, name=f"{name}_term_{b}")
                total = gen_array_ops.inplace_add(total, tf.range(start, start + size), term, name=f"{name}_add_{b}")
        return total

    # -- rewiring -----------------------------------------------------------
    def rewire(self) -> None:
        """Point every reader of a region output outside the region at its
        concatenated pieces, and every reader of a region tensor's shape
        at a constant (module docstring)."""
        for t in self.outputs:
            merged = self.merged[t]
            for consumer in list(t.consumers()):
                if consumer in self.members:
                    continue
                for index, value in enumerate(consumer.inputs):
                    if value is t:
                        consumer._update_input(index, merged)  # pylint: disable=protected-access
        for op in self.ops:
            for t in op.outputs:
                for consumer in list(t.consumers()):
                    if consumer.type in METADATA_OPS and consumer not in self.members:
                        value = metadata_value(consumer, self.batch_size)
                        if value is None:
                            continue
                        for reader in list(consumer.outputs[0].consumers()):
                            for index, v in enumerate(reader.inputs):
                                if v is consumer.outputs[0]:
                                    reader._update_input(index, value)  # pylint: disable=protected-access


def _fill_value(t: tf.Tensor) -> Optional[tf.Tensor]:
    """The scalar ``t`` is filled with, when it is a ``Fill`` of a constant
    scalar (over any shape), else None."""
    if t.op.type != "Fill":
        return None
    value = t.op.inputs[1]
    return value if value.op.type == "Const" and value.shape.rank == 0 else None


@contextlib.contextmanager
def _outside_any_context(graph: tf.Graph):
    """No control dependencies and no colocation: ops made once and read by
    every copy of a region must not wait on (or sit with) the first copy's."""
    with tf.control_dependencies(None), graph.colocate_with(None, ignore_existing=True):
        yield


def _by_tensor(pairs=()) -> object_identity.ObjectIdentityDictionary:
    """A dictionary keyed by tensors (which are not hashable) from ``pairs``."""
    found = object_identity.ObjectIdentityDictionary()
    for key, value in pairs:
        found[key] = value
    return found


def _scope(name: str) -> str:
    """A name made safe for a name scope."""
    return "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in name)

