"""Which buffers are alive at a step's measured peak: a diagnostic.

When a measured peak is above the plan's prediction, the question is which
tensors the executor held that the simulator did not.  TensorFlow's
profiler records every allocation of the BFC allocator, with the op that
made it; its memory-profile tool lists the allocations alive at the peak.
This module runs one step under the profiler and prints that list.

It reads the profile with TensorFlow's own converter
(``_pywrap_profiler_plugin.xspace_to_tools_data``), a private binding: it is
a developer's tool, not part of memsaving.  Example, from the repository
root::

    python -m experiments.peak_allocations --model attention --mode memory

``--model`` is one of ``experiments.bench_budget_promise.MODELS``; the
step is that sweep's (loss, gradients reduced to a scalar), with default
TensorFlow settings.

Two more questions it answers, each from one traced step:

- ``--runs N``: how far the peak of that one trace moves from run to run
  (N measured runs after a warm-up, without the profiler).
- ``--order``: in which order the executor ran each Dense layer's two
  gradients (the data gradient, ``MatMul_grad/MatMul``, and the weight
  gradient, ``MatMul_grad/MatMul_1``), read from the profiler's trace of
  one step.  A thread that runs the data gradient first and goes on down
  the chain keeps the weight gradient's inputs alive until it comes back.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple

import memsaving  # sets TF_CPU_ALLOCATOR_USE_BFC before TensorFlow starts
import tensorflow as tf

MIB = 2 ** 20


@dataclass(frozen=True)
class Allocation:
    """One buffer alive at the peak: the allocator's chunk bytes, the bytes
    asked for, the op that made it, ``output`` or ``temp``, and its shape."""

    chunk_bytes: int
    requested_bytes: int
    op: str
    region: str
    shape: str


def profiled_run(step: Callable, *args) -> List[str]:
    """Run ``step(*args)`` once to warm up, once under TensorFlow's profiler;
    return the paths of the profile it wrote (``*.xplane.pb``)."""
    step(*args)
    logdir = tempfile.mkdtemp(prefix="memsaving_peak_")
    tf.profiler.experimental.start(logdir)
    try:
        step(*args)
    finally:
        tf.profiler.experimental.stop()
    return glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)


def peak_allocations(step: Callable, *args) -> Tuple[int, List[Allocation]]:
    """Run ``step(*args)`` once to warm up, once under the profiler; return
    the allocator's peak bytes in use during the profiled run and the
    allocations alive at that peak, largest first."""
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin  # pylint: disable=import-outside-toplevel

    paths = profiled_run(step, *args)
    logdir = os.path.dirname(paths[0]) if paths else "the profiler's folder"
    data, ok = _pywrap_profiler_plugin.xspace_to_tools_data(paths, "memory_profile", {})
    if not ok or not data:
        raise RuntimeError(f"TensorFlow's profiler gave no memory profile in {logdir}: is "
                           "TF_CPU_ALLOCATOR_USE_BFC=true set before TensorFlow starts (import memsaving first)?")
    profile = json.loads(data if isinstance(data, str) else data.decode())
    peak, found = 0, []
    for allocator in profile["memoryProfilePerAllocator"].values():
        snapshots = allocator["memoryProfileSnapshots"]
        peak = max(peak, int(allocator["profileSummary"]["peakStats"]["peakBytesInUse"]))
        for active in allocator["activeAllocations"]:
            index = int(active.get("snapshotIndex", -1))
            if index < 0:  # memory the allocator reserved, not a tensor
                continue
            meta = snapshots[index]["activityMetadata"]
            found.append(Allocation(int(meta["allocationBytes"]), int(meta["requestedBytes"]), meta["tfOpName"],
                                    meta["regionType"], meta["tensorShape"]))
    return peak, sorted(found, key=lambda a: (-a.chunk_bytes, a.op))


OP_EVENT = re.compile(r"^[^:\s]+:[A-Za-z_]\w*$")
"""How the profiler's trace names an op it ran: ``name:type``."""


@dataclass(frozen=True)
class OpRun:
    """One op the executor ran: its name, start and duration in microseconds, and the thread."""

    name: str
    start_us: float
    duration_us: float
    thread: str


def trace_events(paths: List[str]) -> Iterator[Tuple[str, int, Any, Dict[int, str], str]]:
    """Every event of a profile (``profiled_run``'s paths): its name, its
    start in picoseconds, the event itself, the names of its plane's
    statistics (by id) and the name of its line (thread)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel

    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as file:
            space.ParseFromString(file.read())
        for plane in space.planes:
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    start = line.timestamp_ns * 1000 + event.offset_ps
                    yield names.get(event.metadata_id, ""), start, event, stat_names, line.name


def executed_ops(paths: List[str]) -> List[OpRun]:
    """The ops of a profile's trace (``profiled_run``'s paths), by start time.

    The trace names an executed op ``name:type`` (:data:`OP_EVENT`); the
    host threads' other events (the executor's, the thread pool's) do not."""
    runs = [OpRun(name.split(":")[0], start / 1e6, event.duration_ps / 1e6, thread)
            for name, start, event, _, thread in trace_events(paths) if OP_EVENT.match(name)]
    return sorted(runs, key=lambda r: r.start_us)


