"""The BFC allocator model (``memsaving.sim.allocator``) against TensorFlow's
allocator, on the allocations of real training steps.

TensorFlow's BFC allocator reports every allocation and free to its
profiler: the bytes asked for, the chunk given, its address, and the bytes
in use after it.  (``RunMetadata``'s ``allocation_records``, the older
route, stays empty for ``tf.function`` calls since TensorFlow 2.1, and gave
chunk sizes only.)  This module records those events from the moment
TensorFlow starts, through building the model, tracing and planning the
step, two warm-up runs and one measured run, and replays them through the
model:

* **whole history**: every event since TensorFlow started, in order, so the
  model's state before the measured run is the allocator's own.  Every
  allocation's chunk must come out the size TensorFlow gave, and the
  model's peak during the measured run must equal the measured one.
* **the step alone**, from what a planner could know before the step:
  a fresh allocator given the measured run's requests (``fresh``); the
  same after the warm-up run's requests (``warm``); the chunks in use
  before the step allocated first, in address order, then the warm-up and
  measured runs (``resident``); a fresh allocator whose first region is
  the whole memory limit, so that no region's end splits the step's memory
  (``one region``).  Their errors show what the state before the step is
  worth.

Besides these, ``requested`` is the peak of the bytes asked for (what the
simulator sums, in the real order), and ``predicted`` and ``chunks`` the
simulator's peak without and with the allocator model
(``simulate(..., allocator=True)``)::

    python -m experiments.allocator_trace --repeats 2 --out experiments/results/allocator_model.md   # about 20 minutes
    python -m experiments.allocator_trace --models mlp --modes memory --threads 1

Each model, mode and thread setting runs in a process of its own (``--repeats``
processes each): the chunks depend on everything the process did before.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from experiments.peak_allocations import trace_events
from memsaving.sim.allocator import DEFAULT_LIMIT, Allocator

MIB = 2 ** 20
ALLOCATOR = "bfc_cpu_allocator_for_gpu"
"""The name TensorFlow gives its CPU BFC allocator."""
DEFAULT_MODELS = ("mlp", "resconv", "densenet", "attention", "depthwise", "lstm")
MARK = "allocator_trace:"
"""Prefix of the profiler marks around the warm-up and measured runs."""


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation or free the allocator reported: when (picoseconds),
    whether it allocates, the bytes asked for, the chunk's bytes and
    address, the bytes in use after it, and the op and kind of buffer
    (``output``, ``temp``...) it was made for."""

    time_ps: int
    allocates: bool
    requested: int
    chunk: int
    address: int
    in_use: int
    op: str
    kind: str


def read_profile(paths: Sequence[str]) -> Tuple[List[MemoryEvent], Dict[str, Tuple[int, int]]]:
    """The CPU allocator's events in a profile (``*.xplane.pb`` files), in
    order, and the spans (start, end in picoseconds) of the marks named
    ``allocator_trace:...``, by name without the prefix."""
    events, marks = [], {}
    for name, start, event, stat_names, _ in trace_events(paths):
        if name.startswith(MARK):
            marks[name[len(MARK):]] = (start, start + event.duration_ps)
        elif name in ("MemoryAllocation", "MemoryDeallocation"):
            stats = _stats(event, stat_names)
            if stats.get("allocator_name") == ALLOCATOR:
                events.append(MemoryEvent(start, name == "MemoryAllocation", int(stats["requested_bytes"]),
                                          int(stats["allocation_bytes"]), int(stats["addr"]),
                                          int(stats["bytes_allocated"]), str(stats.get("tf_op", "")),
                                          str(stats.get("region_type", ""))))
    return _in_allocator_order(events), marks


def _stats(event, stat_names: Dict[int, str]) -> dict:
    found = {}
    for stat in event.stats:
        kind = stat.WhichOneof("value")
        value = getattr(stat, kind)
        found[stat_names.get(stat.metadata_id)] = stat_names.get(value) if kind == "ref_value" else value
    return found


def _in_allocator_order(events: List[MemoryEvent]) -> List[MemoryEvent]:
    """``events`` by time.  The allocator stamps each one under its lock, so
    time order is its order; two events stamped alike are put in the order
    whose bytes in use follow one from the other."""
    events = sorted(events, key=lambda e: e.time_ps)
    for i in range(1, len(events)):
        previous, event = events[i - 1], events[i]
        if previous.time_ps == event.time_ps and i >= 2:
            before = events[i - 2].in_use
            if before + _change(event) == event.in_use and event.in_use + _change(previous) == previous.in_use:
                events[i - 1], events[i] = event, previous
    return events


