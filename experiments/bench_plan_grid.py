"""Budget plans on saved graph models: what the budget planner chooses and
how long it takes, at six budgets per model, and how both changed against
an earlier run.

A change to the planner changes two things a user sees: the time planning
adds to a trace, and the recomputation of the plan chosen (the budget is
a promise, so every plan must also fit).  Both are measured here on graph
models pickled once (``dump``, with TensorFlow), so that two versions of
the code plan exactly the same graphs, without TensorFlow (``run``):

* budgets lie 0.1, 0.25, 0.5, 0.75, 0.9 and 0.97 of the way from the
  ``"memory"`` plan's simulated peak to plain backprop's;
* per model and budget: CPU seconds of :func:`memsaving.planners.budget.plan_for_budget`
  (this process), the recomputed FLOPs of its plan, and whether it fits
  (a plan above its budget is an error, not a figure);
* ``--save FILE`` keeps the figures (JSON); ``--compare FILE`` prints, per
  model and budget, the saved run's time and recomputation next to this
  run's, the ratios, the total planning time of each and the geometric mean
  of the recompute ratios, and marks budgets that fitted in one run only.
  Times compared this way come from two processes (run both on an idle
  machine); the recomputation is exact.

    python -m experiments.bench_plan_grid dump DIR [--models resnet50 mlp64 ...] [--batch 2] [--size 64]
    python -m experiments.bench_plan_grid run DIR [--save FILE] [--compare FILE]

``dump`` traces each model's training step (keras.applications with
weights=None and memsaving's built-in models) and pickles its graph
model, kernel profiles measured, as ``memsaving.plan`` would plan it.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import pickle
import sys
import time
from typing import Dict, List, Optional

FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.97)
"""Where each budget lies between the memory plan's peak (0) and plain backprop's (1)."""

MODELS = ("resnet50", "resnet152", "densenet201", "transformer48", "mlp1600",
          "transformer4", "residual", "twotower", "mlp64")
"""The models ``dump`` saves by default: the five of ``bench_scale`` and four small ones."""


def _builders(size: int) -> dict:
    import keras  # pylint: disable=import-outside-toplevel

    from memsaving.tools import models  # pylint: disable=import-outside-toplevel

    return {
        "resnet50": lambda: keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10),
        "resnet152": lambda: keras.applications.ResNet152(weights=None, input_shape=(size, size, 3), classes=10),
        "densenet201": lambda: keras.applications.DenseNet201(weights=None, input_shape=(size, size, 3),
                                                              classes=10),
        "transformer48": lambda: models.transformer(size=size, layers=48),
        "mlp1600": lambda: models.mlp(size=size, depth=1600),
        "transformer4": lambda: models.transformer(size=size, layers=4),
        "residual": lambda: models.residual_convnet(size=size),
        "twotower": lambda: models.two_tower(),
        "mlp64": lambda: models.mlp(size=size, depth=64),
    }


def dump(folder: pathlib.Path, names: List[str], batch: int, size: int) -> None:
    """Pickle the graph model of each named model's training step into ``folder``."""
    import memsaving  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (allocator first)
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from memsaving.tf.extract import graph_model  # pylint: disable=import-outside-toplevel
    from memsaving.tf.forward import forward_graph  # pylint: disable=import-outside-toplevel
    from memsaving.tf.measure import bytes_in_use  # pylint: disable=import-outside-toplevel

    builders = _builders(size)
    unknown = sorted(set(names) - set(builders))
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: choose from {sorted(builders)}")
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        model = builders[name]()
        spec = tf.TensorSpec([batch] + list(model.inputs[0].shape[1:]), model.inputs[0].dtype)
        found = {}

        @tf.autograph.experimental.do_not_convert
        def forward(x):
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
            xs = [tf.convert_to_tensor(v.handle) for v in model.trainable_variables]  # captured in this graph
            found["model"] = graph_model(forward_graph(xs, [loss]), batch_size=batch, profile="measure",
                                         in_use_bytes=bytes_in_use())
            return loss

        tf.function(forward).get_concrete_function(spec)
        with open(folder / f"{name}.pkl", "wb") as f:
            pickle.dump(found["model"], f)
        print(f"saved {name}: {len(found['model'].ops)} ops", flush=True)
        keras.backend.clear_session()


