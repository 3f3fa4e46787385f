"""Split regions on the neutral model (no TensorFlow): which ops a region
takes in, how a region is folded into one op, and that the folded op holds
one piece at a time, as the simulator scores it."""

import math
from dataclasses import replace

import pytest

from memsaving.errors import BudgetError
from memsaving.model.graph import GraphModel, OpInfo, TensorInfo, validate_model
from memsaving.model.splitting import (SPLIT_OP_TYPE, grow_region, in_place_weights, largest_splittable_ops,
                                       region_tensors, row_dims)
from memsaving.sim.split_regions import fold_regions, piece_figures
from memsaving.planners.modes import memory_proposal
from memsaving.planners.planning import make_plan
from memsaving.model.schedule import kept_set
from memsaving.planners.splits import auto_split, explicit_split, region_choices
from memsaving.sim.simulate import simulate

ROWS = 64
WIDTH = 16
VOCAB = 1024


def _lm_head() -> GraphModel:
    """x (rows x width) -> hidden (tanh) -> logits = hidden @ W (rows x vocab)
    -> per-row loss -> mean: the shape of a language model's head, whose
    logits dominate the step."""
    shapes = {0: (ROWS, WIDTH), 1: (WIDTH, VOCAB), 2: (ROWS, WIDTH), 3: (ROWS, VOCAB), 4: (ROWS,), 5: (),
              6: (ROWS, VOCAB)}
    tensors = {t: TensorInfo(f"t{t}", 4 * math.prod(s), -1, shape=s) for t, s in shapes.items()}
    producers = {2: 0, 3: 1, 4: 2, 6: 2, 5: 3}
    for t, p in producers.items():
        tensors[t] = TensorInfo(tensors[t].name, tensors[t].nbytes, p, shape=shapes[t])
    ops = [
        OpInfo("hidden", "Tanh", (0,), (2,), grad_reads=(2,), row_splits=((ROWS, (0,)),)),
        OpInfo("logits", "MatMul", (2, 1), (3,), grad_reads=(2, 1), cost=2.0 * ROWS * WIDTH * VOCAB,
               row_splits=((ROWS, (0,)),)),
        OpInfo("xent", "SoftmaxCrossEntropy", (3,), (4, 6), grad_reads=(6,), row_splits=((ROWS, (0,)),)),
        OpInfo("loss", "Mean", (4,), (5,)),
    ]
    return GraphModel(ops, tensors, xs=[0, 1], ys=[5], separate_result_kernels=True)


def test_row_dims():
    assert row_dims((8, 256, 32000), 2048) == 2
    assert row_dims((2048, 32000), 2048) == 1
    assert row_dims((8, 256), 3) is None
    assert row_dims(None, 8) is None


def test_region_grows_to_the_loss_and_stops_at_what_mixes_rows():
    model = _lm_head()
    region = grow_region(model, 1, ROWS)
    # the tanh feeds only the region: taken in upstream; the mean mixes rows
    assert region == (0, 1, 2)
    row_in, whole_in, outputs = region_tensors(model, region, ROWS)
    assert row_in == [0] and whole_in == [1] and outputs == [4]


def test_region_without_upstream_growth():
    assert grow_region(_lm_head(), 1, ROWS, upstream=False) == (1, 2)


def test_op_making_ys_stays_out():
    model = _lm_head()
    model = GraphModel(model.ops, model.tensors, model.xs, ys=[4], separate_result_kernels=True)
    # the cross-entropy makes the result the caller holds: not in a region
    assert grow_region(model, 1, ROWS, upstream=False) == (1,)


def test_folded_model_is_valid_and_holds_a_piece_at_a_time():
    model = _lm_head()
    folded = fold_regions(model, [(grow_region(model, 1, ROWS), ROWS, 8)])
    validate_model(folded)
    assert [op.type for op in folded.ops] == [SPLIT_OP_TYPE, "Mean"]
    region_op = folded.ops[0]
    # a segment may recompute it: its forward pieces run again, its outputs need not be kept
    assert region_op.chunks == 8 and region_op.copyable
    logits = model.tensors[3].nbytes
    # one piece of the logits and of the softmax saved for the gradient at a time
    assert region_op.temp_bytes < logits / 2
    plain, split = simulate(model).peak_bytes, simulate(folded).peak_bytes
    assert split < plain / 3
    assert folded.splits[0].chunks == 8 and folded.splits[0].outputs == ("t4",)


