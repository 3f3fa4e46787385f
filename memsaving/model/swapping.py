"""Swap timing defaults shared by the simulator and the emitter.

The simulator (:class:`memsaving.sim.swap.CostModel`) and the TensorFlow
rewrite (:class:`memsaving.tf.swap_rewrite.SwapOptions`) must time a swap
the same way, or the predicted peak is not what runs; their defaults come
from here.  Both count steps of the step's order: actions in the simulator,
topological levels in the rewrite.
"""

SWAP_IN_LEAD = 3
"""A swap-in starts after the compute this many steps before its first
consumer (``swap_lb``)."""

SWAP_IN_LATEST = 30
"""A swap-in starts at most this many steps before its first consumer
(``swap_ub``)."""

SWAP_OUT_SLACK = 1
"""The forward ops this many steps after a swapped tensor's consumers wait
for its swap-out (1: the consumers' consumers), so the device copy is freed
during the forward pass and not after it."""
