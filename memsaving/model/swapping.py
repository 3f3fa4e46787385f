"""Swap timing rules and defaults shared by the simulator and the emitter.

The simulator (:class:`memsaving.sim.swap.CostModel`) and the TensorFlow
rewrite (:class:`memsaving.tf.swap_rewrite.SwapOptions`) must time a swap
the same way, or the predicted peak is not what runs; their defaults come
from here, and both find the ops that wait for a swap-out with
:func:`swap_out_waiters` and group readers under one swap-in with
:func:`fused_groups`.  Both count steps of the step's order: actions
in the simulator, topological levels in the rewrite.
"""

from typing import Callable, Hashable, Iterable, List, Optional, Set, TypeVar

Op = TypeVar("Op", bound=Hashable)

SWAP_IN_LEAD = 3
"""A swap-in starts after the compute this many steps before its first
consumer (``swap_lb``)."""

SWAP_IN_LATEST = 30
"""A swap-in starts at most this many steps before its first consumer
(``swap_ub``)."""

SWAP_FUSE_LEVELS = 5
"""Readers of one swapped tensor within this many topological levels of
the backward pass after the first reader of their group share one swap-in
(fusing); a reader farther on starts a new group with a swap-in of its own,
so a tensor is not held on the device across a long stretch of the
backward pass."""

SWAP_OUT_SLACK = 1
"""The forward ops this many steps after a swapped tensor's consumers wait
for its swap-out (1: the consumers' consumers), so the device copy is freed
during the forward pass and not after it."""

TRIGGERS = ("direct", "chain")
"""How a copy to the device picks its trigger (``swap_trigger``)."""


def check_copy_timing(what: str, trigger: str, lb: int, ub: int) -> None:
    """Raise ValueError unless ``trigger`` is one of :data:`TRIGGERS` and
    ``0 <= lb <= ub``: the timing keywords of swap-ins and of parameter
    copies (``what``: "swap" or "offload", named in the message)."""
    if trigger not in TRIGGERS:
        raise ValueError(f"{what} trigger must be 'direct' or 'chain', got {trigger!r}")
    if not 0 <= lb <= ub:
        raise ValueError(f"{what} bounds must satisfy 0 <= lb <= ub, got lb={lb}, ub={ub}")


def swap_out_waiters(first_readers: Iterable[Op], forward_readers: Callable[[Op], Iterable[Op]],
                     slack: int = SWAP_OUT_SLACK) -> Set[Op]:
    """The forward ops that wait for a swapped tensor's swap-out: those
    ``slack`` forward steps downstream of its forward readers.

    ``first_readers`` are the forward ops reading the swapped tensor;
    ``forward_readers(op)`` the forward ops reading any output of ``op``.
    The simulator passes op indices of the graph model, the rewrite
    TensorFlow operations, so both wait on the same ops.

    Examples
    --------
    >>> chain = {1: [2], 2: [3], 3: []}
    >>> sorted(swap_out_waiters([1], chain.get, slack=1))
    [2]
    >>> sorted(swap_out_waiters([1], chain.get, slack=0))
    [1]
    """
    frontier = set(first_readers)
    for _ in range(slack):
        frontier = {reader for op in frontier for reader in forward_readers(op)}
    return frontier


def fused_groups(readers: Iterable[Op], level: Callable[[Op], int],
                 fuse_levels: Optional[int] = SWAP_FUSE_LEVELS) -> List[List[Op]]:
    """The readers of one swapped tensor grouped by the swap-in they share,
    in the order of their levels: a group holds the readers within
    ``fuse_levels`` levels of its first one (``level(op)``: the op's
    topological level in the backward pass).  ``None`` fuses nothing: every
    reader gets its own swap-in.

    Examples
    --------
    >>> levels = {"a": 0, "b": 3, "c": 5, "d": 9}
    >>> fused_groups("abcd", levels.get, fuse_levels=5)
    [['a', 'b', 'c'], ['d']]
    >>> fused_groups("abcd", levels.get, fuse_levels=None)
    [['a'], ['b'], ['c'], ['d']]
    """
    groups: List[List[Op]] = []
    for op in sorted(readers, key=level):
        if groups and fuse_levels is not None and level(op) - level(groups[-1][0]) <= fuse_levels:
            groups[-1].append(op)
        else:
            groups.append([op])
    return groups
