"""Run every experiment and write its tables (markdown + CSV) and plots (PNG).

    python -m experiments.run [--quick | --tiny] [--only depth,batch,quality,treedecomp] [--out DIR]

* ``depth``: peak memory and step time against depth, CIFAR ResNets
  (:mod:`experiments.exp_depth`: plain, tf.recompute_grad, memsaving
  "memory" / "speed" / budget);
* ``batch``: the largest batch under a fixed memory budget
  (:mod:`experiments.exp_batch`);
* ``quality``: budget plans against the Checkmate MILP and Chen's heuristics
  (:mod:`experiments.exp_quality`);
* ``treedecomp``: tree decompositions against networkx
  (:mod:`experiments.exp_treedecomp`).

``--quick`` takes about 3 minutes on 2 cores, ``--tiny`` (the test's
configuration) under a minute; the full run about 45 minutes.  Results go
to ``experiments/results/`` (``--out``); ``experiments/RESULTS.md`` shows the
full run's.

TensorFlow runs with its default thread pools, as users run it.  With one
inter-op thread, peaks repeat to the byte, but the executor then runs the
consumers of returned weight gradients (the step's reduction, an optimizer's
update) only after the gradient ops it is following, so they pile up and
the peak is not the one users get (README, "Measuring peak memory").
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import List, Optional

import memsaving  # noqa: F401  (sets up the CPU allocator before TensorFlow starts)

EXPERIMENTS = ("depth", "batch", "quality", "treedecomp")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class Config:
    """Sizes of every experiment for one kind of run."""

    depth_blocks: tuple
    depth_batch: int
    repeats: int
    batch_models: tuple
    batch_size: int
    base_batch: int
    batch_cap: int
    bisect_steps: int
    quality_models: tuple
    quality_time_limit: float
    quality_truncate: Optional[int]
    treedecomp_scale: str
    nx_cap: float


CONFIGS = {
    "tiny": Config((1, 2), 4, 2, ("unet",), 32, 2, 4, 0, ("unet",), 5.0, 8, "tiny", 2.0),
    "quick": Config((1, 2, 3, 5, 8), 16, 5, ("unet", "transformer"), 64, 4, 64, 1, ("vgg16", "unet"), 20.0,
                    None, "quick", 4.0),
    "full": Config((1, 3, 5, 9, 18, 34), 32, 9, ("resnet50", "vgg16", "unet", "transformer"), 64, 4, 64, 2,
                   ("vgg16", "unet", "resnet50", "mobilenet"), 90.0, None, "full", 120.0),
}


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sweeps: about 3 minutes on 2 cores")
    size.add_argument("--tiny", action="store_true", help="the smallest sweeps (tests): under a minute")
    parser.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory for tables and plots")
    args = parser.parse_args(argv)
    kind = "tiny" if args.tiny else "quick" if args.quick else "full"
    config = CONFIGS[kind]
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiments {unknown}; choose from {list(EXPERIMENTS)}")
    os.makedirs(args.out, exist_ok=True)
    print(f"experiments.run ({kind}): {', '.join(chosen)} -> {args.out}", flush=True)
    results = {}
    for name in chosen:
        start = time.perf_counter()
        if name == "depth":
            from experiments import exp_depth  # pylint: disable=import-outside-toplevel
            results[name] = exp_depth.run(args.out, list(config.depth_blocks), config.depth_batch, config.repeats)
        elif name == "batch":
            from experiments import exp_batch  # pylint: disable=import-outside-toplevel
            results[name] = exp_batch.run(args.out, list(config.batch_models), config.batch_size, config.base_batch,
                                          config.batch_cap, config.bisect_steps)
        elif name == "quality":
            from experiments import exp_quality  # pylint: disable=import-outside-toplevel
            results[name] = exp_quality.run(args.out, list(config.quality_models), 8, 64, config.quality_time_limit,
                                            config.quality_truncate)
        else:
            from experiments import exp_treedecomp  # pylint: disable=import-outside-toplevel
            results[name] = exp_treedecomp.run(args.out, config.treedecomp_scale, config.nx_cap)
        print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
