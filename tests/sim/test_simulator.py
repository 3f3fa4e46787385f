"""The simulator and planner on hand-made graph models (no TensorFlow graph)."""

from dataclasses import replace

import numpy as np
import pytest

from chains import random_chains
from memsaving.planners.budget import parse_bytes, plan_for_budget, select_for_budget
from memsaving.errors import BudgetError
from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model, validate_model
from memsaving.planners.planning import make_plan
from memsaving.model.schedule import backward_units, kept_set
from memsaving.sim.simulate import peak_lower_bound, simulate
from memsaving.sim.swap import CostModel


def test_plain_chain_holds_every_activation():
    n, size = 20, 100
    model = chain_model([size] * n, grad_reads="input")
    validate_model(model)
    sim = simulate(model)
    # all n activations are alive when backprop starts, plus the seed gradient
    assert sim.peak_bytes >= n * size
    assert sim.peak_bytes <= (n + 3) * size
    assert sim.recompute_cost == 0
    assert sim.compute_ratio == 1.0


def test_sqrt_n_checkpoints_cut_peak_and_cost_one_forward_at_most():
    n, size = 36, 100
    model = chain_model([size] * n, grad_reads="input")
    plain = simulate(model)
    ours = simulate(model, checkpoint_ops=[5, 11, 17, 23, 29])
    assert ours.peak_bytes < plain.peak_bytes / 2.5
    assert 0 < ours.recompute_cost <= model.forward_cost()
    assert 1.0 < ours.compute_ratio <= 4.0 / 3.0 + 1e-9


def test_output_reading_gradients_keep_outputs():
    model = chain_model([100] * 10, grad_reads="output")
    sim = simulate(model, checkpoint_ops=[4])
    units = backward_units(model, kept_set(model, [4]))
    assert [u.kind for u in units] == ["output", "segment"]
    assert units[1].ops == (0, 1, 2, 3, 4)
    assert sim.peak_bytes < simulate(model).peak_bytes


def test_stateful_op_and_its_inputs_are_kept():
    tensors = {0: TensorInfo("x", 10)}
    ops = []
    for i in range(4):
        tensors[i + 1] = TensorInfo(f"t{i + 1}", 10, i)
        ops.append(OpInfo(f"op{i}", "Op", (i,), (i + 1,), copyable=(i != 2), grad_reads=(i,)))
    model = GraphModel(ops, tensors, xs=[0], ys=[4])
    assert kept_set(model, []) == {1, 2}


def test_plan_explain_lists_units():
    model = chain_model([2 ** 20] * 16)
    plan = make_plan(model, [3, 7, 11], "list")
    text = plan.table()
    assert "predicted peak" in text and "segment" in text
    assert plan.predicted_peak < plan.plain_peak
    assert len([s for s in plan.segments if s.kind == "segment"]) == 3


def test_budget_selection_fits_and_prefers_less_recompute():
    model = chain_model([1000] * 49, costs=[1.0] * 49)
    plain = simulate(model).peak_bytes
    loose = select_for_budget(model, list(range(48)), int(plain * 0.6))
    tight = select_for_budget(model, list(range(48)), int(plain * 0.3))
    assert loose.peak <= plain * 0.6 and tight.peak <= plain * 0.3
    cost_loose = simulate(model, loose.checkpoint_ops).recompute_cost
    cost_tight = simulate(model, tight.checkpoint_ops).recompute_cost
    assert cost_loose <= cost_tight


def test_infeasible_budget_names_smallest_feasible():
    model = chain_model([1000] * 25)
    with pytest.raises(BudgetError, match="smallest feasible budget") as err:
        select_for_budget(model, list(range(24)), 500)
    assert "bytes" in str(err.value) and "500 bytes" in str(err.value)


