"""Turning the ``checkpoints`` argument into checkpoint ops of the model."""

from __future__ import annotations

import logging
from typing import List, Sequence, Union

import tensorflow as tf

from memsaving import candidates
from memsaving.budget import lowest_peak_plan
from memsaving.errors import CheckpointError
from memsaving.extract import op_indices
from memsaving.forward import ForwardGraph
from memsaving.graph import GraphModel
from memsaving.marking import CHECKPOINTS_COLLECTION
from memsaving.simulate import simulate

MODES = ("collection", "speed", "memory")

logger = logging.getLogger("memsaving")

Checkpoints = Union[str, Sequence[tf.Tensor]]


def resolve_checkpoints(checkpoints: Checkpoints, fwd: ForwardGraph, model: GraphModel) -> List[int]:
    """Return the indices in ``model`` of the ops whose outputs are checkpoints.

    Raises:
      CheckpointError: unknown mode, a given tensor that is not between xs
        and ys, or no checkpoint found.
    """
    if isinstance(checkpoints, str):
        if checkpoints == "collection":
            return op_indices(model, _from_collection(fwd))
        if checkpoints == "speed":
            return _speed(model)
        if checkpoints == "memory":
            return _memory(model)
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


def _speed(model: GraphModel) -> List[int]:
    found = candidates.speed(model)
    if not found:
        raise CheckpointError(
            "checkpoints='speed' found no MatMul/Conv/Einsum op between xs and ys; "
            "use checkpoints='memory' or pass a list of tensors."
        )
    return found


def _memory(model: GraphModel) -> List[int]:
    cuts = candidates.memory_candidates(model)
    if not cuts:
        # Only graphs with (almost) no ops between xs and ys have no cut at
        # all; there is nothing to recompute, so plain backprop is the plan.
        logger.info("checkpoints='memory': no cut between xs and ys; nothing to recompute")
        return []
    return _lowest_peak(model, cuts)


def _lowest_peak(model: GraphModel, cuts) -> List[int]:
    """Of a few sqrt(n)-style plans and the budget search's lowest-peak plan,
    the one the simulator predicts lowest.

    sqrt(n) is only a rule of thumb: when the candidates are many
    overlapping cuts (level frontiers of a ResNet) it keeps too much, when
    they are single separators it is about right; on U-Nets, whose skips
    stay alive across the whole network, unevenly spaced cuts do better.
    All are single-level plans (about one extra forward pass at most); ties
    go to less recomputation.
    """
    singles = [(cut, b) for cut, b in cuts if len(cut) == 1]
    pools = [cuts] + ([singles] if singles and len(singles) < len(cuts) else [])
    options = []
    for pool in pools:
        root = max(1, int(round(len(pool) ** 0.5)))
        for count in sorted({max(1, root // 2), root, min(len(pool), 2 * root)}):
            options.append(candidates.sqrtn_sets(model, pool, count))
    options.append(lowest_peak_plan(model, [cut for cut, _ in cuts], cut_bytes=[b for _, b in cuts])[0])
    best, best_key = None, None
    for ops in options:
        sim = simulate(model, ops)
        key = (sim.peak_bytes, sim.recompute_cost)
        if best_key is None or key < best_key:
            best, best_key = ops, key
    return best
