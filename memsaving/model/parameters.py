"""Which ops compute parameters (weights and values derived from them) and
which compute activations, on the neutral graph model (no TensorFlow).

Checkpoint candidates leave parameter ops out of the activation graph, and
the swap planner never offers their outputs: both follow this one rule.
"""

from __future__ import annotations

from memsaving.model.graph import GraphModel

PARAMETER_READ_TYPES = frozenset({"ReadVariableOp"})
"""Ops that only read parameters: their outputs live for the whole step
anyway, so they are not activations and never constrain checkpoint choice."""


def parameter_ops(model: GraphModel) -> set:
    """Ops whose outputs are parameters (weights and values derived from
    them), not activations.

    Variable reads, and the reshapes, casts, squeezes and transposes of
    weights that layers apply (Keras reshapes BatchNorm's gamma and beta,
    squeezes kernels, a tied embedding is transposed): they are kept for the
    whole step anyway and are cheap, so they are not activations.  Left in
    the activation graph they would look like inputs appearing late in the
    network and hide every separator before them.

    Being computed from constants and variables alone is not enough: a
    benchmark fed by ``tf.ones``, a generator with a learned input, an input
    pipeline built inside the step make their *data* that way, and calling
    all of it parameters leaves no activation to checkpoint.  Data are the
    step's real inputs (external tensors that are not constants or
    variables: function arguments, captured tensors), the outputs of
    stateful ops (random numbers, dataset reads), and everything computed
    from data.  Of the copyable ops computed from constants and variables
    alone:

    * an op is *weight-like* when it does at most one FLOP per byte it reads
      and writes (reshapes, casts, transposes, elementwise maps, reductions,
      matrix-vector products; costs are FLOPs, as :mod:`memsaving.tf.extract`
      gives them) and its output is at most :data:`WIDENING` times its
      largest input (a dtype cast; more means new elements were made: a
      fill, a broadcast or tile to a batch, an outer product).  Weight-like
      ops are parameters unless they read data;
    * an op that is not weight-like and depends on no ``x`` (not forward)
      is data: ``tf.ones(shape)``, a stateless random draw from a constant
      seed;
    * an op that is not weight-like but depends on an ``x`` (a product of
      two weights, a matrix product over a learned input) is a parameter
      when its value reaches data only through weight-like ops (a LoRA
      product ``A @ B`` added to a kernel, a relative-position bias gathered
      from its table, a regulariser added to the loss), and data otherwise
      (a learned input's first layer: its value runs on to the loss through
      further matrix products).

    Sizes cannot always tell a batch from a weight: a learned input that
    meets only cheap elementwise ops before the loss, or a batch of one or
    two (whose matrix products are matrix-vector-like), still counts as a
    parameter, and so does everything computed from it.
    """
    closed = _computed_from_constants(model)
    weight_like = {i for i in closed if _weight_like(model, model.ops[i])}
    made = _computed_from(model, closed, {i for i in closed - weight_like if not model.ops[i].forward})
    absorbed = _reaches_data_through(model, closed - made, weight_like)
    made = _computed_from(model, closed, made | (closed - made - weight_like - absorbed))
    return closed - made


WIDENING = 8
"""Most an op's output may outgrow its largest input and still be a weight's
image: a dtype cast multiplies bytes by at most 8 (bool or int8 to float64)."""


def _computed_from_constants(model: GraphModel) -> set:
    """Variable reads and the copyable ops computed from constants,
    variables and such ops alone."""
    found = set()
    for i, op in enumerate(model.ops):
        if op.type in PARAMETER_READ_TYPES:
            found.add(i)
            continue
        if not op.copyable:
            continue  # stateful: random inputs and dataset reads are data, not parameters
        sources = [model.tensors[t] for t in op.inputs]
        if sources and all(
            (info.producer < 0 and info.constant) or info.producer in found for info in sources
        ):
            found.add(i)
    return found


def _computed_from(model: GraphModel, among: set, seeds: set) -> set:
    """``seeds`` and the ops of ``among`` that read them, directly or not."""
    found = set(seeds)
    for i in sorted(among - found):
        if any(model.tensors[t].producer in found for t in model.ops[i].inputs):
            found.add(i)
    return found


def _value_bytes(info) -> int:
    return info.nbytes if info.value_bytes is None else info.value_bytes


def _weight_like(model: GraphModel, op) -> bool:
    """Cheap and not much larger than its largest input (see
    :func:`parameter_ops`).  An input of unknown size (0 bytes) does not
    bound the output."""
    if op.type in PARAMETER_READ_TYPES:
        return True
    read = [_value_bytes(model.tensors[t]) for t in op.inputs]
    written = sum(_value_bytes(model.tensors[t]) for t in op.outputs)
    largest = max(read, default=0)
    if largest > 0 and written > WIDENING * largest:
        return False
    return op.cost <= sum(read) + written


def _reaches_data_through(model: GraphModel, undecided: set, weight_like: set) -> set:
    """Ops of ``undecided`` whose outputs are read only by data (ops outside
    ``undecided``) or by weight-like ops of the answer, and are not results
    (``ys``): their values only ever shape how data is computed."""
    ys = set(model.ys)
    found: set = set()
    for i in sorted(undecided, reverse=True):
        outputs = model.ops[i].outputs
        users = {c for t in outputs for c in model.consumers(t)}
        if users and not ys.intersection(outputs) and all(
            c not in undecided or (c in weight_like and c in found) for c in users
        ):
            found.add(i)
    return found
