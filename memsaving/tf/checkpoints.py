"""Turning the ``checkpoints`` argument into checkpoint ops of the model:
the forms that name TensorFlow tensors (``"collection"``, a list).  The
named modes ``"speed"`` and ``"memory"`` are planned on the model alone
(:mod:`memsaving.planners.modes`)."""

from __future__ import annotations

from typing import List, Sequence, Union

import tensorflow as tf

from memsaving.errors import CheckpointError
from memsaving.tf.extract import op_indices
from memsaving.tf.forward import ForwardGraph
from memsaving.model.graph import GraphModel
from memsaving.tf.marking import CHECKPOINTS_COLLECTION

MODES = ("collection", "speed", "memory")
"""Every string the ``checkpoints`` argument accepts."""

Checkpoints = Union[str, Sequence[tf.Tensor]]


def resolve_checkpoints(checkpoints: Checkpoints, fwd: ForwardGraph, model: GraphModel) -> List[int]:
    """Return the indices in ``model`` of the ops whose outputs are checkpoints,
    for ``"collection"`` or a list of tensors.

    Raises
    ------
    CheckpointError
        an unknown mode, a given tensor that is not between
        xs and ys, or no checkpoint found.
    """
    if isinstance(checkpoints, str):
        if checkpoints == "collection":
            return op_indices(model, _from_collection(fwd))
        if checkpoints in MODES:  # a caller's mistake, not the user's
            raise ValueError(f"checkpoints={checkpoints!r} is planned on the model, by memsaving.planners.modes")
        raise CheckpointError(
            f"unknown checkpoints mode {checkpoints!r}: pass a list of tensors or one of {MODES}"
        )
    if isinstance(checkpoints, (tf.Tensor, tf.Variable)):
        checkpoints = [checkpoints]
    tensors = list(checkpoints)
    outside = [t for t in tensors if not isinstance(t, tf.Tensor) or not fwd.contains_tensor(t)]
    if outside:
        names = ", ".join(getattr(t, "name", repr(t)) for t in outside[:5])
        raise CheckpointError(
            f"checkpoint tensor(s) not in the forward graph between xs and ys: {names}. "
            "A checkpoint must depend on xs (along float tensors) and ys must depend on it; "
            "pass tensors computed inside the same tf.function between xs and ys."
        )
    return op_indices(model, tensors)


def _from_collection(fwd: ForwardGraph) -> list:
    graph = fwd.ys[0].graph
    marked = [t for t in graph.get_collection(CHECKPOINTS_COLLECTION) if isinstance(t, tf.Tensor)]
    inside = [t for t in marked if fwd.contains_tensor(t)]
    if not inside:
        detail = (
            f"{len(marked)} tensor(s) are marked, but none lies between xs and ys"
            if marked else "no tensor is marked"
        )
        raise CheckpointError(
            f"checkpoints='collection' found no checkpoint: {detail}. Mark tensors with "
            "memsaving.checkpoint(t) (or tf.compat.v1.add_to_collection('checkpoints', t)) "
            "inside the function that computes ys, pass checkpoints=[tensors], or use "
            "checkpoints='memory' or 'speed'."
        )
    return inside
