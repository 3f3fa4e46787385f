"""Memory over the course of one gradient computation: predicted and measured.

The predicted timeline is the simulator's: bytes in use after every forward,
recompute and backward op of the plan.  The measured one comes from probe
ops that the rewrite places after each backward unit: each reads the
allocator's bytes in use and its peak since the previous probe, then resets
the peak, so the largest interval peak is the step's measured peak.  Nothing
waits on the probes, so they leave the schedule alone.  (TensorFlow's
executor orders ready ops partly by measured op costs, so the same plan can
peak a few percent differently from one process to the next; compare
figures from one process.)  Plain
backprop, sqrt(n) and budget plans drawn on one figure show the "zig-zag":
memory climbs through the forward pass, then rises and falls once per
recomputed segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from memsaving.api import gradients_and_plan
from memsaving.tf.measure import bytes_in_use, default_device, reset_peak
from memsaving.planners.planning import Plan


@dataclass
class Timeline:
    """Predicted and measured memory of one gradient computation.

    Attributes
    ----------
    plan : Plan
        the plan that ran.
    predicted : list of int
        bytes in use after each action (resident memory included).
    labels : list of str
        the actions, aligned with ``predicted``.
    unit_ends : list of int
        index in ``predicted`` where each measured interval ends.
    measured
        per interval (forward pass + output unit, then each backward
        unit): ``(label, bytes in use at its end, peak during it)``, all above
        the memory in use before the step.
    baseline : int
        bytes in use before the step (variables, inputs).
    """

    plan: Plan
    predicted: List[int]
    labels: List[str]
    unit_ends: List[int]
    measured: List[Tuple[str, int, int]] = field(default_factory=list)
    baseline: int = 0

    @property
    def measured_peak(self) -> int:
        """The largest interval peak: the step's peak above ``baseline``."""
        return max((peak for _, _, peak in self.measured), default=0)

    @property
    def predicted_peak(self) -> int:
        """The plan's predicted peak above resident memory."""
        return self.plan.predicted_peak - self.plan.resident_bytes


def _probe(records: list, device: str) -> Callable[[str, list], list]:
    """A probe for :func:`memsaving.gradients_and_plan`."""

    def read(label):
        info = tf.config.experimental.get_memory_info(device)
        tf.config.experimental.reset_memory_stats(device)
        records.append((label.numpy().decode(), int(info["current"]), int(info["peak"])))
        return np.int64(0)

    def probe(label: str, after: list) -> list:
        waits = [t for t in after if t is not None]
        waits = [t.values if isinstance(t, tf.IndexedSlices) else t for t in waits]
        with tf.control_dependencies(waits):
            return [tf.py_function(read, [tf.constant(label)], tf.int64, name="memsaving_probe")]

    return probe


def timeline(
    loss_fn: Callable[..., tf.Tensor],
    xs: Sequence[Union[tf.Variable, tf.Tensor]],
    inputs: Sequence = (),
    checkpoints="memory",
    budget=None,
    device: Optional[str] = None,
    **kwargs,
) -> Timeline:
    """Run one gradient computation of ``loss_fn(*inputs)`` with respect to
    ``xs`` and return its predicted and measured memory timelines.

    ``checkpoints`` and ``budget`` are those of :func:`memsaving.gradients`;
    ``checkpoints=[]`` gives plain backprop; other keywords (``swap`` and
    its options, ``batch_size``) are passed to it too.  The gradients are reduced to a
    scalar inside the step, so returned gradients do not hide activation
    memory.  The step runs twice (the first run builds and warms up).

    Measured figures need the allocator's statistics: on CPU,
    ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts (``import
    memsaving`` first sets it).
    """
    device = device or default_device()
    records: List[Tuple[str, int, int]] = []
    captured = {}
    batch = None
    first = next((x for x in inputs if hasattr(x, "shape")), None)
    if first is not None and len(first.shape) and first.shape[0] is not None:
        batch = int(first.shape[0])

    @tf.function
    def step(*args):
        loss = loss_fn(*args)
        options = {"batch_size": batch, **kwargs}
        grads, plan = gradients_and_plan(loss, list(xs), checkpoints=checkpoints, budget=budget,
                                         probe=_probe(records, device), **options)
        captured["plan"] = plan
        grads = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads])

    step(*inputs).numpy()
    records.clear()
    reset_peak(device)  # raises when the allocator keeps no statistics
    baseline = bytes_in_use(device)
    step(*inputs).numpy()
    plan = captured["plan"]
    sim = plan.simulation
    measured = [(label, current - baseline, peak - baseline) for label, current, peak in records]
    return Timeline(
        plan=plan,
        predicted=[plan.resident_bytes + b for b in sim.timeline],
        labels=list(sim.labels),
        unit_ends=list(sim.unit_ends),
        measured=measured,
        baseline=baseline,
    )


def plot_timeline(timelines: Dict[str, Timeline], path: Optional[str] = None, title: str = ""):
    """Draw predicted (lines) and measured (steps of interval peaks) memory
    of several plans on one figure; save it to ``path`` when given.

    The x axis is the step's progress (0 = start of the forward pass, 1 = last
    backward op) so plans of different lengths line up.  Memory is above
    resident memory (parameters, inputs), in MiB.  Returns the figure.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 4.8))
    mib = 2 ** 20
    for index, (name, line) in enumerate(timelines.items()):
        color = f"C{index}"
        resident = line.plan.resident_bytes
        count = max(len(line.predicted) - 1, 1)
        x = np.arange(len(line.predicted)) / count
        y = (np.array(line.predicted) - resident) / mib
        axes.plot(x, y, color=color, linewidth=1.2,
                  label=f"{name}: predicted (peak {line.predicted_peak / mib:.1f} MiB)")
        if line.measured:
            starts = [0] + [end + 1 for end in line.unit_ends[:-1]]
            for k, ((_, _, peak), start, end) in enumerate(zip(line.measured, starts, line.unit_ends)):
                axes.hlines(peak / mib, start / count, end / count, color=color, linewidth=3, alpha=0.5,
                            label=(f"{name}: measured interval peaks (peak {line.measured_peak / mib:.1f} MiB)"
                                   if k == 0 else None))
    axes.set_xlabel("progress through the step (forward, then backward)")
    axes.set_ylabel("memory above resident (MiB)")
    axes.set_title(title or "memory during one gradient computation")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure
