"""The backward pass replayed from remembered blocks (memsaving.sim.blocks,
memsaving.sim.row_store, the segments of memsaving.model.schedule) gives
the same simulation as a fresh model that remembers nothing."""

import random
from dataclasses import replace

import pytest

from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, validate_model
from memsaving.model.schedule import RECOMPUTING, backward_units, kept_set, validate_inner
from memsaving.sim import actions, blocks
from memsaving.sim.actions import step_blocks
from memsaving.sim.simulate import simulate

FIELDS = ("peak_bytes", "forward_cost", "recompute_cost", "backward_cost", "timeline", "labels", "unit_ends",
          "step_seconds", "swapped_bytes")


def _random_model(seed: int, count: int = 60, early: bool = True, results: bool = True) -> GraphModel:
    """A random step: elementwise ops of one or two inputs (some in place,
    some saving memory for their gradient), views, products with weights
    read through non-copyable variable reads, skip connections; the loss
    sums every tensor nothing else reads."""
    rng = random.Random(seed)
    tensors = {0: TensorInfo("x", 256)}
    ops, xs, made = [], [], [0]

    def tensor(info: TensorInfo) -> int:
        tensors[len(tensors)] = info
        return len(tensors) - 1

    while len(ops) < count:
        i, kind = len(ops), rng.random()
        if kind < 0.15:
            source = rng.choice(made[-6:])
            out = tensor(TensorInfo(f"view{i}", 0, i, value_bytes=tensors[source].nbytes or 256))
            ops.append(OpInfo(f"view{i}", "Reshape", (source,), (out,)))
        elif kind < 0.35:
            handle = tensor(TensorInfo(f"w{i}", 0, constant=True, value_bytes=128))
            xs.append(handle)
            weight = tensor(TensorInfo(f"read{i}", 0, i, value_bytes=128))
            ops.append(OpInfo(f"read{i}", "ReadVariableOp", (handle,), (weight,), copyable=False))
            source = rng.choice(made[-6:])
            out = tensor(TensorInfo(f"mm{i + 1}", rng.choice((256, 512)), i + 1))
            ops.append(OpInfo(f"mm{i + 1}", "MatMul", (source, weight), (out,), grad_reads=(source, weight),
                              input_grad_reads=((weight,), (source,)), cost=rng.uniform(5, 50),
                              temp_bytes=rng.choice((0, 64)), grad_temp_bytes=rng.choice((0, 128))))
        else:
            a, b = rng.choice(made[-8:]), rng.choice(made)
            inputs = (a,) if rng.random() < 0.5 or a == b else (a, b)
            out = tensor(TensorInfo(f"e{i}", rng.choice((256, 512, tensors[a].nbytes or 256)), i))
            reads = tuple(rng.sample(inputs + (out,), rng.randint(0, len(inputs) + 1)))
            ops.append(OpInfo(f"e{i}", rng.choice(("Add", "Mul", "Relu", "Tanh")), inputs, (out,), grad_reads=reads,
                              forwards_input=rng.random() < 0.5, cost=rng.uniform(0.5, 3),
                              saved_bytes=rng.choice((0, 0, 0, 96))))
        made.append(out)
    read = {t for op in ops for t in op.inputs}
    dangling = tuple(t for t in made if t not in read and tensors[t].producer >= 0)
    loss = tensor(TensorInfo("loss", 4, len(ops)))
    ops.append(OpInfo("loss", "AddN", dangling, (loss,)))
    model = GraphModel(ops, tensors, xs, [loss], resident_bytes=1000, separate_result_kernels=results,
                       ready_gradients_early=early)
    validate_model(model)
    return model


def _candidates(model: GraphModel):
    return [i for i, op in enumerate(model.ops) if op.forward and op.copyable
            and sum(model.tensors[t].nbytes for t in op.outputs) > 0]


def _inner(model: GraphModel, ops, rng: random.Random):
    """Inner checkpoints in some segments of the plan keeping ``ops``, and
    in some of their sub-segments, each op in one segment at most, as the
    multi-level planner chooses them (or none when the random choice is
    not valid)."""
    kept = kept_set(model, ops)
    inner = {}

    def choose(units, context):
        for unit in units:
            taken = set().union(*inner.values())
            inside = [i for i in unit.ops if i != unit.anchor and i not in taken and model.ops[i].copyable
                      and any(model.tensors[t].trainable for t in model.ops[i].outputs)]
            if unit.kind in RECOMPUTING and unit.anchor not in inner and len(inside) >= 2 and rng.random() < 0.8:
                inner[unit.anchor] = tuple(sorted(rng.sample(inside, rng.randint(1, min(3, len(inside))))))
                deeper = context | set(inner[unit.anchor])
                choose([u for u in backward_units(model, deeper) if u.anchor in inner[unit.anchor]], deeper)

    choose(backward_units(model, kept), kept)
    try:
        validate_inner(model, kept, inner)
    except ValueError:
        return {}
    return inner


def _fields(sim):
    return tuple((getattr(sim, name), type(getattr(sim, name))) for name in FIELDS)


def _same_as_fresh(model: GraphModel, ops, **options) -> None:
    """``model`` (which remembers earlier plans) replays the plan as a copy
    of it that remembers nothing does."""
    model.derived("simulations", dict).clear()
    assert _fields(simulate(model, ops, **options)) == _fields(simulate(replace(model), ops, **options))


