"""How much lower ``checkpoints="memory"`` measures than plain ``tf.gradients``
on a Keras Dense stack and on a 12-layer GPT2-style keras_hub backbone
(issue 15's targets: at least 2x and 3x).

Default TensorFlow settings (Grappler on, default thread pools).  Each model
is measured in a process of its own; every figure is the highest of
``--repeat`` measured runs after one warm-up, printed beside the plan's
prediction.  Two ratios are given: of the whole peak (weights and inputs
included) and of the activations (the peak less the memory in use before
the step).  The targets are judged on activations, as the issue's figures
for the Dense stack were measured.

Run: ``python -m experiments.bench_memory_ratio [--models mlp24,gpt2_12] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Dict

import memsaving  # noqa: F401  (sets the BFC allocator before TensorFlow starts)
import tensorflow as tf

from experiments.bench_budget_promise import MODELS as PROMISE_MODELS
from experiments.bench_budget_promise import Case, keras_hub_backbone, measure

MIB = 2 ** 20

TARGETS = {"mlp24": 2.0, "gpt2_12": 3.0}
"""The issue's minimum plain / memory ratio per model."""

BUILDERS: Dict[str, Callable[[bool], Case]] = {
    "mlp24": PROMISE_MODELS["mlp24"],
    "gpt2_12": keras_hub_backbone("gpt2", full=(12, 256, 4), quick=(4, 128, 2), max_sequence_length=None),
}


def figures(name: str, repeat: int, quick: bool) -> dict:
    """Plain and memory mode of one model, measured in this process."""
    case = BUILDERS[name](quick)
    result = {"model": name, "description": case.description}
    for mode in ("plain", "memory"):
        run = measure(case.model, case, mode, repeat)
        plan = run.plan
        predicted = plan.plain_peak if mode == "plain" else plan.predicted_peak
        result[mode] = {"measured": run.peak, "in_use_before": run.in_use_before, "predicted": predicted,
                        "resident": plan.resident_bytes}
    return result


def _in_a_process(name: str, repeat: int, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        command = [sys.executable, "-m", "experiments.bench_memory_ratio", "--worker", name, "--result", out,
                   "--repeat", str(repeat)] + (["--quick"] if quick else [])
        subprocess.run(command, check=True)
        with open(out) as handle:
            return json.load(handle)


def report(result: dict) -> str:
    plain, memory = result["plain"], result["memory"]
    whole = plain["measured"] / memory["measured"]
    activations = ((plain["measured"] - plain["in_use_before"]) / (memory["measured"] - memory["in_use_before"]))
    target = TARGETS[result["model"]]
    lines = [f"{result['model']}: {result['description']}"]
    for mode, fig in (("plain", plain), ("memory", memory)):
        error = (fig["predicted"] - fig["measured"]) / fig["measured"]
        lines.append(f"  {mode:6s} measured {fig['measured'] / MIB:8.2f} MiB, predicted {fig['predicted'] / MIB:8.2f} "
                     f"({error:+.1%}); in use before the step {fig['in_use_before'] / MIB:.2f} MiB")
    verdict = "meets" if activations >= target else "misses"
    lines.append(f"  plain / memory: {whole:.2f}x whole peak, {activations:.2f}x activations "
                 f"({verdict} the {target:.0f}x target on activations)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(BUILDERS), help=f"comma-separated subset of {list(BUILDERS)}")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per step after one warm-up")
    parser.add_argument("--quick", action="store_true", help="smaller models: a smoke run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with open(args.result, "w") as handle:
            json.dump(figures(args.worker, args.repeat, args.quick), handle)
        return
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(BUILDERS)}")
    print(f"Machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}; default TensorFlow settings")
    for name in names:
        print(report(_in_a_process(name, args.repeat, args.quick)), flush=True)


if __name__ == "__main__":
    main()
