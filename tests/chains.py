"""Graph-model builders shared by the planning side's tests (no TensorFlow)."""

from typing import Iterator

import numpy as np

from memsaving.model.graph import GraphModel, chain_model


def random_chains(count: int, n: int, seed: int) -> Iterator[GraphModel]:
    """``count`` chains of ``n`` ops with random activation bytes (100-999)
    and costs (1-10); their gradients read the op's input, its output, or
    both, in turn, so each rule of what a gradient holds is exercised."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        reads = ("input", "output", "both")[trial % 3]
        yield chain_model(list(rng.integers(100, 1000, n)), list(rng.uniform(1, 10, n)), grad_reads=reads)
