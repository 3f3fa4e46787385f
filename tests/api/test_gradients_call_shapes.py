"""Property test: every argument shape tf.gradients accepts, on random DAGs.

Each example draws a random program (tests/random_programs.py), a checkpoint
choice, and a call: ``xs`` mixing the input, variables and intermediate
tensors (also ones upstream of other ``xs``, repeated ones, and ones the
loss does not depend on), a single ``x`` or a list, ``ys`` as one loss or a
list of tensors with or without ``grad_ys`` (some ``None``),
``unconnected_gradients`` and ``stop_gradients``.  ``memsaving.gradients``
must give what ``tf.gradients`` gives, ``None`` where it gives ``None``.

A few examples run by default; ``pytest -m slow`` runs many more.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memsaving
from helpers import assert_gradients_equal, dense
from random_programs import B, W, program_loss, program_reads, program_weights, programs, run_program

MODES = ("subset", "memory", "speed", "collection", "budget", "none")


@st.composite
def calls(draw, max_ops=12):
    program, outputs = draw(programs(max_ops))
    count = len(program)
    variables = [k for k, (kind, _, _, _) in enumerate(program) if kind in ("matmul", "conv")]
    pick = st.one_of(
        st.just(("input", 0)),
        st.tuples(st.just("tensor"), st.integers(1, count)),
        *([st.tuples(st.just("variable"), st.sampled_from(variables))] if variables else []),
    )
    xs = draw(st.lists(pick, min_size=1, max_size=5))
    return {
        "program": program,
        "outputs": outputs,
        "xs": xs,
        "xs_as_list": draw(st.booleans()) or len(xs) > 1,
        "ys_form": draw(st.sampled_from(("loss", "loss_list", "tensors", "tensors_grad_ys"))),
        "unconnected": draw(st.sampled_from(("none", "zero"))),
        "stop": draw(st.one_of(st.none(), st.integers(1, count))),
        "mode": draw(st.sampled_from(MODES)),
        "seed": draw(st.integers(0, 2 ** 16)),
        "fraction": draw(st.sampled_from((0.4, 0.7, 0.9))),
    }


def _descendants(reads, roots, stop) -> set:
    """Tensors computed from any of ``roots`` along paths avoiding ``stop``."""
    found = set(roots) - {stop}
    for i in range(len(reads)):
        if i != stop and any(r in found for r in reads[i]):
            found.add(i)
    return found


def _ancestors(reads, outputs, stop) -> set:
    """Tensors (the input excluded) the outputs depend on along paths avoiding ``stop``."""
    found, pending = set(), [i for i in outputs if i != stop]
    while pending:
        i = pending.pop()
        if i in found or i == 0:
            continue
        found.add(i)
        pending.extend(r for r in reads[i] if r != stop)
    return found


def check_call(call):
    program, outputs, mode = call["program"], call["outputs"], call["mode"]
    weights = program_weights(program)
    x_value = tf.constant(np.random.RandomState(call["seed"] % 101).randn(B, W).astype(np.float32))
    rng = np.random.RandomState(call["seed"])
    grad_values = {i: tf.constant(rng.randn(B, W).astype(np.float32)) for i in outputs}
    refusals = []

    @tf.function
    def both(x):
        tensors = run_program(program, x, weights)
        xs = []
        for kind, index in call["xs"]:
            xs.append(x if kind == "input" else tensors[index] if kind == "tensor" else weights[index])
        if call["ys_form"] == "loss":
            ys, grad_ys = program_loss(tensors, outputs), None
        elif call["ys_form"] == "loss_list":
            ys, grad_ys = [program_loss(tensors, outputs)], [None]
        elif call["ys_form"] == "tensors":
            ys, grad_ys = [tensors[i] for i in outputs], None
        else:
            ys = [tensors[i] for i in outputs]
            grad_ys = [grad_values[i] if (n + call["seed"]) % 3 else None for n, i in enumerate(outputs)]
        kwargs = {"unconnected_gradients": call["unconnected"]}
        if call["stop"] is not None:
            kwargs["stop_gradients"] = [tensors[call["stop"]]]
        x_arg = xs if call["xs_as_list"] else xs[0]
        plain = tf.gradients(ys, x_arg, grad_ys, **kwargs)

        # checkpoints must lie between xs and ys: after some x, before the loss
        reads = program_reads(program)
        roots = {0} if any(k == "input" for k, _ in call["xs"]) else set()
        roots |= {i for k, i in call["xs"] if k == "tensor"}
        roots |= {i + 1 for k, i in call["xs"] if k == "variable"}
        after_xs = _descendants(reads, roots, call["stop"])
        between = [i for i in sorted(_ancestors(reads, outputs, call["stop"])) if i in after_xs and i not in roots]
        chosen = [tensors[i] for i in between if rng.rand() < 0.4]
        if mode == "subset":
            kwargs["checkpoints"] = chosen
        elif mode == "collection":
            for t in chosen:
                memsaving.checkpoint(t)
            kwargs["checkpoints"] = "collection"
        elif mode in ("memory", "speed"):
            kwargs["checkpoints"] = mode
        elif mode == "budget":
            kwargs["checkpoints"] = "memory"
            base = memsaving.plan(ys, x_arg, checkpoints=[], stop_gradients=kwargs.get("stop_gradients"))
            kwargs["budget"] = max(1, int(base.resident_bytes + call["fraction"]
                                          * (base.plain_peak - base.resident_bytes)))
        else:
            kwargs["checkpoints"] = []
        try:
            ours = memsaving.gradients(ys, x_arg, grad_ys, **kwargs)
        except memsaving.BudgetError as error:
            assert error.smallest_budget > kwargs["budget"], str(error)
            refusals.append(str(error))
            kwargs["budget"] = error.smallest_budget
            ours = memsaving.gradients(ys, x_arg, grad_ys, **kwargs)
        except memsaving.CheckpointError as error:
            # the refusals a valid call may get: "speed" with no MatMul/Conv
            # between xs and ys, a budget with no cut, no tensor marked
            refusals.append(str(error))
            assert mode in ("speed", "budget", "collection", "memory"), str(error)
            kwargs.pop("budget", None)
            kwargs["checkpoints"] = []
            ours = memsaving.gradients(ys, x_arg, grad_ys, **kwargs)
        return [dense(g) for g in plain], [dense(g) for g in ours]

    plain, ours = both(x_value)
    assert len(plain) == len(ours) == len(call["xs"]) or not call["xs_as_list"]
    assert_gradients_equal(plain, ours, [f"x {i} {x}" for i, x in enumerate(call["xs"])], mode)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=15, derandomize=True, **SETTINGS)  # 400 in the slow long run below
@given(calls())
def test_call_shapes_equal_tf_gradients(call):
    check_call(call)


@pytest.mark.parametrize("mode", MODES)
def test_intermediate_xs_upstream_of_each_other(mode):
    """The reported case, h1 = x @ w0, h2 = h1 @ w1, xs = [h2, w0, h1], in
    every mode: an x does not stop the gradient reaching what lies before it."""
    program = [("matmul", 0, 0, 0), ("matmul", 1, 0, 0), ("unary", 2, 0, 0), ("matmul", 3, 0, 0)]
    check_call({"program": program, "outputs": [4], "xs": [("tensor", 2), ("variable", 0), ("tensor", 1)],
                "xs_as_list": True, "ys_form": "loss", "unconnected": "none", "stop": None,
                "mode": mode, "seed": 3, "fraction": 0.7})


@pytest.mark.slow
@settings(max_examples=400, **SETTINGS)
@given(calls(max_ops=20))
def test_call_shapes_equal_tf_gradients_long_run(call):
    check_call(call)
