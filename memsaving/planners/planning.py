"""A checkpointing plan and its predicted cost (no TensorFlow).

A :class:`Plan` says which ops' outputs are kept, which ops each backward
segment recomputes, and what the simulator predicts: peak bytes and compute
relative to plain backprop.  ``memsaving.plan`` returns it and
``memsaving.gradients`` executes the same plan.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, TextIO, Tuple, cast

from memsaving.model.graph import GraphModel
from memsaving.planners.known_error import HEADROOM, needed_budget
from memsaving.model.splitting import SplitRegion
from memsaving.model.schedule import Inner, RECOMPUTING, UnitKind, backward_units, kept_set, validate_inner
from memsaving.sim.offload import OffloadPrediction
from memsaving.sim.simulate import Simulation, simulate
from memsaving.sim.swap import CostModel


@dataclass(frozen=True)
class Segment:
    """One backward unit of the plan."""

    kind: UnitKind
    anchor: str  # the kept op that starts it ("" for the output unit)
    ops: int  # ops differentiated (and recomputed, for "segment"; only recomputed, for "advance")
    kept_bytes: int  # bytes of the anchor's outputs kept from the forward pass
    recompute_cost: float  # FLOPs recomputed


ABOVE_PLAIN_TOLERANCE = 0.02
"""Fraction of plain backprop's step memory (its peak above the resident
bytes) a plan may be predicted above plain's peak before
:attr:`Plan.above_plain` says so: a segment's proxies and the order edges
move a prediction by a few small buffers."""

ABOVE_PLAIN_MIN_BYTES = 64 * 1024
"""...and at least this many bytes, so tiny graphs do not warn about noise."""


@dataclass(frozen=True)
class Plan:
    """What memsaving will do for one gradient computation.

    A plan is immutable: what is known when planning ends is set when it is
    made (``dataclasses.replace`` makes a changed copy), and what is learned
    later, when its step runs, lives in a record of its own: the peaks a
    calibration measured are in its :class:`memsaving.fit_budget.Calibration`
    (``step.calibration``, ``memsaving.keras.calibration_of(model)``).

    Plans are made by :func:`memsaving.plan` (while the step is traced),
    :func:`memsaving.gradients_and_plan` and ``memsaving.keras.plan_of``;
    each parameter is kept as the attribute of the same name (the
    attributes' own descriptions below say more of the later ones).

    Parameters
    ----------
    mode
        how checkpoints were chosen ("speed", "memory", "budget", a list...).
    checkpoints
        names of the checkpoint tensors.
    kept_ops
        names of every op whose outputs are kept (checkpoints plus ops
        that are never recomputed).
    segments
        the backward units, from the output back to the inputs.
    predicted_peak
        simulated peak bytes, including resident memory.
    plain_peak
        simulated peak bytes of plain tf.gradients.
    predicted_compute
        forward + recompute + backward relative to plain.
    budget
        the memory budget in bytes, when one was given.
    resident_bytes
        memory counted as in use before the step (parameters,
        inputs, or what the device held while planning when that is more);
        part of ``predicted_peak``.
    inner_checkpoints
        for multi-level plans, kept op name -> the names of
        the inner checkpoints its segment recomputes first (empty otherwise).
    swapped
        names of the tensors copied to host memory after the forward
        pass and back before the backward pass reads them.
    swapped_bytes
        the bytes of each tensor of ``swapped``, in the same order.
    transfer_seconds
        the predicted time of one copy of each tensor of ``swapped`` (its
        bytes over the cost model's bandwidth), in the same order.
    predicted_seconds, plain_seconds
        step time of this plan and of plain
        backprop under the cost model, when swapping was planned.
    steps
        the backward units in execution order as ``(kind, anchor op
        name, op names in topological order)``: exactly what
        ``memsaving.gradients`` copies and differentiates.
    simulation
        the simulator's full result for this plan
        (:class:`memsaving.sim.simulate.Simulation`), None when not kept.
    batch_size
        the size given to unknown dimensions when sizing tensors.
    batch_source
        where ``batch_size`` came from; empty for the default of 1.
    never_recomputed
        forward ops that cannot be copied safely, kept from the forward pass.
    profile_mode
        how kernel temporaries entered the predictions: ``"measure"``,
        ``"cached"`` or ``"off"``.
    profiled_signatures
        op signatures measured for this plan.
    cached_signatures
        op signatures whose profiles came from the cache.
    profile_seconds
        time spent profiling.
    planning_seconds
        simulation the planner spent on this plan, in seconds of the
        ``planning_time`` allowance.
    planning_stopped
        the ``planning_time`` at which the planner stopped searching (None:
        it finished its search).
    reused
        whether the plan was remembered from an earlier, identical call
        instead of planned again.
    splits
        the regions computed in pieces of rows.
    largest_work_buffer
        bytes of the largest kernel temporary of any op of the step (0 when
        not profiled).
    chunk_peak
        ``predicted_peak`` in the allocator's whole chunks (None when not
        replayed).
    planned_for
        the target the budget planner finally planned for (None outside
        budget planning).
    checkpointed_loops
        names of the loops whose gradient keeps sqrt(T) states instead of
        every iteration's (empty when none is).
    offload
        the device's predicted peak and step time with parameters offloaded
        to the host (None without ``offload_params``).

    Examples
    --------
    A plan for a graph model (:mod:`memsaving.model`) made without
    TensorFlow: a chain of eight ops with 4 KiB outputs, keeping the fourth
    op's output:

    >>> from memsaving.model.graph import chain_model
    >>> from memsaving.planners.planning import make_plan
    >>> plan = make_plan(chain_model([4096] * 8), [3], "list")
    >>> plan.checkpoints, plan.kept_ops
    (['t4'], ['op4'])
    >>> plan.predicted_peak, plan.plain_peak, plan.predicted_compute
    (24576, 36864, 1.125)
    >>> plan.above_plain
    False

    ``plan.explain()`` prints the backward units and the predictions.
    """

    mode: str
    checkpoints: List[str]
    kept_ops: List[str]
    segments: List[Segment]
    predicted_peak: int
    plain_peak: int
    predicted_compute: float
    budget: Optional[int] = None
    resident_bytes: int = 0
    inner_checkpoints: Dict[str, List[str]] = field(default_factory=dict)
    swapped: List[str] = field(default_factory=list)
    swapped_bytes: List[int] = field(default_factory=list)
    transfer_seconds: List[float] = field(default_factory=list)
    predicted_seconds: Optional[float] = None
    plain_seconds: Optional[float] = None
    steps: List[Tuple[str, str, Tuple[str, ...]]] = field(default_factory=list, repr=False)
    simulation: Optional[Simulation] = field(default=None, repr=False)
    batch_size: Optional[int] = None
    """The size given to unknown dimensions (usually the batch) when sizing
    tensors: the plan's figures hold for this batch."""
    batch_source: str = ""
    """Where ``batch_size`` came from (``"batch_size="``, ``"fit(batch_size=8)"``...);
    empty for the default of 1."""
    never_recomputed: List[str] = field(default_factory=list)
    """Forward ops that cannot be copied safely (stateful, random; variable
    reads are left out): kept from the forward pass and differentiated
    where they are."""
    profile_mode: str = "off"
    """How kernel temporaries entered the predictions (:mod:`memsaving.tf.profiles`):
    ``"measure"``, ``"cached"`` (only profiles already cached) or ``"off"``."""
    profiled_signatures: int = 0
    """Op signatures measured for this plan (run alone on the device)."""
    cached_signatures: int = 0
    """Op signatures whose profiles came from the cache."""
    profile_seconds: float = 0.0
    """Time spent profiling, measuring and cache look-ups included."""
    planning_seconds: float = 0.0
    """Simulation the planner spent on this plan, in seconds of the
    ``planning_time`` allowance (:mod:`memsaving.sim.allowance`)."""
    planning_stopped: Optional[float] = None
    """The ``planning_time`` at which the planner stopped searching and
    returned the best plan found so far (None: it finished its search)."""
    reused: bool = False
    """The plan was made earlier in this process for the same graph model
    and arguments, and handed back without planning again
    (:mod:`memsaving.planners.cache`)."""
    splits: List[SplitRegion] = field(default_factory=list)
    """The regions computed in pieces of rows (:mod:`memsaving.model.splitting`),
    each one op of the plan (named ``split/...``)."""
    largest_work_buffer: int = 0
    """Bytes of the largest kernel temporary (work buffer) of any op of the
    step, forward or gradient, as profiled (0 when not profiled).  Every
    op runs in every plan, so no plan's peak goes below it: on a device
    whose convolution kernels take a large work buffer, it is the floor
    that recomputation cannot lower."""
    chunk_peak: Optional[int] = None
    """For a plan without swaps: ``predicted_peak`` as TensorFlow's BFC
    allocator would hold it, in whole chunks (the same replay through
    :mod:`memsaving.sim.allocator`, from a fresh allocator).  The allocator
    hands a request a free chunk of up to twice its size whole, so on nets
    whose tensors come in many sizes (concatenations, attention) the device
    holds 10-25% more than the bytes its tensors ask for.  None when not
    replayed."""
    planned_for: Optional[int] = None
    """The target the budget planner finally planned for: the one asked
    for, or lower where the plan for it held more than it in the allocator
    model's chunks (:mod:`memsaving.planners.chunk_fit`).  None outside
    budget planning."""
    checkpointed_loops: List[str] = field(default_factory=list)
    """The loops whose gradient keeps one state every ceil(sqrt(T))
    iterations and runs the iterations between again, instead of saving
    every iteration (:mod:`memsaving.tf.loop_checkpoints`); empty in the
    modes that keep TensorFlow's loop gradient
    (:func:`memsaving.planners.modes.checkpoints_loops`)."""
    offload: Optional[OffloadPrediction] = field(default=None, repr=False)
    """With parameters offloaded to the host (``offload_params``): the
    device's predicted peak and step time (:mod:`memsaving.sim.offload`).
    ``predicted_peak`` stays the plan's peak with the variables on the
    device."""

    @property
    def device_peak(self) -> int:
        """The figure a budget is checked against: the predicted peak, or the
        allocator's chunks when they hold more (:attr:`chunk_peak`)."""
        return max(self.predicted_peak, self.chunk_peak or 0)

    @property
    def needed_budget(self) -> int:
        """The smallest ``budget=`` under which this plan may run: its
        predicted peak on the device (:attr:`device_peak`) with room for the
        model's known error and the allocator's headroom
        (:mod:`memsaving.planners.known_error`).  A budget below it gets a
        ``BudgetError`` before anything runs, though the plan is predicted
        under it: a device's memory is a hard limit, and predictions err."""
        return needed_budget(self.device_peak, self.resident_bytes, headroom=HEADROOM)

    @property
    def above_plain(self) -> bool:
        """Whether the plan is predicted to peak above plain ``tf.gradients``
        by more than :data:`ABOVE_PLAIN_TOLERANCE` of plain's step memory.

        Keeping a tensor that plain backprop frees early raises the peak:
        ``checkpoints="speed"`` keeps convolution outputs, which plain
        backprop frees after the activation reads them (the convolution's
        gradient reads its input); a user's list can do the same.  Such a
        plan costs memory *and* recomputation."""
        step = max(self.plain_peak - self.resident_bytes, 0)
        return self.predicted_peak > self.plain_peak + max(ABOVE_PLAIN_TOLERANCE * step, ABOVE_PLAIN_MIN_BYTES)

    def above_plain_advice(self) -> str:
        """The warning for a plan :attr:`above_plain`: the figures and what to do."""
        mib = 2 ** 20
        return (f"memsaving: this plan (mode {self.mode!r}) is predicted to peak at "
                f"{self.predicted_peak / mib:.1f} MiB, above plain tf.gradients' {self.plain_peak / mib:.1f} MiB "
                f"({self.predicted_peak / max(self.plain_peak, 1):.2f}x): it keeps tensors plain backprop frees "
                "early. Use checkpoints='memory' or budget= instead, or print the plan (memsaving.plan(...)"
                ".explain()) to see what it keeps.")

    def explain(self, file: Optional[TextIO] = None, measured_peak: Optional[int] = None) -> str:
        """Print a readable table of the plan (to ``file``, default stdout) and return it;
        ``measured_peak``: the peak its step measured, when one was (:meth:`table`)."""
        text = self.table(measured_peak)
        (file if file is not None else sys.stdout).write(text)
        return text

    def table(self, measured_peak: Optional[int] = None) -> str:
        """The table ``explain`` prints: one row per backward unit; with
        ``measured_peak`` (bytes the allocator measured for the plan's step,
        from a calibration's record), that figure against the budget too."""
        out = io.StringIO()
        mib = 2 ** 20
        out.write(f"memsaving plan ({self.mode}): {len(self.checkpoints)} checkpoints, "
                  f"{sum(s.kind == UnitKind.SEGMENT for s in self.segments)} recomputed segments")
        inner = sum(len(v) for v in self.inner_checkpoints.values())
        if inner:
            out.write(f", {inner} inner checkpoints (multi-level)")
        if self.swapped:
            out.write(f", {len(self.swapped)} tensors swapped to host")
        if self.splits:
            out.write(f", {len(self.splits)} regions split into pieces")
        if self.checkpointed_loops:
            out.write(f", {len(self.checkpointed_loops)} loops checkpointed inside (sqrt(T) states kept)")
        out.write("\n")
        out.write(f"predicted peak {self.predicted_peak / mib:.1f} MiB "
                  f"(plain tf.gradients {self.plain_peak / mib:.1f} MiB, "
                  f"{self.plain_peak / max(self.predicted_peak, 1):.2f}x lower)")
        if self.budget is not None:
            out.write(f", budget {self.budget / mib:.1f} MiB")
        if measured_peak is not None:
            out.write(f"\nmeasured peak {measured_peak / mib:.1f} MiB")
            if self.budget is not None:
                out.write(f" (budget {self.budget / mib:.1f} MiB)")
        if self.batch_source:  # unset when no batch size was given or found
            out.write(f"\nsized for batch {self.batch_size} ({self.batch_source})")
        if self.profile_mode == "measure" or self.cached_signatures:
            out.write(f"\nkernel temporaries: {self.profiled_signatures} op signatures profiled, "
                      f"{self.cached_signatures} from cache, {self.profile_seconds:.1f} s; "
                      f"the largest work buffer {self.largest_work_buffer / mib:.1f} MiB (no plan goes below it)")
        if self.reused:
            out.write("\nreused: planned earlier in this process for the same graph and arguments "
                      "(memsaving.clear_plan_cache() plans again)")
        if self.planning_stopped is not None:
            out.write(f"\nplanning stopped at planning_time={self.planning_stopped:g} s of simulation: the best "
                      "plan found by then (a larger planning_time, or None, searches further)")
        if self.offload is not None:
            offload = self.offload
            out.write(f"\nparameters offloaded to the host: {offload.offloaded_bytes / mib:.1f} MiB of variables"
                      + (f" and {offload.slot_bytes / mib:.1f} MiB of optimizer state" if offload.slot_bytes else "")
                      + f"; predicted device peak {offload.peak_bytes / mib:.1f} MiB "
                      f"({offload.resident_bytes / mib:.1f} MiB resident), {offload.copied_bytes / mib:.1f} MiB "
                      f"copied to the device per step, step {offload.step_seconds * 1e3:.3f} ms under the cost model")
        out.write(f"\npredicted compute {self.predicted_compute:.2f}x a plain step")
        if self.predicted_seconds is not None and self.plain_seconds:
            out.write(f"; predicted step time {self.predicted_seconds / self.plain_seconds:.2f}x plain "
                      "(transfers overlapping compute)")
        out.write("\n\n")
        out.write(f"{'#':>3}  {'unit':8} {'starts at (kept op)':40} {'ops':>5} {'kept MiB':>9} {'recompute MFLOP':>16}\n")
        for n, s in enumerate(self.segments):
            anchor = s.anchor if len(s.anchor) <= 40 else "..." + s.anchor[-37:]
            out.write(f"{n:>3}  {s.kind:8} {anchor:40} {s.ops:>5} {s.kept_bytes / mib:>9.2f} "
                      f"{s.recompute_cost / 1e6:>16.2f}\n")
        if self.never_recomputed:
            shown = ", ".join(self.never_recomputed[:8])
            more = f" and {len(self.never_recomputed) - 8} more" if len(self.never_recomputed) > 8 else ""
            out.write(f"\nkept, never recomputed (stateful or random ops): {shown}{more}\n")
        if self.splits:
            out.write("\nsplit into pieces of rows, one piece alive at a time (forward and backward):\n")
            out.write(f"{'region':40} {'ops':>4} {'rows':>7} {'pieces':>6} {'fwd MiB':>8} {'bwd MiB':>8}\n")
            for region in self.splits:
                name = region.name if len(region.name) <= 40 else "..." + region.name[-37:]
                out.write(f"{name:40} {len(region.ops):>4} {region.rows:>7} {region.chunks:>6} "
                          f"{region.forward_bytes / mib:>8.2f} {region.backward_bytes / mib:>8.2f}\n")
        if self.swapped:
            out.write("\nswapped to host (kept off the device between the passes):\n")
            out.write(f"{'tensor':50} {'MiB':>8} {'transfer ms':>12}\n")
            for name, size, seconds in zip(self.swapped, self.swapped_bytes, self.transfer_seconds):
                name = name if len(name) <= 50 else "..." + name[-47:]
                out.write(f"{name:50} {size / mib:>8.2f} {seconds * 1e3:>12.3f}\n")
        return out.getvalue()

    def __str__(self) -> str:
        return self.table()


def make_plan(
    model: GraphModel,
    checkpoint_ops: Sequence[int],
    mode: str,
    *,
    budget: Optional[int] = None,
    keep_x_gradients: bool = False,
    inner: Optional[Inner] = None,
    swapped: Sequence[int] = (),
    cost: Optional[CostModel] = None,
    inplace: Optional[bool] = None,
) -> Plan:
    """Score the plan that keeps ``checkpoint_ops`` (and, for multi-level
    plans, recomputes ``inner`` checkpoints, and swaps the ``swapped``
    tensors) and describe it."""
    inner = {a: tuple(v) for a, v in (inner or {}).items() if v}
    kept = kept_set(model, checkpoint_ops)
    validate_inner(model, kept, inner)
    swapped = sorted(set(swapped))
    if swapped:
        cost = cost or CostModel()
    inplace = bool(swapped) if inplace is None else inplace
    sim = simulate(model, kept=kept, keep_x_gradients=keep_x_gradients, inner=inner, swapped=swapped, cost=cost,
                   inplace=inplace)
    chunk_peak = None
    if not swapped and cost is None:
        # what the device holds decides whether a budget holds: replay the plan through the allocator model
        chunk_peak = simulate(model, kept=kept, keep_x_gradients=keep_x_gradients, inner=inner, inplace=inplace,
                              allocator=True).chunk_peak_bytes
    # plain tf.gradients runs the regions whole: its figures come from the model before folding
    unsplit = model.unfolded or model
    plain = simulate(unsplit, keep_x_gradients=keep_x_gradients, cost=cost, unpinned=True, plain=True)
    compute = sim.compute_ratio
    if unsplit is not model:
        compute = (sim.forward_cost + sim.backward_cost + sim.recompute_cost) / (
            unsplit.forward_cost() + unsplit.backward_cost())
    segments = []
    steps: List[Tuple[str, str, Tuple[str, ...]]] = []
    for unit in backward_units(model, kept, inner, inplace=inplace):
        anchor = model.ops[unit.anchor] if unit.anchor >= 0 else None
        steps.append((unit.kind, anchor.name if anchor else "", tuple(model.ops[i].name for i in unit.ops)))
        kept_bytes = sum(model.tensors[t].nbytes for t in anchor.outputs) if anchor else 0
        recomputed = unit.kind in RECOMPUTING
        recompute = sum(model.ops[i].cost for i in unit.ops) if recomputed else 0.0
        if unit.kind == UnitKind.PASS and model.ops[unit.anchor].type == "ReadVariableOp":
            continue
        segments.append(Segment(unit.kind, anchor.name if anchor else "", len(unit.ops), kept_bytes, recompute))
    checkpoints = [
        model.tensors[t].name for i in sorted(set(checkpoint_ops)) for t in model.ops[i].outputs
        if model.tensors[t].trainable
    ]
    return Plan(
        mode=mode,
        checkpoints=checkpoints,
        kept_ops=[model.ops[i].name for i in sorted(kept)],
        segments=segments,
        predicted_peak=sim.peak_bytes,
        plain_peak=plain.peak_bytes,
        predicted_compute=compute,
        budget=budget,
        resident_bytes=model.resident_bytes,
        inner_checkpoints={model.ops[a].name: [model.ops[i].name for i in v] for a, v in sorted(inner.items())},
        never_recomputed=[op.name for op in model.ops
                          if op.forward and not op.copyable and op.type != "ReadVariableOp"],
        swapped=[model.tensors[t].name for t in swapped],
        swapped_bytes=[model.tensors[t].nbytes for t in swapped],
        transfer_seconds=([model.tensors[t].nbytes / cast(CostModel, cost).bandwidth for t in swapped]
                          if swapped else []),  # swapped: cost was set above
        predicted_seconds=sim.step_seconds,
        plain_seconds=plain.step_seconds,
        steps=steps,
        simulation=sim,
        largest_work_buffer=max((op.work_buffer_bytes for op in model.ops), default=0),
        splits=list(model.splits),
        chunk_peak=chunk_peak,
        **profile_fields(model),
    )


def profile_fields(model: GraphModel) -> dict:
    """The Plan fields saying how the model's kernel temporaries were profiled."""
    summary = model.profile
    if summary is None:
        return {}
    return {"profile_mode": summary.mode, "profiled_signatures": summary.measured,
            "cached_signatures": summary.cached, "profile_seconds": summary.seconds}
