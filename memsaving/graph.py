"""The framework-neutral graph model of one gradient computation.

Planning and simulation work on this model only, so they are tested without
TensorFlow.  :mod:`memsaving.extract` builds it from a TensorFlow graph.

Ops are listed in a topological order.  Tensors are integers; each has a size
in bytes and, for forward tensors, whether gradients flow through it.  Each op
records which of its inputs and outputs its *gradient* reads: those are the
forward tensors backprop keeps alive, which is what checkpointing saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class TensorInfo:
    """A tensor: who produces it (-1 for tensors that exist before the step)."""

    name: str
    nbytes: int
    producer: int = -1
    trainable: bool = True
    constant: bool = False  # an external tensor that is not data: a constant or a variable handle


@dataclass(frozen=True)
class OpInfo:
    """An op of the forward step.

    Attributes:
      forward: gradients flow through it (it lies between xs and ys).
      copyable: recomputing it gives the same values (not stateful).
      grad_reads: the tensors (inputs or outputs) its gradient function reads.
      cost: compute cost in arbitrary units (FLOPs by default).
    """

    name: str
    type: str
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    forward: bool = True
    copyable: bool = True
    grad_reads: Tuple[int, ...] = ()
    cost: float = 1.0


@dataclass
class GraphModel:
    """One forward step: ops in topological order, tensors, what is differentiated.

    Attributes:
      ops: the ops ``ys`` depend on, in topological order.
      tensors: tensor id -> info.
      xs: tensor ids gradients are taken with respect to.
      ys: tensor ids being differentiated.
      resident_bytes: memory in use before the step starts (parameters,
        inputs), included in every predicted peak.
    """

    ops: List[OpInfo]
    tensors: Dict[int, TensorInfo]
    xs: List[int]
    ys: List[int]
    resident_bytes: int = 0
    _consumers: Optional[Dict[int, List[int]]] = field(default=None, repr=False)

    def consumers(self, tensor: int) -> List[int]:
        """Indices of the ops reading ``tensor``."""
        if self._consumers is None:
            table: Dict[int, List[int]] = {}
            for i, op in enumerate(self.ops):
                for t in set(op.inputs):
                    table.setdefault(t, []).append(i)
            self._consumers = table
        return self._consumers.get(tensor, [])

    def op_index(self) -> Dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    def forward_cost(self) -> float:
        return sum(op.cost for op in self.ops)

    def activation_bytes(self) -> int:
        return sum(self.tensors[t].nbytes for op in self.ops if op.forward for t in op.outputs)


def validate_model(model: GraphModel) -> None:
    """Raise ValueError when ``model`` is not topologically ordered or refers
    to unknown tensors (the simulator and planner rely on both)."""
    produced = {t for t, info in model.tensors.items() if info.producer == -1}
    for i, op in enumerate(model.ops):
        for t in op.inputs:
            if t not in model.tensors:
                raise ValueError(f"op {op.name} reads unknown tensor {t}")
            if t not in produced:
                raise ValueError(f"op {op.name} reads tensor {model.tensors[t].name} before it is produced")
        for t in op.outputs:
            if model.tensors[t].producer != i:
                raise ValueError(f"tensor {model.tensors[t].name} does not name op {op.name} as producer")
            produced.add(t)


def chain_model(sizes: Sequence[int], costs: Optional[Sequence[float]] = None,
                grad_reads: str = "input") -> GraphModel:
    """A chain x -> op_1 -> ... -> op_n -> loss, for tests and examples.

    ``sizes[i]`` is the bytes of op i's output; ``grad_reads`` is ``"input"``
    (like MatMul) or ``"output"`` (like Relu) or ``"both"``.
    """
    tensors = {0: TensorInfo("x", sizes[0], -1)}
    ops = []
    for i, size in enumerate(sizes):
        inp, out = i, i + 1
        tensors[out] = TensorInfo(f"t{i + 1}", size, i)
        reads = {"input": (inp,), "output": (out,), "both": (inp, out)}[grad_reads]
        cost = 1.0 if costs is None else costs[i]
        ops.append(OpInfo(f"op{i + 1}", "Op", (inp,), (out,), grad_reads=reads, cost=cost))
    return GraphModel(ops, tensors, xs=[0], ys=[len(sizes)])