def test_a_budget_under_the_lower_bound_is_refused_without_searching_for_it(monkeypatch):
    """The budget's own searches (the per-op refinements here) are skipped;
    the floor reported is the lowest plan's, the same as without the shortcut,
    and passed back as the budget it fits."""
    model = chain_model([1000] * 25)
    candidates = list(range(24))
    with pytest.raises(BudgetError) as searched:
        plan_for_budget(model, candidates, peak_lower_bound(model))  # at the bound: searched, nothing fits
    from memsaving.planners import budget as planner

    def refine(*args, **kwargs):
        raise AssertionError("searched for a budget nothing can fit")

    monkeypatch.setattr(planner, "refined_plans", refine)
    with pytest.raises(BudgetError) as refused:
        plan_for_budget(model, candidates, peak_lower_bound(model) - 1)
    assert refused.value.smallest_budget == searched.value.smallest_budget
    assert "No plan can fit it" in str(refused.value) and "No plan can fit it" not in str(searched.value)
    monkeypatch.undo()
    assert plan_for_budget(model, candidates, refused.value.smallest_budget).peak <= refused.value.smallest_budget


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2 ** 30), ("512 MiB", 512 * 2 ** 20), ("1.5GB", 1_500_000_000), (4096, 4096), ("100", 100),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad, says", [
    ("two gigs", "cannot read"), ("-1GiB", "cannot read"), (0, "positive number of bytes"), ("5 parsecs", "cannot read"),
    (1.5, "fraction of a byte"), ("0.5", "positive number of bytes"), ("2.5B", "fraction of a byte"),
])
def test_parse_bytes_rejects(bad, says):
    """Each refusal names the problem and the accepted forms (a unit, e.g. '2GiB')."""
    with pytest.raises(ValueError, match=says) as error:
        parse_bytes(bad)
    assert "'2GiB'" in str(error.value)


def test_parse_bytes_takes_whole_floats():
    assert parse_bytes(2e9) == 2_000_000_000


def _dense_chain(n: int, size: int, ready_gradients_early: bool) -> GraphModel:
    """h_{i+1} = h_i @ w_i for n layers: each product's two gradients are
    kernels of their own (the data gradient reads the weight, the weight
    gradient the activation)."""
    tensors = {0: TensorInfo("x", size, -1)}
    ops, weights = [], []
    for i in range(n):
        w, out = 1000 + i, i + 1
        tensors[w] = TensorInfo(f"w{i}", 4, -1)
        tensors[out] = TensorInfo(f"h{i + 1}", size, i)
        weights.append(w)
        ops.append(OpInfo(f"matmul{i}", "MatMul", (i, w), (out,), grad_reads=(i, w),
                          input_grad_reads=((w,), (i,))))
    return GraphModel(ops, tensors, xs=[0] + weights, ys=[n], ready_gradients_early=ready_gradients_early)


def test_a_pinned_segment_replays_its_recomputation_first_whatever_the_threads():
    """memsaving.tf.order pins the step to the replay, so the replay is the
    order written: a segment's recomputation, then its gradient kernels,
    last op first, one kernel per input with several inter-op threads
    (before the order was pinned, the kernels that read nothing recomputed
    were replayed first, as a free thread ran them)."""
    for early in (False, True):
        sim = simulate(_dense_chain(8, 100, early), checkpoint_ops=[3], cost=CostModel())
        labels = sim.labels[sim.unit_ends[-2] + 1:]  # the last unit: recompute h1..h3, then their gradients
        recomputed = [label for label in labels if label.startswith("recompute")]
        assert labels[:len(recomputed)] == recomputed == [f"recompute matmul{i}" for i in range(3)]
        gradients = [label.split()[-1] for label in labels[len(recomputed):]]
        assert gradients == sorted(gradients, reverse=True)
        if early:  # each product's two gradients, kernels of their own
            assert gradients.count("matmul2") == 2
    one = simulate(_dense_chain(8, 100, False), checkpoint_ops=[3], cost=CostModel())
    many = simulate(_dense_chain(8, 100, True), checkpoint_ops=[3], cost=CostModel())
    assert many.recompute_cost == one.recompute_cost
    # the per-input kernels share the op's gradient cost: the step takes as long either way
    assert many.step_seconds == pytest.approx(one.step_seconds)