def plan_grid(folder: pathlib.Path) -> Dict[str, list]:
    """``{"model fraction": [cpu_seconds, recompute_flops or None]}`` for every pickled model in ``folder``."""
    from memsaving.candidates.cuts import memory_candidates  # pylint: disable=import-outside-toplevel
    from memsaving.errors import BudgetError  # pylint: disable=import-outside-toplevel
    from memsaving.planners.budget import plan_for_budget  # pylint: disable=import-outside-toplevel
    from memsaving.planners.modes import memory_proposal  # pylint: disable=import-outside-toplevel
    from memsaving.sim.simulate import simulate  # pylint: disable=import-outside-toplevel

    paths = sorted(folder.glob("*.pkl"))
    if not paths:
        raise SystemExit(f"no pickled graph models (*.pkl) in {folder}: run `dump {folder}` first")
    figures = {}
    for path in paths:
        with open(path, "rb") as f:
            model = pickle.load(f)
        ranked = memory_candidates(model)
        pool, cut_bytes = [cut for cut, _ in ranked], [b for _, b in ranked]
        lowest, plain = memory_proposal(model).peak, simulate(model).peak_bytes
        for fraction in FRACTIONS:
            budget = int(lowest + fraction * (plain - lowest))
            start = time.process_time()
            try:
                chosen = plan_for_budget(model, pool, budget, cut_bytes=cut_bytes)
            except BudgetError:
                chosen = None
            seconds = time.process_time() - start
            if chosen is not None and chosen.peak > budget:
                raise AssertionError(f"{path.stem} at {fraction}: a plan of {chosen.peak} bytes for a budget of "
                                     f"{budget}")
            figures[f"{path.stem} {fraction}"] = [seconds, None if chosen is None else chosen.recompute_cost]
        print(f"planned {path.stem} ({len(model.ops)} ops)", file=sys.stderr, flush=True)
    return figures


def report(figures: Dict[str, list], saved: Optional[Dict[str, list]]) -> None:
    """Print this run's figures, next to a saved run's when given."""
    if saved is None:
        print(f"{'model budget':<22} {'plan s':>7} {'recompute MFLOP':>16}")
        for key, (seconds, cost) in figures.items():
            print(f"{key:<22} {seconds:7.2f} {'no fit' if cost is None else f'{cost / 1e6:.1f}':>16}")
        print(f"total planning {sum(s for s, _ in figures.values()):.1f} s")
        return
    print(f"{'model budget':<22} {'saved s':>8} {'this s':>7} {'saved MFLOP':>12} {'this MFLOP':>11} {'ratio':>6}")
    logs = []
    for key, (seconds, cost) in figures.items():
        if key not in saved:
            continue
        old_seconds, old_cost = saved[key]
        ratio = ""
        if (old_cost is None) != (cost is None):
            ratio = "fits now" if old_cost is None else "FIT LOST"
        elif cost is not None and old_cost > 0 and cost > 0:
            logs.append(math.log(cost / old_cost))
            ratio = f"{cost / old_cost:.2f}"
        show = [("no fit" if c is None else f"{c / 1e6:.1f}") for c in (old_cost, cost)]
        print(f"{key:<22} {old_seconds:8.2f} {seconds:7.2f} {show[0]:>12} {show[1]:>11} {ratio:>6}")
    shared = [key for key in figures if key in saved]
    print(f"total planning: saved {sum(saved[k][0] for k in shared):.1f} s, this run "
          f"{sum(figures[k][0] for k in shared):.1f} s")
    if logs:
        print(f"recompute, this run / saved: geometric mean {math.exp(sum(logs) / len(logs)):.3f} "
              f"over {len(logs)} budgets both runs fit")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump", help="trace models and pickle their graph models (TensorFlow)")
    dumping.add_argument("folder", type=pathlib.Path)
    dumping.add_argument("--models", nargs="+", default=list(MODELS))
    dumping.add_argument("--batch", type=int, default=2)
    dumping.add_argument("--size", type=int, default=64)
    running = commands.add_parser("run", help="plan every pickled model at six budgets (no TensorFlow)")
    running.add_argument("folder", type=pathlib.Path)
    running.add_argument("--save", type=pathlib.Path, help="write this run's figures (JSON)")
    running.add_argument("--compare", type=pathlib.Path, help="a saved run to compare with")
    args = parser.parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))  # pickles of graphs of thousands of ops
    if args.command == "dump":
        dump(args.folder, args.models, args.batch, args.size)
        return
    saved = json.loads(args.compare.read_text()) if args.compare else None
    figures = plan_grid(args.folder)
    if args.save:
        args.save.write_text(json.dumps(figures, indent=1))
    report(figures, saved)


if __name__ == "__main__":
    main()