def _neighbour_sequence(model: GraphModel, rng: random.Random, steps: int):
    """Plans that each add or drop one op of the last (a walk), and plans
    that each add one op to a fixed one (keep_more's trials)."""
    candidates = _candidates(model)
    current = set(rng.sample(candidates, len(candidates) // 3))
    plans = []
    for _ in range(steps):
        op = rng.choice(candidates)
        current = current ^ {op}
        plans.append(sorted(current))
    base = sorted(current)
    plans += [sorted(set(base) | {op}) for op in rng.sample(candidates, min(steps, len(candidates)))]
    return plans


@pytest.fixture(params=[1, 3, blocks.RUN_UNITS], ids=lambda units: f"runs of {units}")
def run_units(request, monkeypatch):
    """Runs of one unit, of three or of the usual length, on average: the
    shorter, the more of a plan's state passes from block to block."""
    monkeypatch.setattr(blocks, "RUN_UNITS", request.param)
    return request.param


@pytest.mark.parametrize("early, results", [(True, True), (False, True), (True, False), (False, False)])
def test_neighbouring_plans_replay_as_on_a_fresh_model(early, results, run_units):
    for seed in range(2):
        model = _random_model(seed, early=early, results=results)
        rng = random.Random(seed)
        for n, ops in enumerate(_neighbour_sequence(model, rng, 25)):
            _same_as_fresh(model, ops, keep_x_gradients=n % 4 == 3)
        memo = model.derived("unit blocks", lambda: pytest.fail("no plan was replayed"))
        assert any(not isinstance(entry, int) and entry.blocks for entry in memo.entries.values())


def _valid(model: GraphModel, ops, inner) -> bool:
    try:
        validate_inner(model, kept_set(model, ops), inner)
    except ValueError:
        return False
    return True


def test_multi_level_neighbours_replay_as_on_a_fresh_model(run_units):
    for seed in range(12):
        model = _random_model(100 + seed, count=80)
        rng = random.Random(seed)
        ops = sorted(rng.sample(_candidates(model), 12))
        inner = _inner(model, ops, rng)
        for n in range(12):
            _same_as_fresh(model, ops, inner=inner, keep_x_gradients=n % 3 == 0)
            if inner and n % 2:  # one inner checkpoint fewer
                anchor = rng.choice(sorted(inner))
                fewer = {a: v for a, v in {**inner, anchor: inner[anchor][1:]}.items() if v}
                inner = fewer if _valid(model, ops, fewer) else inner
            else:  # one op more kept
                ops = sorted(set(ops) | {rng.choice(_candidates(model))})
                inner = inner if _valid(model, ops, inner) else _inner(model, ops, rng)


def test_options_replay_as_on_a_fresh_model():
    model = _random_model(7)
    rng = random.Random(7)
    for ops in _neighbour_sequence(model, rng, 8):
        _same_as_fresh(model, ops, inplace=True)
        _same_as_fresh(model, ops, unpinned=True)
        _same_as_fresh(model, ops, swapped=[model.ops[ops[0]].outputs[0]] if ops else [], inplace=False)


def test_a_small_memo_forgets_starts_over_and_still_replays_the_same(monkeypatch, run_units):
    monkeypatch.setattr(actions, "MIN_REMEMBERED_ACTIONS", 300)
    monkeypatch.setattr(actions, "REMEMBERED_ACTIONS_PER_OP", 1)
    model = _random_model(3, count=80)
    rng = random.Random(3)
    plans = _neighbour_sequence(model, rng, 30)
    for ops in plans + plans[::-1]:
        _same_as_fresh(model, ops)
        memo = model.derived("unit blocks", lambda: pytest.fail("no plan was replayed"))
        # bounded whatever the number of plans: by the capacity, plus the plan just made
        assert memo.capacity == 300
        assert len(memo.entries) <= memo.size <= 2 * memo.capacity
        assert memo.row_store.actions <= 2 * memo.capacity + 4 * len(model.ops)
        assert memo.row_store.numbers.bound <= 2 * memo.capacity + 20 * len(model.ops)


def test_units_that_copy_under_one_anchor_twice_replay_as_one_list():
    # a diamond: c1 and c2 both read b, so both segments recompute a and b,
    # and both may hold a as an inner checkpoint: two sub-segments anchored at a
    tensors = {0: TensorInfo("x", 64)}
    ops = []
    for name, inputs in (("a", (0,)), ("b", (1,)), ("c1", (2,)), ("c2", (2,)), ("d", (3, 4))):
        tensors[len(tensors)] = TensorInfo(name, 64, len(ops))
        ops.append(OpInfo(name, "Tanh", inputs, (len(tensors) - 1,), grad_reads=inputs))
    loss = len(tensors)
    tensors[loss] = TensorInfo("loss", 4, len(ops))
    ops.append(OpInfo("loss", "Sum", (5,), (loss,)))
    model = GraphModel(ops, tensors, [], [loss], ready_gradients_early=True)
    kept = kept_set(model, [2, 3])
    inner = {2: (0,), 3: (0,)}
    units = backward_units(model, kept, inner)
    assert sum(unit.anchor == 0 and unit.kind in RECOMPUTING for unit in units) == 2
    for _ in range(3):
        _same_as_fresh(model, [2, 3], kept=kept, inner=inner)
    assert step_blocks(model, units) is None


def test_remembered_segments_are_the_closures():
    model = _random_model(11, count=80)
    rng = random.Random(11)
    for ops in _neighbour_sequence(model, rng, 30):
        kept = kept_set(model, ops)
        assert backward_units(model, kept) == backward_units(replace(model), kept)
        assert backward_units(model, kept, inplace=True) == backward_units(replace(model), kept, inplace=True)
