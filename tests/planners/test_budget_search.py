"""The single-level budget search (memsaving.planners.budget), without TensorFlow."""

from dataclasses import replace

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, chain_model
from memsaving.planners import budget as planner
from memsaving.planners.chain import chain
from memsaving.sim.simulate import simulate


def _weighted_chain(n: int = 40, activation: int = 1000, weight: int = 3000) -> GraphModel:
    """A chain whose ops each take a weight (an x) that their gradients do
    not read: the weight gradients, which the surrogate does not count,
    pile up during the backward pass, so the surrogate is optimistic."""
    tensors = {0: TensorInfo("x", activation, -1, trainable=False)}
    ops, xs = [], []
    for i in range(n):
        w = 1000 + i
        tensors[w] = TensorInfo(f"w{i}", weight, -1, trainable=True)
        xs.append(w)
        tensors[i + 1] = TensorInfo(f"a{i + 1}", activation, i)
        ops.append(OpInfo(f"op{i}", "Op", (i, w), (i + 1,), grad_reads=(i,), cost=1.0))
    return GraphModel(ops, tensors, xs=xs, ys=[n])


def test_the_tightened_dp_never_returns_a_plan_it_already_tried(monkeypatch):
    # Tightening only the target by the simulated excess returned the same
    # plan again (its surrogate lay far under the target) and spent the
    # rounds on it: here (2,) three times at 95% of the plain peak.
    picks = []
    solve = planner._surrogate_dp

    def recorded(*args, **kwargs):
        found = solve(*args, **kwargs)
        picks.append(None if found is None else tuple(found))
        return found

    monkeypatch.setattr(planner, "_surrogate_dp", recorded)
    model = _weighted_chain()
    plain = simulate(model).peak_bytes
    for fraction in (0.97, 0.95, 0.9, 0.8, 0.6):
        picks.clear()
        budget = int(fraction * plain)
        found = planner._search(model, list(range(len(model.ops) - 1)), budget, keep_x_gradients=False,
                                cut_bytes=None, max_evaluations=40)
        tried = [p for p in picks if p is not None]
        assert len(tried) == len(set(tried)), (fraction, picks)
        assert found.best is not None and found.evaluated[found.best][1] <= budget


def test_surrogate_peak_is_what_the_dp_keeps_within_its_budget():
    # every plan the DP returns for a target has a surrogate peak within it,
    # and a target under a plan's surrogate peak never returns that plan
    model = _weighted_chain(n=24)
    summary = chain(model, [[i] for i in range(len(model.ops) - 1)])
    for target in (8_000, 12_000, 20_000, 40_000):
        picked = planner._surrogate_dp(summary, float(target))
        if picked is None:
            continue
        assert summary.peak(picked) <= target
        tighter = planner._surrogate_dp(summary, summary.peak(picked) - 1)
        assert tighter != picked


def test_the_surrogate_counts_the_work_buffer_of_the_op_that_holds_most():
    # a conv's gradient work buffer (tens of MiB on CPU) is in the simulated
    # peak; a surrogate without it thought plans fit that did not, round after round
    model = chain_model([100] * 6, grad_reads="input")
    ops = list(model.ops)
    ops[3] = replace(ops[3], grad_temp_bytes=5000)
    worked = GraphModel(ops, dict(model.tensors), xs=model.xs, ys=model.ys)
    cuts = [[i] for i in range(5)]
    plain, with_work = chain(model, cuts), chain(worked, cuts)
    assert with_work.memory(0, 6) == plain.memory(0, 6) + 5000
    assert with_work.memory(4, 6) == plain.memory(4, 6)  # a stretch without that op
    assert chain(worked, cuts, work_buffers=False).memory(0, 6) == plain.memory(0, 6)
    assert simulate(worked).peak_bytes >= 5000