@dataclass(frozen=True)
class GradientOrder:
    """For one Dense layer: whether its data gradient started before its
    weight gradient, and how many other layers' data gradients started in
    between (how far the chain ran ahead while the weight gradient waited)."""

    layer: str
    data_first: bool
    data_gradients_between: int


def dense_gradient_order(runs: List[OpRun]) -> List[GradientOrder]:
    """Each Dense layer's gradient pair in ``runs`` (``executed_ops``):
    ``<layer>/MatMul_grad/MatMul`` (data) and ``.../MatMul_1`` (weight)."""
    data, weight = {}, {}
    for run in runs:
        head, _, last = run.name.rpartition("/MatMul_grad/")
        if head and last == "MatMul":
            data.setdefault(head, run.start_us)
        elif head and last == "MatMul_1":
            weight.setdefault(head, run.start_us)
    starts = sorted(data.values())
    found = []
    for layer in sorted(set(data) & set(weight), key=lambda name: data[name]):
        low, high = sorted((data[layer], weight[layer]))
        between = sum(1 for t in starts if low < t < high)
        found.append(GradientOrder(layer, data[layer] < weight[layer], between))
    return found


def main(argv=None) -> None:
    from experiments import bench_budget_promise as sweep  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp24", help=f"one of {list(sweep.MODELS)}")
    parser.add_argument("--mode", default="memory", choices=["plain", "memory"])
    parser.add_argument("--top", type=int, default=30, help="how many allocations to print (largest first)")
    parser.add_argument("--runs", type=int, default=0,
                        help="also measure the step's peak this many times (one trace, no profiler) and print them")
    parser.add_argument("--order", action="store_true",
                        help="print the order each Dense layer's data and weight gradients ran in, instead of "
                             "the buffers alive at the peak")
    args = parser.parse_args(argv)
    if args.order and args.runs:
        parser.error("--runs goes with the buffer listing; --order prints the gradient order instead: give one")
    case = sweep.MODELS[args.model](False)
    step, captured = sweep.make_step(case.model, case.batch, args.mode)
    if args.order:
        print_gradient_order(args.model, args.mode, dense_gradient_order(executed_ops(profiled_run(step, case.inputs))))
        return
    peak, allocations = peak_allocations(step, case.inputs)
    plan = captured["plan"]
    predicted = plan.plain_peak if args.mode == "plain" else plan.predicted_peak
    if args.runs > 0:
        peaks = [memsaving.measure_peak(step, case.inputs) / MIB for _ in range(args.runs)]
        print(f"{args.model}, {args.mode}: {args.runs} runs of one trace measured {min(peaks):.2f} to "
              f"{max(peaks):.2f} MiB (median {statistics.median(peaks):.2f}), predicted {predicted / MIB:.2f}:")
        print("  " + " ".join(f"{p:.2f}" for p in peaks))
    print(f"{args.model}, {args.mode}: measured peak {peak / MIB:.2f} MiB, predicted {predicted / MIB:.2f} MiB "
          f"(resident {plan.resident_bytes / MIB:.2f}); alive at the peak, made during the step: "
          f"{sum(a.chunk_bytes for a in allocations) / MIB:.2f} MiB in {len(allocations)} buffers")
    print(f"{'chunk MiB':>10} {'asked MiB':>10} {'kind':>6} {'shape':>18}  op")
    for a in allocations[:args.top]:
        print(f"{a.chunk_bytes / MIB:10.3f} {a.requested_bytes / MIB:10.3f} {a.region:>6} {a.shape:>18}  {a.op}")


def print_gradient_order(model: str, mode: str, order: List[GradientOrder]) -> None:
    """The ``--order`` report: one line per Dense layer, and the count."""
    if not order:
        print(f"{model}, {mode}: no Dense gradient pairs (MatMul_grad/MatMul and MatMul_1) in the trace")
        return
    print(f"{model}, {mode}: data gradient first at {sum(o.data_first for o in order)} of {len(order)} Dense layers")
    print(f"{'first':>8} {'data grads between':>19}  layer")
    for o in order:
        print(f"{'data' if o.data_first else 'weight':>8} {o.data_gradients_between:19d}  {o.layer}")


if __name__ == "__main__":
    main()
