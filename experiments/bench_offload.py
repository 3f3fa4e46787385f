"""Parameter offloading: predicted device peak and step time, without and with.

A wide MLP whose parameters dominate (by default 8 x Dense(4096, relu) and
a Dense(10) head, batch 64, Adam: 0.5 GiB of weights and 1 GiB of Adam
state against 1 MiB activations) is traced once, without running it, and
its plain-backprop step is replayed by the simulator twice:

* without offload: the variables and the optimizer's state are resident on
  the device for the whole step (:func:`memsaving.sim.offload.simulate_resident`);
* with offload: they live on the host, each weight is copied to the device
  before its forward use and again before its backward use, and each weight
  gradient goes back to the host for the update
  (:func:`memsaving.sim.offload.simulate_offload`, the copies timed on the
  host-to-device stream).

Step times come from the cost model (FLOP estimates at ``--flops`` per
second, transfers at ``--bandwidth`` bytes per second); the host's own
work (the gate copies in host memory, Adam's update on the CPU) is not
timed.  Everything printed is a prediction: on this machine the
"accelerator" and the "host" are two logical CPUs sharing one allocator,
so the device's peak cannot be measured apart from the host's.

    python -m experiments.bench_offload [--width 4096] [--depth 8] [--batch 64]
                                        [--flops 10e12] [--bandwidth 16e9] [--checkpoints none|memory]
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import memsaving  # noqa: F401  (allocator setup before TensorFlow)
import keras
import tensorflow as tf

from memsaving.planners.modes import memory_proposal
from memsaving.sim.offload import simulate_offload, simulate_resident, variable_handles
from memsaving.sim.swap import CostModel
from memsaving.tf.extract import graph_model
from memsaving.tf.forward import forward_graph

MIB = 2 ** 20
ADAM_SLOTS = 2
"""Adam keeps two slots (first and second moments) the size of each weight."""


def traced_model(width: int, depth: int, batch: int, classes: int = 10):
    """The graph model of the MLP's loss (weights zero-initialised: only shapes matter) and its trainable bytes."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="relu", kernel_initializer="zeros")
                                for _ in range(depth)]
                             + [keras.layers.Dense(classes, kernel_initializer="zeros")])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    found = {}

    @tf.function(autograph=False)
    def step(x, y):
        loss = loss_fn(y, model(x, training=True))
        weights = [tf.convert_to_tensor(w.value.handle) for w in model.trainable_weights]
        found["model"] = graph_model(forward_graph(weights, [loss]), batch_size=batch, profile="off")
        return loss

    step.get_concrete_function(tf.TensorSpec([batch, width]), tf.TensorSpec([batch], tf.int32))
    trainable = sum(int(w.shape.num_elements()) * w.dtype.size for w in (v.value for v in model.trainable_weights))
    return found["model"], trainable


def figures(width: int = 4096, depth: int = 8, batch: int = 64, flops: float = 10e12, bandwidth: float = 16e9,
            checkpoints: str = "none") -> dict:
    """The predictions the benchmark prints, as a dict (bytes and seconds)."""
    model, trainable = traced_model(width, depth, batch)
    slots = ADAM_SLOTS * trainable
    cost = CostModel(flops_per_second=flops, bandwidth=bandwidth)
    chosen = memory_proposal(model).checkpoint_ops if checkpoints == "memory" else []
    resident = simulate_resident(model, chosen, slot_bytes=slots, cost=cost)
    offloaded = simulate_offload(model, chosen, slot_bytes=slots, cost=cost)
    return {"model": model, "trainable": trainable, "slots": slots, "resident": resident, "offloaded": offloaded,
            "handles": len(variable_handles(model))}


def report(found: dict, width: int, depth: int, batch: int, flops: float, bandwidth: float,
           checkpoints: str) -> List[str]:
    """The lines the benchmark prints."""
    resident, offloaded = found["resident"], found["offloaded"]
    activations = found["model"].activation_bytes()
    lines = [
        f"wide MLP: {depth} x Dense({width}, relu) + Dense(10), batch {batch}, float32, Adam; "
        f"plan: {'plain backprop' if checkpoints == 'none' else 'memory mode'}",
        f"variables {found['trainable'] / MIB:.1f} MiB ({found['handles']} tensors), Adam state "
        f"{found['slots'] / MIB:.1f} MiB, forward activations {activations / MIB:.1f} MiB",
        f"cost model: {flops / 1e12:g} TFLOP/s on the device, {bandwidth / 1e9:g} GB/s each way to the host",
        "",
        f"{'':18}{'device peak':>13}{'resident':>11}{'step time':>12}{'copied in':>12}{'sent back':>12}",
        f"{'without offload':18}{resident.peak_bytes / MIB:>9.1f} MiB{resident.resident_bytes / MIB:>7.1f} MiB"
        f"{resident.step_seconds * 1e3:>9.2f} ms{'-':>12}{'-':>12}",
        f"{'with offload':18}{offloaded.peak_bytes / MIB:>9.1f} MiB{offloaded.resident_bytes / MIB:>7.1f} MiB"
        f"{offloaded.step_seconds * 1e3:>9.2f} ms{offloaded.copied_bytes / MIB:>8.1f} MiB"
        f"{offloaded.returned_bytes / MIB:>8.1f} MiB",
        "",
        f"reduction: device peak {resident.peak_bytes / offloaded.peak_bytes:.2f}x lower "
        f"({resident.peak_bytes / MIB:.1f} -> {offloaded.peak_bytes / MIB:.1f} MiB); step time "
        f"{offloaded.step_seconds / resident.step_seconds:.2f}x the resident step's",
        f"(with transfers taking no time, the offloaded peak would be {offloaded.ordered_peak_bytes / MIB:.1f} MiB)",
        "",
        "Predicted only: this machine has no GPU, and its two logical devices (host and accelerator) share one "
        "allocator, so the device's peak cannot be measured apart from the host's; the host's work (gate copies, "
        "Adam's update on the CPU) is not timed.",
    ]
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--flops", type=float, default=10e12)
    parser.add_argument("--bandwidth", type=float, default=16e9)
    parser.add_argument("--checkpoints", choices=("none", "memory"), default="none")
    args = parser.parse_args(argv)
    found = figures(args.width, args.depth, args.batch, args.flops, args.bandwidth, args.checkpoints)
    print("\n".join(report(found, args.width, args.depth, args.batch, args.flops, args.bandwidth,
                           args.checkpoints)))


if __name__ == "__main__":
    main()