def _change(event: MemoryEvent) -> int:
    return event.chunk if event.allocates else -event.chunk


@dataclass
class HistoryReplay:
    """The whole history replayed: events, allocations whose chunk differs
    from TensorFlow's, events after which the bytes in use differ, and the
    model's peak during the measured run."""

    events: int
    allocations: int
    chunk_mismatches: int
    in_use_mismatches: int
    first_mismatch: str
    peak: int
    in_use_before: int
    regions: int
    pool_bytes: int


def replay_history(events: Sequence[MemoryEvent], window: Tuple[int, int]) -> HistoryReplay:
    """Every event up to the end of the measured run (``window``) through a
    fresh model (keys: addresses), checked event by event; the model's
    peak during the measured run."""
    offset = events[0].in_use - _change(events[0]) if events else 0  # held before the profiler started
    replayed = [e for e in events if e.time_ps <= window[1]]
    bfc = Allocator()
    chunk_mismatches, in_use_mismatches, first = _checked(bfc, [e for e in replayed if e.time_ps < window[0]], offset)
    bfc.reset_peak()
    in_use_before = bfc.in_use
    during = _checked(bfc, in_window(replayed, window), offset)
    return HistoryReplay(len(replayed), sum(e.allocates for e in replayed), chunk_mismatches + during[0],
                         in_use_mismatches + during[1], first or during[2], bfc.peak + offset,
                         in_use_before + offset, len(bfc.regions), bfc.pool_bytes)


def _checked(bfc: Allocator, events: Sequence[MemoryEvent], offset: int) -> Tuple[int, int, str]:
    """``events`` through ``bfc``: the allocations whose chunk differs from
    TensorFlow's, the events after which the bytes in use (plus
    ``offset``) differ, and the first difference in words."""
    chunk_mismatches = in_use_mismatches = 0
    first = ""
    for event in events:
        if event.allocates:
            chunk = bfc.allocate(event.address, event.requested)
            if chunk != event.chunk:
                chunk_mismatches += 1
                first = first or f"{event.op} asked {event.requested}: model {chunk}, TensorFlow {event.chunk}"
        else:
            bfc.free(event.address)
        in_use_mismatches += bfc.in_use + offset != event.in_use
    return chunk_mismatches, in_use_mismatches, first


def in_window(events: Iterable[MemoryEvent], window: Tuple[int, int]) -> List[MemoryEvent]:
    """The events stamped within ``window`` (start, end in picoseconds)."""
    return [e for e in events if window[0] <= e.time_ps <= window[1]]


def step_alone_peaks(events: Sequence[MemoryEvent], marks: Dict[str, Tuple[int, int]]) -> dict:
    """The measured run's peak predicted from the step's own requests, from
    four states before it (see the module's docstring), and the peak of
    the bytes asked for; each adds the bytes in use when the run starts."""
    measured = in_window(events, marks["measured"])
    in_use_before = next((e.in_use for e in reversed(events) if e.time_ps < marks["measured"][0]), 0)
    warmup = in_window(events, marks["warmup"])
    held = _held_before(events, marks["measured"][0])
    found = {"fresh": in_use_before + _run(Allocator(), measured),
             "one region": in_use_before + _run(Allocator(first_region=DEFAULT_LIMIT), measured)}
    warm = Allocator()
    _run(warm, warmup)
    found["warm"] = in_use_before + _run(warm, measured)
    resident = Allocator()
    for address, requested in sorted(held.items()):
        resident.allocate(address, requested)
    _run(resident, warmup)
    found["resident"] = in_use_before + _run(resident, measured)
    asked = peak_asked = 0
    for event in measured:
        asked += event.requested if event.allocates else -event.requested
        peak_asked = max(peak_asked, asked)
    found["requested"] = in_use_before + peak_asked
    return found


def _run(bfc: Allocator, events: Sequence[MemoryEvent]) -> int:
    """``events`` through ``bfc`` (keys: addresses; frees of chunks the
    model does not hold are skipped); the model's peak during them less
    what it held before."""
    before = bfc.in_use
    bfc.reset_peak()
    for event in events:
        if event.allocates:
            if bfc.holds(event.address):
                bfc.free(event.address)
            bfc.allocate(event.address, event.requested)
        else:
            bfc.free(event.address)
    return bfc.peak - before


