"""What the first call costs a TF1 script under ``memsaving.patch()``.

A ``tf.compat.v1`` script that trains a 24-layer MLP (width 512, batch 512,
Adam) calls ``optimizer.minimize``; under :func:`memsaving.patch` that call
plans the gradients and, on a machine that has never seen the model's
kernels, profiles them first.  Before this was fixed it took 7.7 s on an
idle machine and printed 60-odd "profiled 1 kernel signatures" lines,
because each profiled op's gradient was planned (and profiled) again
through the patched ``tf.gradients``.

Each run is a fresh Python process with an empty profile cache
(``MEMSAVING_CACHE_DIR`` in a new temporary folder), so every kernel
signature is profiled; the worker times ``minimize`` and the parent counts
the ``memsaving:`` lines the process wrote to stderr::

    python -m experiments.bench_first_call            # 3 fresh processes
    python -m experiments.bench_first_call --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import List

LAYERS = 24
WIDTH = 512
BATCH = 512
GOAL_SECONDS = 2.0


def _worker() -> dict:
    import time

    import memsaving
    import tensorflow as tf
    from memsaving import api

    plans: List = []
    original = api.gradients_and_plan

    def recorded(*args, **kwargs):
        grads, plan = original(*args, **kwargs)
        plans.append(plan)
        return grads, plan

    api.gradients_and_plan = recorded
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, WIDTH])
        h = x
        for i in range(LAYERS):
            w = tf.compat.v1.get_variable(f"w{i}", [WIDTH, WIDTH])
            h = tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(h * h)
        with memsaving.patched("memory", profile=True):
            start = time.perf_counter()
            tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
            seconds = time.perf_counter() - start
    return {"seconds": seconds, "plans": len(plans),
            "profiled": sum(p.profiled_signatures for p in plans),
            "cached": sum(p.cached_signatures for p in plans),
            "profile_seconds": sum(p.profile_seconds for p in plans)}


def run_once() -> dict:
    """One fresh process with an empty profile cache."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="memsaving_first_call_") as cache:
        env = dict(os.environ, MEMSAVING_CACHE_DIR=cache, TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run([sys.executable, "-m", "experiments.bench_first_call", "--worker"], env=env, cwd=root,
                              capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("the worker failed: " + " | ".join(done.stderr.strip().splitlines()[-3:]))
    result = json.loads(lines[-1][len("RESULT "):])
    result["progress_lines"] = sum(1 for line in done.stderr.splitlines() if line.startswith("memsaving:"))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker()), flush=True)
        return
    results = [run_once() for _ in range(args.runs)]
    for i, r in enumerate(results, 1):
        print(f"run {i}: minimize {r['seconds']:.2f} s ({r['profile_seconds']:.2f} s profiling {r['profiled']} "
              f"kernel signatures, {r['cached']} from the cache), {r['plans']} plan(s), "
              f"{r['progress_lines']} memsaving line(s) on stderr")
    median = statistics.median(r["seconds"] for r in results)
    lines = max(r["progress_lines"] for r in results)
    print(f"median {median:.2f} s (goal under {GOAL_SECONDS:.0f} s), at most {lines} progress line(s) "
          f"(goal: at most one)")


if __name__ == "__main__":
    main()