def test_a_replaced_model_is_simulated_afresh():
    """The forward actions are built once per model (``GraphModel.derived``): a model made from
    it by ``dataclasses.replace`` with larger tensors must not reuse them."""
    from dataclasses import replace as replaced

    small = chain_model([4, 4, 4, 4])
    assert simulate(small).peak_bytes == simulate(small).peak_bytes  # the second run reuses the first's actions
    larger = replaced(small, tensors={t: replaced(info, nbytes=info.nbytes * 10) for t, info in small.tensors.items()})
    fresh = chain_model([40, 40, 40, 40])
    assert simulate(larger).peak_bytes == simulate(fresh).peak_bytes > simulate(small).peak_bytes


def test_a_plan_is_replayed_once_per_model_and_arguments():
    """``simulate`` remembers its replays per model: the same plan asked again (as the budget and
    lowest-peak searches do) is the same Simulation, and any argument that changes the replay gives
    another one, equal to a replay on a model that remembers nothing."""
    model = chain_model([4, 8, 4, 8, 4, 8])
    first = simulate(model, [1, 3])
    assert simulate(model, [3, 1]) is first
    assert simulate(model, kept=kept_set(model, [1, 3])) is first
    for changed in (dict(checkpoint_ops=[1]), dict(checkpoint_ops=[1, 3], keep_x_gradients=True),
                    dict(checkpoint_ops=[1, 3], unpinned=True),
                    dict(checkpoint_ops=[1, 3], swapped=[model.ops[1].outputs[0]]),
                    dict(checkpoint_ops=[1, 3], cost=CostModel(bandwidth=1e9))):
        again = simulate(model, **changed)
        assert again is not first
        unremembered = chain_model([4, 8, 4, 8, 4, 8])
        assert again.peak_bytes == simulate(unremembered, **changed).peak_bytes
        assert again.timeline == simulate(unremembered, **changed).timeline


def test_no_plan_goes_below_the_peak_lower_bound():
    """Every plan, swapped, reordered as a parallel executor runs it, or
    with the results kept, peaks at or above peak_lower_bound (the largest
    op's outputs and work buffer on top of the resident memory), which the
    budget planner uses to refuse a budget without searching."""
    rng = np.random.default_rng(7)
    for base in random_chains(6, 14, seed=3):
        ops = [replace(op, temp_bytes=int(rng.integers(0, 3000)), grad_temp_bytes=int(rng.integers(0, 3000)),
                       forwards_input=bool(rng.integers(0, 2))) for op in base.ops]
        model = replace(base, ops=ops, resident_bytes=500, ready_gradients_early=True,
                        separate_result_kernels=True)
        bound = peak_lower_bound(model)
        assert bound == 500 + max(model.tensors[op.outputs[0]].nbytes + op.temp_bytes for op in ops)
        for _ in range(8):
            chosen = sorted(int(i) for i in rng.choice(len(ops), size=int(rng.integers(0, 5)), replace=False))
            peaks = [simulate(model, chosen).peak_bytes,
                     simulate(model, chosen, keep_x_gradients=True).peak_bytes,
                     simulate(model, chosen, unpinned=True).peak_bytes,
                     simulate(model, chosen, swapped=[ops[i].outputs[0] for i in chosen],
                              cost=CostModel()).peak_bytes]
            assert min(peaks) >= bound, (chosen, peaks, bound)


def test_a_pickled_model_leaves_what_was_derived_behind():
    """A model pickles (and deep-copies) without its memo of derived
    structures, and the copy replays to the same figures."""
    import copy
    import pickle

    model = chain_model([4, 8, 4, 8])
    first = simulate(model, [1])
    assert model._derived
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert not copied._derived
        again = simulate(copied, [1])
        assert (again.peak_bytes, again.timeline) == (first.peak_bytes, first.timeline)
