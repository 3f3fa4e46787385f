"""Milliseconds per simulator replay of one plan, without TensorFlow.

Planning scores every candidate plan by replaying it
(:func:`memsaving.sim.simulate.simulate`), so the time of one replay sets
the time of planning.  This builds graph models of the size of Keras
training steps (a ResNet50-like network of bottleneck blocks with unfused
batch norms, and a deep MLP), scores plans on each, and prints the best
time per replay over a few rounds (CPU time of this process):

* ``first``: plans replayed once each, as a search's first plans are
  (single-level plans from every k-th memory candidate cut, on a model
  that replayed only plain backprop before: its per-model tables are
  built, its memo of backward units is not);
* ``repeat``: the same plans and plain backprop replayed again, the
  remembered simulations forgotten between rounds (the per-model tables
  and the memo of units stay warm);
* ``neighbours`` (with ``--neighbours``): a sequence of neighbouring plans
  as the per-op refinement tries them (:func:`memsaving.planners.refine.keep_more`):
  a cut plan with one recomputed op more kept at a time, most forward
  cost per byte first, every third one accepted as the next plan; on a
  model that replayed plain backprop and the start plan before.

    python -m experiments.bench_replay [--rounds 5] [--pickles DIR] [--neighbours]

``--pickles DIR`` also times the pickled ``GraphModel`` objects in ``DIR``
(``*.pkl``, as :func:`memsaving.tf.extract.graph_model` built them, pickled
before anything was derived from them).
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import time
from dataclasses import replace
from typing import Dict, List, Tuple

from memsaving.candidates.cuts import memory_candidates
from memsaving.planners.refine import recomputed_ops
from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model
from memsaving.sim.simulate import simulate


class _Builder:
    """Appends ops and tensors to a graph model under construction."""

    def __init__(self):
        self.ops: List[OpInfo] = []
        self.tensors: Dict[int, TensorInfo] = {}
        self.xs: List[int] = []

    def tensor(self, name: str, nbytes: int, producer: int = -1, **kwargs) -> int:
        self.tensors[len(self.tensors)] = TensorInfo(name, nbytes, producer, **kwargs)
        return len(self.tensors) - 1

    def op(self, name: str, kind: str, inputs: Tuple[int, ...], nbytes: int, **kwargs) -> int:
        out = self.tensor(name, nbytes, len(self.ops), value_bytes=kwargs.pop("value_bytes", None))
        self.ops.append(OpInfo(name, kind, inputs, (out,), **kwargs))
        return out

    def weight(self, name: str, nbytes: int) -> int:
        """A variable handle (one of ``xs``) and its read (a view of it)."""
        handle = self.tensor(name, 0, constant=True, value_bytes=nbytes)
        self.xs.append(handle)
        return self.op(f"{name}/read", "ReadVariableOp", (handle,), 0, copyable=False, value_bytes=nbytes)

    def conv_bn_relu(self, name: str, x: int, nbytes: int, relu: bool = True) -> int:
        """Conv2D, then batch norm as Keras traces it unfused, then Relu."""
        w, gamma = self.weight(f"{name}/w", 4096), self.weight(f"{name}/gamma", 256)
        conv = self.op(f"{name}/conv", "Conv2D", (x, w), nbytes, grad_reads=(x, w),
                       input_grad_reads=((w,), (x,)), cost=50.0)
        mean = self.op(f"{name}/mean", "Mean", (conv,), 256, grad_reads=())
        view = self.op(f"{name}/reshape", "Reshape", (mean,), 0, value_bytes=256)
        centered = self.op(f"{name}/sub", "Sub", (conv, view), nbytes, forwards_input=True)
        scaled = self.op(f"{name}/mul", "Mul", (centered, gamma), nbytes, grad_reads=(centered, gamma),
                         input_grad_reads=((gamma,), (centered,)), forwards_input=True)
        if not relu:
            return scaled
        return self.op(f"{name}/relu", "Relu", (scaled,), nbytes, grad_reads=(), forwards_input=True)


def resnet_like(blocks: int = 56, nbytes: int = 1 << 16) -> GraphModel:
    """Bottleneck blocks (three conv-bn-relu, a residual add, a Relu) on
    one input, summed into a loss: about 1,400 ops with 56 blocks."""
    build = _Builder()
    h = build.tensor("input", nbytes)
    for b in range(blocks):
        x = h
        for k in range(3):
            h = build.conv_bn_relu(f"block{b}/{k}", h, nbytes, relu=k < 2)
        h = build.op(f"block{b}/add", "AddV2", (x, h), nbytes, forwards_input=True)
        h = build.op(f"block{b}/out", "Relu", (h,), nbytes, grad_reads=(), forwards_input=True)
    loss = build.op("loss", "Sum", (h,), 4, grad_reads=())
    return GraphModel(build.ops, build.tensors, build.xs, [loss], separate_result_kernels=True,
                      ready_gradients_early=True)


def plans(model: GraphModel, count: int = 12) -> List[List[int]]:
    """Plain backprop and single-level plans: every k-th memory candidate cut."""
    cuts = [cut for cut, _ in memory_candidates(model)]
    found = [[]]
    for k in range(1, count):
        found.append(sorted({i for cut in cuts[::k] for i in cut}))
    return found


def ms_per_replay(model: GraphModel, chosen: List[List[int]], rounds: int) -> float:
    """Best milliseconds per replay over ``rounds`` rounds of every plan
    of ``chosen`` (the ``repeat`` figure)."""
    best = float("inf")
    for _ in range(rounds + 1):  # the first round fills the per-model tables
        model.derived("simulations", dict).clear()
        start = time.process_time()
        for ops in chosen:
            simulate(model, ops)
        best = min(best, (time.process_time() - start) / len(chosen) * 1e3)
    return best


def ms_per_first_replay(model: GraphModel, chosen: List[List[int]], rounds: int) -> float:
    """Best milliseconds per replay of the plans ``chosen`` replayed once
    each (the ``first`` figure), each round on a new copy of ``model``."""
    best = float("inf")
    for _ in range(rounds):
        copy = replace(model)
        simulate(copy)  # builds the per-model tables
        start = time.process_time()
        for ops in chosen:
            simulate(copy, ops)
        best = min(best, (time.process_time() - start) / len(chosen) * 1e3)
    return best


def neighbours(model: GraphModel, start: List[int], count: int = 40, every: int = 3) -> List[List[int]]:
    """``count`` plans that each keep one more of the ops ``start``
    recomputes than the last accepted one (``start``, then every
    ``every``-th of them), in the order :func:`memsaving.planners.refine.keep_more`
    tries them."""
    order = sorted(recomputed_ops(model, start), key=lambda i: -model.ops[i].cost / max(
        sum(model.tensors[t].nbytes for t in model.ops[i].outputs), 1))
    current, trials = start, []
    for n, i in enumerate(order[:count]):
        trials.append(sorted(set(current) | {i}))
        if n % every == every - 1:
            current = trials[-1]
    return trials


def ms_per_neighbour(model: GraphModel, start: List[int], rounds: int) -> float:
    """Best milliseconds per replay of the :func:`neighbours` of ``start``
    (the ``neighbours`` figure), each round on a new copy of ``model``."""
    trials = neighbours(model, start)
    best = float("inf")
    for _ in range(rounds):
        copy = replace(model)
        simulate(copy)
        simulate(copy, start)
        begin = time.process_time()
        for ops in trials:
            simulate(copy, ops)
        best = min(best, (time.process_time() - begin) / len(trials) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pickles", type=pathlib.Path, help="folder of pickled GraphModel objects (*.pkl)")
    parser.add_argument("--neighbours", action="store_true", help="also time a sequence of neighbouring plans")
    args = parser.parse_args()
    models = {"resnet-like": resnet_like(), "mlp-like": chain_model([1 << 14] * 300, grad_reads="both")}
    for path in sorted(args.pickles.glob("*.pkl")) if args.pickles else []:
        with open(path, "rb") as f:
            models[path.stem] = replace(pickle.load(f))  # a copy: nothing derived yet
    print(f"{'':16s} {'':9s}  ms per replay:  first   repeat" + ("  neighbours" if args.neighbours else ""))
    for name, model in models.items():
        chosen = plans(model)
        line = f"{name:16s} {len(model.ops):5d} ops  {'':14s}{ms_per_first_replay(model, chosen[1:], args.rounds):7.2f}"
        line += f"  {ms_per_replay(model, chosen, args.rounds):7.2f}"
        if args.neighbours:
            line += f"  {ms_per_neighbour(model, chosen[4], args.rounds):10.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
