"""What a planner proposes: the one result type every planner returns.

A proposal names what to keep (``checkpoint_ops``, and the inner
checkpoints of multi-level plans) and what to swap, with the simulator's
figures for it, so planners compare and :func:`memsaving.planners.planning.make_plan`
turns any of them into a :class:`~memsaving.planners.planning.Plan` the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple


@dataclass
class Proposal:
    """A plan proposal scored by the simulator.

    Attributes
    ----------
    checkpoint_ops : list of int
        ops whose outputs are kept from the forward pass.
    peak : int
        simulated peak bytes (resident memory included).
    recompute_cost : float
        FLOPs recomputed.
    inner
        multi-level plans: kept op -> the inner checkpoints its
        segment recomputes first (empty for single-level plans).
    swapped : list of int
        tensor ids copied to host memory between the two passes.
    seconds : float or None
        simulated step time, when the plan was timed (swaps).
    name : str
        which planner or variant proposed it.
    """

    checkpoint_ops: List[int]
    peak: int
    recompute_cost: float
    inner: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    swapped: List[int] = field(default_factory=list)
    seconds: Optional[float] = None
    name: str = ""

    def fits(self, budget: int) -> bool:
        """The simulated peak is within ``budget`` bytes."""
        return self.peak <= budget

    def renamed(self, name: str) -> "Proposal":
        """The same proposal under another name."""
        return replace(self, name=name)
