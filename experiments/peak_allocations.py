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
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile
from dataclasses import dataclass
from typing import Callable, List, Tuple

import memsaving  # noqa: F401  (sets TF_CPU_ALLOCATOR_USE_BFC before TensorFlow starts)
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


def peak_allocations(step: Callable, *args) -> Tuple[int, List[Allocation]]:
    """Run ``step(*args)`` once to warm up, once under the profiler; return
    the allocator's peak bytes in use during the profiled run and the
    allocations alive at that peak, largest first."""
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin  # pylint: disable=import-outside-toplevel

    step(*args)
    logdir = tempfile.mkdtemp(prefix="memsaving_peak_")
    tf.profiler.experimental.start(logdir)
    try:
        step(*args)
    finally:
        tf.profiler.experimental.stop()
    paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
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


def main(argv=None) -> None:
    from experiments import bench_budget_promise as sweep  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp24", help=f"one of {list(sweep.MODELS)}")
    parser.add_argument("--mode", default="memory", choices=["plain", "memory"])
    parser.add_argument("--top", type=int, default=30, help="how many allocations to print (largest first)")
    args = parser.parse_args(argv)
    case = sweep.MODELS[args.model](False)
    step, captured = sweep.make_step(case.model, case.batch, args.mode)
    peak, allocations = peak_allocations(step, case.inputs)
    plan = captured["plan"]
    predicted = plan.plain_peak if args.mode == "plain" else plan.predicted_peak
    print(f"{args.model}, {args.mode}: measured peak {peak / MIB:.2f} MiB, predicted {predicted / MIB:.2f} MiB "
          f"(resident {plan.resident_bytes / MIB:.2f}); alive at the peak, made during the step: "
          f"{sum(a.chunk_bytes for a in allocations) / MIB:.2f} MiB in {len(allocations)} buffers")
    print(f"{'chunk MiB':>10} {'asked MiB':>10} {'kind':>6} {'shape':>18}  op")
    for a in allocations[:args.top]:
        print(f"{a.chunk_bytes / MIB:10.3f} {a.requested_bytes / MIB:10.3f} {a.region:>6} {a.shape:>18}  {a.op}")


if __name__ == "__main__":
    main()