def test_more_pieces_hold_less():
    model = _lm_head()
    region = grow_region(model, 1, ROWS)
    figures = [piece_figures(model, region, ROWS, k) for k in (2, 4, 8, 16)]
    forward = [f for f, _ in figures]
    backward = [b for _, b in figures]
    assert forward == sorted(forward, reverse=True) and backward == sorted(backward, reverse=True)
    assert forward[0] > forward[-1] and backward[0] > backward[-1]


def test_product_weight_gradient_is_made_a_block_at_a_time():
    # the head's weight (16 x 1024) is read by one product: its gradient is
    # accumulated in place, a block of rows at a time, so a piece holds the
    # running sum and one block of its term, not the whole term beside it
    model = _lm_head()
    region = grow_region(model, 1, ROWS)
    pieces = 16
    blocks = in_place_weights(model, region, ROWS, pieces)
    weight = model.tensors[1].nbytes
    assert list(blocks) == [1] and blocks[1] == 4  # a piece's logits are a quarter of the weight
    _, backward = piece_figures(model, region, ROWS, pieces)
    # read by another kind of op, the weight's gradient is summed as tensors:
    # a piece holds the whole term too, three blocks more
    other = GraphModel([op if op.name != "logits" else replace(op, type="Einsum") for op in model.ops],
                       model.tensors, model.xs, model.ys, separate_result_kernels=True)
    assert in_place_weights(other, region, ROWS, pieces) == {}
    saved = piece_figures(other, region, ROWS, pieces)[1] - backward
    assert saved == pytest.approx(weight - weight // 4, abs=64)  # (a scalar or two aside)


def test_in_place_blocks_are_as_few_as_the_pieces_largest_tensor_allows():
    # a second product, whose weight (16 x 16) outweighs its own output's
    # piece (4 rows x 16) but not the piece's logits (4 rows x 1024): its
    # gradient is made in one block (every block is kernels the step's
    # function keeps, with memory of their own), the head's in four; the
    # folded region records both, for the emitter to make what was scored
    model = _lm_head()
    tensors = dict(model.tensors)
    tensors[7] = TensorInfo("t7", 4 * WIDTH * WIDTH, -1, shape=(WIDTH, WIDTH))
    ops = [replace(model.ops[0], type="MatMul", inputs=(0, 7), grad_reads=(0, 7))] + list(model.ops[1:])
    model = GraphModel(ops, tensors, xs=[0, 1, 7], ys=[5], separate_result_kernels=True)
    region = grow_region(model, 1, ROWS)
    assert 0 in region
    assert in_place_weights(model, region, ROWS, 16) == {1: 4, 7: 1}
    folded = fold_regions(model, [(region, ROWS, 16)])
    assert dict(folded.splits[0].in_place) == {"t1": 4, "t7": 1}


def test_split_regions_cost_their_forward_again_in_the_gradient():
    model = _lm_head()
    folded = fold_regions(model, [(grow_region(model, 1, ROWS), ROWS, 4)])
    region_cost = sum(op.cost for op in model.ops[:3])
    assert folded.backward_cost() == pytest.approx(model.backward_cost() + region_cost)
    plan = make_plan(folded, [], "list")
    assert plan.predicted_compute > 1.0  # against the unsplit step
    assert plan.plain_peak == simulate(model, unpinned=True).peak_bytes
    assert plan.splits and "split into pieces" in plan.table()


def test_fold_refuses_overlapping_regions():
    model = _lm_head()
    with pytest.raises(ValueError, match="two split regions"):
        fold_regions(model, [((0, 1), ROWS, 2), ((1, 2), ROWS, 2)])


def test_region_reading_its_own_result_through_an_outside_op_is_cut():
    # a -> b -> c, and a -> m (mixes rows) -> c: c cannot join a region
    # with a, since the folded op would wait on m, which waits on it
    shape = (ROWS, WIDTH)
    tensors = {0: TensorInfo("x", 4 * ROWS * WIDTH, -1, shape=shape)}
    rule = ((ROWS, (0,)),)
    ops = []
    for k, (name, kind, inputs, rows) in enumerate([("a", "Tanh", (0,), rule), ("b", "Tanh", (1,), rule),
                                                     ("m", "Mix", (1,), ()), ("c", "AddV2", (2, 3),
                                                                               ((ROWS, (0, 1)),))]):
        tensors[k + 1] = TensorInfo(name, 4 * ROWS * WIDTH, k, shape=shape)
        ops.append(OpInfo(name, kind, inputs, (k + 1,), row_splits=rows))
    tensors[5] = TensorInfo("loss", 4, 4, shape=())
    ops.append(OpInfo("loss", "Sum", (4,), (5,)))
    model = GraphModel(ops, tensors, xs=[0], ys=[5])
    assert grow_region(model, 0, ROWS) == (0, 1)


def test_shape_readers_of_folded_tensors_become_constants():
    model = _lm_head()
    tensors = dict(model.tensors)
    tensors[7] = TensorInfo("shape", 8, 4, trainable=False, shape=(2,))
    tensors[8] = TensorInfo("n", 4, 5, trainable=False, shape=())
    ops = list(model.ops) + [OpInfo("shape", "Shape", (3,), (7,), forward=False),
                             OpInfo("n", "Prod", (7,), (8,), forward=False)]
    model = GraphModel(ops, tensors, model.xs, model.ys, separate_result_kernels=True)
    folded = fold_regions(model, [(grow_region(model, 1, ROWS), ROWS, 4)])
    validate_model(folded)
    assert "shape" not in [op.name for op in folded.ops]
    assert folded.tensors[7].producer == -1 and folded.tensors[7].constant


def test_largest_splittable_op_is_the_head():
    model = _lm_head()
    assert largest_splittable_ops(model, 1) == [(2, ROWS)]  # the cross-entropy, with its saved softmax


def _memory_plan(model):
    return make_plan(model, memory_proposal(model).checkpoint_ops, "memory")


def test_explicit_split_checks_its_pieces():
    model = _lm_head()
    folded = explicit_split(model, [(1, 4)])
    assert folded.splits[0].chunks == 4
    from memsaving.errors import CheckpointError  # pylint: disable=import-outside-toplevel
    with pytest.raises(CheckpointError, match="only 64 rows"):
        explicit_split(model, [(1, 128)])
    with pytest.raises(CheckpointError, match="does not compute each row"):
        explicit_split(model, [(3, 2)])


def test_auto_split_only_when_the_budget_needs_it():
    model = _lm_head()
    unsplit = _memory_plan(model)

    def budget_plan(budget):
        def plan(candidate):
            found = _memory_plan(candidate)
            if found.predicted_peak > budget:
                raise BudgetError.carrying("over", found.predicted_peak)
            return found
        return plan

    roomy = auto_split(model, budget_plan(unsplit.predicted_peak), has_budget=True)
    assert not roomy.splits
    tight = auto_split(model, budget_plan(unsplit.predicted_peak // 2), has_budget=True)
    assert tight.splits and tight.predicted_peak <= unsplit.predicted_peak // 2
    with pytest.raises(BudgetError, match="even with split regions") as error:
        auto_split(model, budget_plan(1), has_budget=True)
    # the floor reported is the split plans', below the unsplit one
    assert error.value.smallest_budget < unsplit.predicted_peak // 2


def test_auto_split_without_budget_lowers_the_peak():
    model = _lm_head()
    found = auto_split(model, _memory_plan, has_budget=False)
    assert found.splits and found.predicted_peak < _memory_plan(model).predicted_peak / 2


def test_region_stops_at_a_fence():
    model = _lm_head()
    # the hidden features fenced: the region around the product does not take in their tanh
    assert grow_region(model, 1, ROWS, fences={2}) == (1, 2)
    assert grow_region(model, 0, ROWS, fences={2}) == (0,)


def test_regions_are_fenced_at_small_tensors_every_path_crosses():
    # the head's features (16 wide), made from its input by a scale then a
    # tanh, are far smaller than its logits (1,024 wide) and every path
    # crosses them: the region grown from the logits stops there
    head = _lm_head()
    scaled = TensorInfo("scaled", head.tensors[0].nbytes, 0, shape=(ROWS, WIDTH))
    rule = ((ROWS, (0,)),)
    ops = [OpInfo("scale", "Neg", (0,), (7,), row_splits=rule)]
    ops += [replace(op, inputs=(7,)) if op.name == "hidden" else op for op in head.ops]
    tensors = {t: (replace(info, producer=info.producer + 1) if info.producer >= 0 else info)
               for t, info in head.tensors.items()}
    tensors[7] = scaled
    model = GraphModel(ops, tensors, xs=[0, 1], ys=[5], separate_result_kernels=True)
    validate_model(model)
    assert region_choices(model, 2) == [((2, 3), ROWS)]
    # grown from the tanh, whose features are its largest output, nothing stops it
    assert region_choices(model, 1) == [((0, 1, 2, 3), ROWS)]


def test_a_region_the_output_unit_would_differentiate_is_kept():
    model = _lm_head()
    folded = fold_regions(model, [(grow_region(model, 1, ROWS), ROWS, 8)])
    region = next(i for i, op in enumerate(folded.ops) if op.type == SPLIT_OP_TYPE)
    # copyable, but only the loss's mean follows it: the output unit would take it in
    assert folded.ops[region].copyable and region in kept_set(folded, [])
