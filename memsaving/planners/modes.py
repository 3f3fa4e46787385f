"""The named checkpoint modes, on the neutral graph model (no TensorFlow):
``"speed"`` keeps the expensive ops' outputs, ``"memory"`` the cuts of the
plan the simulator predicts lowest.

:func:`memsaving.tf.checkpoints.resolve_checkpoints` turns the other forms of
the ``checkpoints`` argument (``"collection"``, a list of tensors) into ops;
those need the TensorFlow graph, these only the model.
"""

from __future__ import annotations

import logging
from typing import List

from memsaving.candidates import cuts as candidates
from memsaving.planners.budget import lowest_peak_plan
from memsaving.errors import CheckpointError
from memsaving.model.graph import GraphModel
from memsaving.model.proposal import Proposal
from memsaving.sim.allowance import used_up
from memsaving.sim.simulate import simulate

logger = logging.getLogger("memsaving")

LOOP_CHECKPOINT_MODES = frozenset({"memory", "budget"})
"""The plan modes whose gradients run loops checkpointed inside
(:mod:`memsaving.tf.loop_checkpoints`): every k-th iteration's state kept,
the iterations between run again in the backward pass, where the profiler
measured that this holds less (:func:`memsaving.model.loops.checkpointable_loops`).
``"speed"``, the user's own checkpoints and ``swap="auto"`` keep TensorFlow's
loop gradient (every iteration kept); a split plan plans the rest of the step
by the mode it was asked with."""


def checkpoints_loops(mode: str) -> bool:
    """Whether a plan of ``mode`` checkpoints the loops of the step inside.

    Examples
    --------
    >>> checkpoints_loops("memory"), checkpoints_loops("speed")
    (True, False)
    """
    return mode in LOOP_CHECKPOINT_MODES


def speed_proposal(model: GraphModel, keep_x_gradients: bool = False) -> Proposal:
    """Keep the copyable MatMul/Conv/Einsum forward ops' outputs
    (:func:`memsaving.candidates.cuts.speed`): the ``"speed"`` mode, named
    ``"speed"``."""
    found = candidates.speed(model)
    if not found:
        raise CheckpointError(
            "checkpoints='speed' found no MatMul/Conv/Einsum op between xs and ys; "
            "use checkpoints='memory' or pass a list of tensors."
        )
    return _scored(model, found, keep_x_gradients, "speed")


def memory_proposal(model: GraphModel, keep_x_gradients: bool = False) -> Proposal:
    """The lowest-peak plan among a few candidate plans (:func:`_lowest_peak`):
    the ``"memory"`` mode, named ``"memory"``; keeps nothing extra when the
    graph has no cut."""
    cuts = candidates.memory_candidates(model)
    if not cuts:
        # Only graphs with (almost) no ops between xs and ys have no cut at
        # all; there is nothing to recompute, so plain backprop is the plan.
        logger.info("checkpoints='memory': no cut between xs and ys; nothing to recompute")
        return _scored(model, [], keep_x_gradients, "memory")
    return _lowest_peak(model, cuts, keep_x_gradients).renamed("memory")


def _scored(model: GraphModel, ops: List[int], keep_x_gradients: bool, name: str) -> Proposal:
    sim = simulate(model, ops, keep_x_gradients=keep_x_gradients)
    return Proposal(ops, sim.peak_bytes, sim.recompute_cost, name=name)


def _lowest_peak(model: GraphModel, cuts, keep_x_gradients: bool) -> Proposal:
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
    scored: List[Proposal] = []
    for ops in options:
        if scored and used_up():
            break
        scored.append(_scored(model, ops, keep_x_gradients, ""))
    if not used_up():
        lowest = lowest_peak_plan(model, [cut for cut, _ in cuts], cut_bytes=[b for _, b in cuts])
        scored.append(_scored(model, lowest.checkpoint_ops, keep_x_gradients, ""))
    return min(scored, key=lambda proposal: (proposal.peak, proposal.recompute_cost))