def _held_before(events: Sequence[MemoryEvent], start: int) -> Dict[int, int]:
    """The chunks in use when ``start`` comes: address -> bytes requested."""
    held: Dict[int, int] = {}
    for event in events:
        if event.time_ps >= start:
            break
        if event.allocates:
            held[event.address] = event.requested
        else:
            held.pop(event.address, None)
    return held


# ------------------------------------------------------------------------------------- in the worker


def worker(name: str, mode: str, threads: int, quick: bool, keep: Optional[str] = None) -> dict:
    """One model, mode and thread setting in this process: the measured
    run's peak, the replays' and the simulator's predictions; ``keep``: a
    file to write the events and marks to (JSON)."""
    import memsaving  # (before TensorFlow: the allocator's statistics)
    import tensorflow as tf

    if threads:
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    logdir = tempfile.mkdtemp(prefix="memsaving_allocator_trace_")
    tf.profiler.experimental.start(logdir)
    try:
        result = _traced_steps(name, mode, quick, keep)
    finally:
        tf.profiler.experimental.stop()
    events, marks = read_profile(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    if keep:
        with open(keep, "w") as file:
            json.dump({"events": [asdict(e) for e in events], "marks": marks}, file)
    history = replay_history(events, marks["measured"])
    result["history"] = asdict(history)
    result["step_alone"] = step_alone_peaks(events, marks)
    result["events"] = len(events)
    return result


def _traced_steps(name: str, mode: str, quick: bool, keep: Optional[str] = None) -> dict:
    """Build the model, trace and plan its step, run it twice, then once
    measured; the figures and the simulator's predictions (``keep``: also
    pickle the graph model and the plan's kept ops to ``keep + ".model"``)."""
    import memsaving
    import memsaving.api
    import tensorflow as tf

    from experiments.bench_budget_promise import reduce_gradients
    from experiments.hard_limit_models import build

    case = build(name, quick)
    model, variables = case.model, case.model.trainable_variables
    captured: dict = {}
    extract = memsaving.api.graph_model

    def capturing(*args, **kwargs):
        captured["model"] = extract(*args, **kwargs)
        return captured["model"]

    memsaving.api.graph_model = capturing

    @tf.function
    def step(inputs, targets):
        predictions = model(inputs, training=True)
        loss = tf.reduce_mean(tf.square(tf.cast(predictions, tf.float32) - tf.cast(targets, tf.float32)))
        if mode == "plain":
            captured["plan"] = memsaving.plan(loss, variables, checkpoints=[], batch_size=case.batch)
            grads = tf.gradients(loss, variables)
        else:
            grads, captured["plan"] = memsaving.gradients_and_plan(loss, variables, checkpoints="memory",
                                                                   batch_size=case.batch)
        return reduce_gradients(grads)

    with tf.profiler.experimental.Trace(MARK + "first"):
        step(case.inputs, case.targets).numpy()
    memsaving.api.graph_model = extract
    with tf.profiler.experimental.Trace(MARK + "warmup"):
        step(case.inputs, case.targets).numpy()
    in_use_before = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
    tf.config.experimental.reset_memory_stats("CPU:0")
    with tf.profiler.experimental.Trace(MARK + "measured"):
        step(case.inputs, case.targets).numpy()
    peak = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    plan, graph = captured["plan"], captured["model"]
    predicted = plan.plain_peak if mode == "plain" else plan.predicted_peak
    if keep:
        import pickle

        with open(keep + ".model", "wb") as file:
            pickle.dump({"model": graph, "kept_ops": plan.kept_ops, "inner": plan.inner_checkpoints, "mode": mode,
                         "resident": plan.resident_bytes}, file)
    start = time.perf_counter()
    chunks = chunk_prediction(graph, plan, mode)
    return {"measured": peak, "in_use_before": in_use_before, "predicted": predicted,
            "resident": plan.resident_bytes, "chunks": chunks, "chunk_seconds": time.perf_counter() - start}


def chunk_prediction(graph, plan, mode: str) -> Optional[int]:
    """The simulator's peak of ``plan`` on ``graph`` with the allocator model:
    the plan's kept ops and inner checkpoints (the same replay as
    ``Plan.predicted_peak``), or plain ``tf.gradients`` scored as
    ``Plan.plain_peak`` is."""
    from memsaving.sim.simulate import simulate

    if mode == "plain":
        unsplit = graph.unfolded or graph
        return simulate(unsplit, unpinned=True, plain=True, allocator=True).chunk_peak_bytes
    kept = {i for i, op in enumerate(graph.ops) if op.name in set(plan.kept_ops)}
    index = {op.name: i for i, op in enumerate(graph.ops)}
    inner = {index[a]: tuple(index[n] for n in names) for a, names in plan.inner_checkpoints.items()}
    return simulate(graph, kept=kept, inner=inner, allocator=True).chunk_peak_bytes


# ------------------------------------------------------------------------------------- in the parent


def run_worker(name: str, mode: str, threads: int, quick: bool, timeout: int = 1800) -> dict:
    """:func:`worker` in a process of its own (threads are set before TensorFlow starts)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
    env.setdefault("MEMSAVING_CACHE_DIR", tempfile.mkdtemp(prefix="memsaving_allocator_trace_cache_"))
    command = [sys.executable, "-m", "experiments.allocator_trace", "--worker", "--models", name, "--modes", mode,
               "--threads", str(threads)] + (["--quick"] if quick else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"crashed": " | ".join((done.stderr or "").strip().splitlines()[-3:])[:400]}
    return json.loads(lines[-1][len("RESULT "):])


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _error(value: Optional[int], measured: int) -> str:
    return "-" if value is None else f"{(value - measured) / measured * 100:+.1f}%"


COLUMNS = ["model", "mode", "threads", "measured", "predicted", "chunks", "history", "resident", "warm", "fresh",
           "one region", "requested", "chunk mismatches"]


def table_row(name: str, mode: str, threads: int, r: dict) -> List[str]:
    if "crashed" in r:
        return [name, mode, str(threads), "crashed: " + r["crashed"]] + [""] * (len(COLUMNS) - 4)
    m = r["measured"]
    history, alone = r["history"], r["step_alone"]
    cells = [name, mode, str(threads or "default"), _mib(m)]
    for value in (r["predicted"], r["chunks"], history["peak"], alone["resident"], alone["warm"], alone["fresh"],
                  alone["one region"], alone["requested"]):
        cells.append(f"{_mib(value)} ({_error(value, m)})")
    cells.append(f"{history['chunk_mismatches']}/{history['allocations']}")
    return cells


SUMMARIZED = {"predicted": lambda r: r["predicted"], "chunks": lambda r: r["chunks"],
              "history": lambda r: r["history"]["peak"], "fresh": lambda r: r["step_alone"]["fresh"],
              "one region": lambda r: r["step_alone"]["one region"], "requested": lambda r: r["step_alone"]["requested"]}
"""The columns :func:`summary` sums up, and how to read each from a result."""


def summary(results: List[dict]) -> List[str]:
    """Per column, the mean and largest error against the measured peak
    over the runs, and in how many runs the allocator model's prediction
    is nearer the measured peak than the simulator's."""
    done = [r for r in results if "crashed" not in r and r.get("chunks") is not None]
    if not done:
        return ["no run finished with a prediction"]
    lines = []
    for column, read in SUMMARIZED.items():
        errors = [abs(read(r) - r["measured"]) / r["measured"] * 100 for r in done]
        lines.append(f"{column}: mean |error| {sum(errors) / len(errors):.1f}%, largest {max(errors):.1f}%")
    nearer = sum(abs(r["chunks"] - r["measured"]) < abs(r["predicted"] - r["measured"]) for r in done)
    lines.append(f"chunks nearer the measured peak than predicted in {nearer} of {len(done)} runs")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--modes", default="memory,plain")
    parser.add_argument("--threads", default="1,0", help="inter-op threads, comma-separated (0: TensorFlow's default)")
    parser.add_argument("--quick", action="store_true", help="the models' smaller sizes")
    parser.add_argument("--repeats", type=int, default=1, help="processes per model, mode and thread setting")
    parser.add_argument("--out", default=None, help="also write the table and its summary to this file (markdown)")
    parser.add_argument("--keep", default=None, help="with --worker: a file to write the run's events to (JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.models, args.modes, int(args.threads), args.quick, args.keep)), flush=True)
        return
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print("\n".join(lines), flush=True)
    results = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                for _ in range(args.repeats):
                    results.append(run_worker(name, mode, threads, args.quick))
                    lines.append("| " + " | ".join(table_row(name, mode, threads, results[-1])) + " |")
                    print(lines[-1], flush=True)
                    print(json.dumps({"model": name, "mode": mode, "threads": threads, **results[-1]}), file=sys.stderr)
    lines += [""] + summary(results)
    print("\n".join(lines[-len(SUMMARIZED) - 1:]))
    if args.out:
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
