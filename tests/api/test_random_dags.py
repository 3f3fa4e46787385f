"""Property-based correctness: random DAGs of differentiable ops, random
checkpoint choices, gradients equal to tf.gradients every time.

A short run is in the default suite; ``pytest -m slow`` runs a longer one.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memsaving
from helpers import loss_ancestors
from random_programs import B, W, program_loss, program_reads, program_weights, programs, run_program

MODES = ["subset", "memory", "speed", "collection", "budget", "none"]


@st.composite
def dags(draw, max_ops=14):
    """A program and its outputs, a checkpoint mode and its random choices."""
    program, outputs = draw(programs(max_ops))
    mode = draw(st.sampled_from(MODES))
    subset_seed = draw(st.integers(0, 2 ** 16))
    fraction = draw(st.sampled_from([0.5, 0.7, 0.9]))
    return program, outputs, mode, subset_seed, fraction


def _check(example):
    program, outputs, mode, subset_seed, fraction = example
    weights = program_weights(program)
    x = tf.constant(np.random.RandomState(1).randn(B, W).astype(np.float32))
    xs_vars = list(weights.values())

    @tf.function
    def both(x):
        tensors = run_program(program, x, weights)
        loss = program_loss(tensors, outputs)
        xs = [x] + xs_vars
        plain = tf.gradients(loss, xs)
        kwargs = {}
        live = loss_ancestors(program_reads(program), outputs)  # checkpoints must lie between xs and ys
        rng = np.random.RandomState(subset_seed)
        chosen = [tensors[i] for i in live if rng.rand() < 0.4]
        if mode == "subset":
            kwargs["checkpoints"] = chosen
        elif mode == "collection":
            for t in chosen or [tensors[live[0]]]:
                memsaving.checkpoint(t)
            kwargs["checkpoints"] = "collection"
        elif mode in ("memory", "speed"):
            kwargs["checkpoints"] = mode
        elif mode == "budget":
            base = memsaving.plan(loss, xs, checkpoints=[])
            kwargs["budget"] = base.resident_bytes + int(fraction * (base.plain_peak - base.resident_bytes))
        else:
            kwargs["checkpoints"] = []
        try:
            ours = memsaving.gradients(loss, xs, **kwargs)
        except memsaving.CheckpointError as error:
            # the one refusal a valid graph may get: "speed" with no
            # MatMul/Conv between xs and ys
            assert mode == "speed" and "found no MatMul/Conv" in str(error), str(error)
            assert not any(program[i - 1][0] in ("matmul", "conv") for i in live)
            ours = memsaving.gradients(loss, xs, checkpoints=[])
        except memsaving.BudgetError as error:
            assert "smallest feasible budget" in str(error)
            assert error.smallest_budget > kwargs["budget"]
            ours = memsaving.gradients(loss, xs, budget=error.smallest_budget)
        return plain, ours

    plain, ours = both(x)
    for p, o in zip(plain, ours):
        if p is None:
            assert o is None or not np.any(o.numpy())
            continue
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=2e-5, atol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_random_dags_gradients_equal_tf_gradients(example):
    _check(example)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(max_ops=24))
def test_random_dags_gradients_equal_tf_gradients_long_run(example):
    _check(example)
