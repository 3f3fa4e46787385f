"""Parameter and optimizer-state offloading, end to end (after TensorFlowMem, Wei et al.).

A model's variables and its optimizer's slots live on a *host* device; each
weight is copied to the accelerator right before its forward use and
again right before its backward use, each copy freed after its readers;
gradients made on the accelerator go back to the host, where the
optimizer's update runs.  Three pieces do it:

* :mod:`memsaving.tf.placement` moves Keras variables and an optimizer's
  state to the host (plain ``tf.Variable`` objects are created there by
  their owner);
* :mod:`memsaving.tf.offload` rewrites a traced step once its backward pass
  is built: a copy per phase for every accelerator reader of a variable on
  the host, each waiting for a trigger as swap-ins do;
* :mod:`memsaving.sim.offload` predicts the device's peak and the step
  time with the copies on the host-to-device stream.

:func:`offload_step` joins the last two for one traced step; it is what
``memsaving.keras.enable(model, offload_params=True)`` runs after
``memsaving.gradients`` built the backward pass, and what
``memsaving.gradients(..., offload_params=True)`` runs for custom training
loops.  The optimizer's update must run on the host too
(``with tf.device(host): optimizer.apply_gradients(...)``), or its ops are
placed on the accelerator and read the variables from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Sequence, Tuple

import tensorflow as tf

from memsaving.model.graph import GraphModel
from memsaving.model.schedule import Unit, UnitKind
from memsaving.planners.planning import Plan
from memsaving.sim.offload import OffloadPrediction, simulate_offload, simulate_resident
from memsaving.sim.swap import CostModel
from memsaving.tf.extract import graph_model
from memsaving.tf.forward import forward_graph
from memsaving.tf.measure import bytes_in_use
from memsaving.tf.offload import OffloadOptions, OffloadedRead, host_reads, insert_offload
from memsaving.tf.placement import backing_variable


@dataclass
class OffloadedStep:
    """What :func:`offload_step` did to one traced step and what it predicts.

    Attributes
    ----------
    reads
        per variable read on the host, its copies (:class:`memsaving.tf.offload.OffloadedRead`).
    prediction
        the device's peak and the step time with offloading
        (None when the step's graph model was not given).
    resident_peak
        the same plan's predicted peak with everything on the device
        (the model's resident bytes and the optimizer state), for comparison.
    """

    reads: List[OffloadedRead]
    prediction: Optional[OffloadPrediction] = None
    resident_peak: Optional[int] = None


def offload_step(backward: Iterable[tf.Operation], roots: Sequence, options: OffloadOptions,
                 model: Optional[GraphModel] = None, plan: Optional[Plan] = None,
                 cost: Optional[CostModel] = None, slot_bytes: int = 0,
                 graph: Optional[tf.Graph] = None) -> OffloadedStep:
    """Offload the parameters of the step being traced in ``graph`` (default:
    the current graph), once its backward pass is built.

    Parameters
    ----------
    backward
        the ops the backward pass made (``memsaving.gradients``' ops).
    roots
        tensors the step runs: the gradients and the loss.
    options
        where the variables live and how copies are timed.
    model, plan
        the graph model the plan was made on and the plan; when given,
        the prediction is made (``.prediction`` of the result: the caller
        hands it on as the plan's ``offload``, ``replace(plan, offload=...)``).
    cost
        the speeds timing the copies (default :class:`CostModel`); the
        copies' lead and fusing are ``options``'.
    slot_bytes
        the optimizer state's bytes, on the host with offloading.
    """
    graph = graph or tf.compat.v1.get_default_graph()
    backward = list(backward)
    made = set(backward)
    reads = host_reads([op for op in graph.get_operations() if op not in made], options.device)
    handle_names = {read.inputs[0].name for read in reads}
    report = insert_offload(reads, backward, roots, options)
    step = OffloadedStep(report)
    if model is not None and plan is not None:
        handles = [t for t, info in model.tensors.items() if info.producer < 0 and info.name in handle_names]
        kept, units, swapped = plan_replay(model, plan)
        # the copies start as the emitter starts them
        cost = replace(cost or CostModel(), lb=options.lb, fuse_levels=options.fuse_levels if options.fuse else None)
        step.prediction = simulate_offload(model, kept=kept, units=units, swapped=swapped, handles=handles,
                                           slot_bytes=slot_bytes, cost=cost)
        step.resident_peak = simulate_resident(model, kept=kept, units=units, swapped=swapped,
                                               slot_bytes=slot_bytes, cost=cost).peak_bytes
    return step


def plan_replay(model: GraphModel, plan: Plan) -> Tuple[set, List[Unit], List[int]]:
    """``(kept ops, backward units, swapped tensors)`` of ``plan`` on ``model``
    (the model it was made on, or one extracted again from the same graph),
    as the rewrite runs them: the plan's own units, by name."""
    index = model.op_index()
    kept = {index[name] for name in plan.kept_ops if name in index}
    units = [Unit(UnitKind(kind), index[anchor] if anchor else -1, tuple(index[n] for n in names if n in index))
             for kind, anchor, names in plan.steps]
    ids = {info.name: t for t, info in model.tensors.items()}
    swapped = [ids[name] for name in plan.swapped if name in ids]
    return kept, units, swapped


def step_model(ys: Sequence[tf.Tensor], variables: Sequence, batch_size: int = 1) -> GraphModel:
    """The graph model of the step from ``variables`` to ``ys`` in the
    current graph, extracted again as ``memsaving.gradients`` extracts it
    (kernel profiles from the cache): for a caller that has the plan but not
    the model it was made on."""
    xs = [_handle_in_graph(v) for v in variables]
    fwd = forward_graph(xs, list(ys))
    # the optimizer's update runs on the host with the parameters: none of its temporaries are the device's
    return graph_model(fwd, batch_size=batch_size, profile="cached", in_use_bytes=bytes_in_use(), update_factor=0.0)


def _handle_in_graph(variable) -> tf.Tensor:
    """A variable's handle as the current graph reads it (captured into a ``tf.function``)."""
    inner = backing_variable(variable)
    handle = inner.handle if hasattr(inner, "handle") else inner
    return tf.convert_to_tensor(handle)
