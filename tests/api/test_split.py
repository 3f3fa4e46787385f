"""``split=``: regions computed in pieces of rows, forward and backward.

Gradients are checked against ``tf.gradients`` (within float rounding of
the summation order: a weight gradient is summed piece by piece), and the
saving by measuring the allocator's peak."""

import gc
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras
import memsaving

RTOL, ATOL = 2e-5, 1e-6
"""Float32 gradients of split regions against tf.gradients: relative
2e-5 (the sum of a weight gradient over pieces is taken in another order)."""


def _lm_head(batch=2, seq=32, width=16, vocab=512, seed=0):
    """A language model's head: tanh features, a Dense over the vocabulary
    (3-D, as Keras applies it to a sequence), sparse cross-entropy."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((seq, width), batch_size=batch)
    hidden = keras.layers.Dense(width, activation="tanh")(inputs)
    logits = keras.layers.Dense(vocab)(hidden)
    model = keras.Model(inputs, logits)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal((batch, seq, width)).astype(np.float32))
    labels = tf.constant(rng.integers(0, vocab, (batch, seq)).astype(np.int32))
    return model, x, labels


def _loss(model, x, labels):
    logits = model(x, training=True)
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    return loss, logits


def _compare(ours, plain):
    assert len(ours) == len(plain)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(),
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("pieces", [2, 4, 5])
def test_lm_head_split_gradients_equal_tf_gradients(pieces):
    model, x, labels = _lm_head()
    plans = []

    @tf.function
    def step(x, labels):
        loss, logits = _loss(model, x, labels)
        ours, plan = memsaving.gradients_and_plan(loss, model.trainable_variables, checkpoints="memory",
                                                  split={logits.ref(): pieces})
        plans.append(plan)
        return loss, ours, tf.gradients(loss, model.trainable_variables)

    loss, ours, plain = step(x, labels)
    _compare(ours, plain)
    region = plans[0].splits[0]
    assert region.chunks == pieces and region.rows == 64  # batch x sequence: token by token
    assert "split into pieces" in plans[0].table()


def test_split_loss_equals_the_whole_loss():
    model, x, labels = _lm_head()

    @tf.function
    def step(x, labels):
        loss, logits = _loss(model, x, labels)
        grads = memsaving.gradients(loss, model.trainable_variables, checkpoints=[], split={logits.op: 4})
        return loss, tf.add_n([tf.reduce_sum(g) for g in grads])

    @tf.function
    def plain(x, labels):
        return _loss(model, x, labels)[0]

    np.testing.assert_allclose(step(x, labels)[0].numpy(), plain(x, labels).numpy(), rtol=1e-6)


def test_input_gradient_of_a_split_region():
    model, x, labels = _lm_head()

    @tf.function
    def step(x, labels):
        loss, logits = _loss(model, x, labels)
        xs = [x] + model.trainable_variables
        return memsaving.gradients(loss, xs, checkpoints=[], split={logits.op: 4}), tf.gradients(loss, xs)

    ours, plain = step(x, labels)
    _compare(ours, plain)


def test_split_lowers_the_measured_peak_as_predicted():
    # logits of 2 x 128 x 4096 floats (4 MiB), which the cross-entropy
    # overwrites with the softmax its gradient reads: in 8 pieces, an
    # eighth at a time
    model, x, labels = _lm_head(batch=2, seq=128, width=32, vocab=4096)
    mib = 2 ** 20

    def make(split):
        plans = []

        @tf.function
        def step(x, labels):
            loss, logits = _loss(model, x, labels)
            grads, plan = memsaving.gradients_and_plan(loss, model.trainable_variables, checkpoints="memory",
                                                       split={logits.ref(): 8} if split else None)
            plans.append(plan)
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        return step, plans

    measured, predicted = {}, {}
    for name, split in (("whole", False), ("split", True)):
        step, plans = make(split)
        step(x, labels)  # trace and warm up
        # above the memory in use before the step (weights, inputs), which
        # depends on what the tests before left in the allocator
        measured[name] = memsaving.measure_peak_increase(lambda s=step: s(x, labels))
        predicted[name] = plans[-1].predicted_peak - plans[-1].resident_bytes
    assert measured["split"] < 0.6 * measured["whole"], measured
    assert predicted["split"] < 0.6 * predicted["whole"], predicted
    # the prediction follows the measured peak: within a few percent with
    # TensorFlow's default threads (experiments.bench_split); the tests'
    # single inter-op thread holds one more piece's logits at times
    for name in measured:
        assert abs(measured[name] - predicted[name]) < 0.25 * mib + 0.4 * measured[name], (measured, predicted)


def _in_place_head(transposed: bool):
    """A head whose weight (256 x 8192 floats: 8 MiB) outweighs one piece's
    logits (16 of 256 rows: 0.5 MiB), split in 16 pieces: summed as
    tensors, the running sum and a piece's term would be alive together
    (16 MiB); accumulated in place, block by block, only the sum is whole.
    ``transposed``: the weight read as (vocabulary, width), as a tied
    embedding is.  Returns the input, the training step (gradients reduced
    to a scalar) and a function of ours and tf.gradients' gradients."""
    rng = np.random.default_rng(7)
    width, vocab, rows = 256, 8192, 256
    x = tf.constant(rng.standard_normal((rows, width)).astype(np.float32))
    labels = tf.constant(rng.integers(0, vocab, rows).astype(np.int32))
    shape = (vocab, width) if transposed else (width, vocab)
    head = tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.05)

    def loss_of(x):
        logits = tf.matmul(tf.tanh(x), head, transpose_b=transposed)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)), logits

    @tf.function
    def step(x):
        loss, logits = loss_of(x)
        grads = memsaving.gradients(loss, [head, x], checkpoints=[], split={logits.ref(): 16})
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    @tf.function
    def compare(x):
        loss, logits = loss_of(x)
        return (memsaving.gradients(loss, [head, x], checkpoints=[], split={logits.ref(): 16}),
                tf.gradients(loss, [head, x]))

    return x, step, compare


def in_place_head_peak(transposed: bool) -> int:
    """The measured peak the step of :func:`_in_place_head` adds (run in a
    process of its own by the test below)."""
    x, step, _ = _in_place_head(transposed)
    step(x)  # trace and warm up
    return memsaving.measure_peak_increase(step, x)


# the transposed head (21 s) joins the slow tests: the default run keeps the other, same rule
@pytest.mark.parametrize("transposed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_head_weight_gradient_accumulates_in_place(transposed):
    x, step, compare = _in_place_head(transposed)
    ours, plain = compare(x)
    _compare(ours, plain)
    graph = step.get_concrete_function(x).graph
    # 16 pieces, each adding its term in the 16 blocks the region records
    # (8 MiB of weight over a piece's 0.5 MiB of logits)
    assert sum(op.type == "InplaceAdd" for op in graph.get_operations()) == 16 * 16
    # Measured in a fresh process: after the hundreds of tests before it in
    # one process, this step has measured 8 MiB more (as much as without
    # the in-place sum), in two of three full runs; the cause is not found
    # yet (README, "Splitting the largest operations into pieces").
    script = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('split_tests', sys.argv[1]); "
              "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
              "print(module.in_place_head_peak(sys.argv[2] == 'True'))")
    done = subprocess.run([sys.executable, "-c", script, __file__, str(transposed)], capture_output=True, text=True,
                          check=True, timeout=600)
    added = int(done.stdout.split()[-1])
    assert added < 1.5 * 8 * 2 ** 20, added / 2 ** 20


def test_as_many_pieces_as_rows_keep_the_gradient_blocks_few():
    """An 8-row head in 8 pieces: each piece is one row.  Sized to the
    piece alone, each weight's gradient was made in one block per weight
    row (256 per piece, 2,048 in-place adds for the step, which took ten
    times as long to build as in 4 pieces); the blocks per piece are
    capped, so the block ops grow with the pieces, not their square."""
    from memsaving.model.splitting import MAX_GRADIENT_BLOCKS  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(5)
    rows, width, vocab, pieces = 8, 256, 1000, 8
    x = tf.constant(rng.standard_normal((rows, width)).astype(np.float32))
    labels = tf.constant(rng.integers(0, vocab, rows).astype(np.int32))
    weights = [tf.Variable(rng.standard_normal((width, width)).astype(np.float32) * 0.05),
               tf.Variable(rng.standard_normal((width, vocab)).astype(np.float32) * 0.05)]

    @tf.function
    def step(x):
        logits = tf.matmul(tf.tanh(tf.matmul(x, weights[0])), weights[1])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        return (memsaving.gradients(loss, weights, checkpoints=[], split={logits.ref(): pieces}),
                tf.gradients(loss, weights))

    ours, plain = step(x)
    _compare(ours, plain)
    adds = sum(op.type == "InplaceAdd" for op in step.get_concrete_function(x).graph.get_operations())
    assert 0 < adds <= pieces * len(weights) * MAX_GRADIENT_BLOCKS, adds


def test_batch_split_of_a_conv_net():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16, 16, 3), batch_size=4)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    out = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, out)
    x = tf.random.stateless_normal((4, 16, 16, 3), seed=(1, 2))
    plans = []

    @tf.function
    def step(x):
        first = None
        h = x
        for layer in model.layers[1:3]:
            h = layer(h)
            first = first if first is not None else h
        loss = tf.reduce_sum(tf.square(model.layers[3](h)))
        ours, plan = memsaving.gradients_and_plan(loss, model.trainable_variables, checkpoints="memory", split=[(first, 2)])
        plans.append(plan)
        return ours, tf.gradients(loss, model.trainable_variables)

    ours, plain = step(x)
    _compare(ours, plain)
    assert plans[0].splits[0].rows == 4  # the batch: the only rows a convolution can be cut into


def test_a_region_that_reads_another_regions_result():
    """A convolution cut along the batch, then a product over its pixels cut
    along them: the second region reads the first one's result directly (a
    convolution has no rows but the batch, the product none but its
    pixels), put together from the first one's pieces."""
    keras.utils.set_random_seed(2)
    conv = keras.layers.Conv2D(8, 3, padding="same", activation="tanh")
    conv.build((4, 8, 8, 3))
    weight = tf.Variable(tf.random.stateless_normal((8, 5), seed=(2, 3)))
    x = tf.random.stateless_normal((4, 8, 8, 3), seed=(2, 4))
    xs = conv.trainable_variables + [weight]
    plans = []

    @tf.function
    def step(x):
        features = conv(x)
        pixels = tf.reshape(features, [4 * 8 * 8, 8])
        product = tf.matmul(pixels, weight)
        # features read outside the product too: its region stops at them
        loss = tf.reduce_sum(tf.sin(product)) + tf.reduce_sum(features)
        convolution = features.op.inputs[0].op.inputs[0].op  # tanh(bias_add(conv))
        split = [(convolution, 2), (product.op, 4)]
        ours, plan = memsaving.gradients_and_plan(loss, xs, checkpoints="memory", split=split)
        plans.append(plan)
        # nothing reads the whole convolution's result: it never runs
        assert [op.type for op in features.consumers()] == []
        return ours, tf.gradients(loss, xs)

    ours, plain = step(x)
    _compare(ours, plain)
    first, second = plans[0].splits
    assert (first.rows, second.rows) == (4, 256)
    assert set(first.outputs) & set(second.row_inputs)  # the regions touch


def _lowest_and_tight(loss, model):
    """The lowest unsplit plan and a budget below it: the memory in use
    before the step (which depends on what earlier tests left in the
    allocator) and 0.7 of what that plan adds to it.  Earlier tests'
    garbage is collected first: freed between two plans, it would move the
    memory in use, and the budget with it, by megabytes."""
    gc.collect()
    lowest = memsaving.plan(loss, model.trainable_variables, checkpoints="memory", profile=False)
    return lowest, lowest.resident_bytes + int(0.7 * (lowest.predicted_peak - lowest.resident_bytes))


def test_auto_split_under_a_budget_only_when_needed():
    model, x, labels = _lm_head(batch=2, seq=64, width=16, vocab=2048)
    found = {}

    @tf.function
    def step(x, labels):
        loss, _ = _loss(model, x, labels)
        lowest, tight_budget = _lowest_and_tight(loss, model)
        roomy = memsaving.plan(loss, model.trainable_variables, budget=lowest.needed_budget, split="auto",
                               profile=False)
        tight = memsaving.plan(loss, model.trainable_variables, budget=tight_budget, split="auto", profile=False)
        found.update(lowest=lowest, roomy=roomy, tight=tight, budget=tight_budget)
        grads = memsaving.gradients(loss, model.trainable_variables, budget=tight_budget, split="auto",
                                    profile=False)
        return grads, tf.gradients(loss, model.trainable_variables)

    ours, plain = step(x, labels)
    _compare(ours, plain)
    assert not found["roomy"].splits
    assert found["tight"].splits and found["tight"].predicted_peak <= found["budget"]


def test_auto_split_in_a_calibration_splits_before_it_takes_the_lowest_plan():
    """fit_to_budget asks for the lowest plan when none fits (or_lowest):
    split="auto" must still split to fit first, and give the lowest split
    when even that does not fit, not the unsplit plan that fits nothing."""
    from memsaving.fit_budget import planning_target  # pylint: disable=import-outside-toplevel

    model, x, labels = _lm_head(batch=2, seq=64, width=16, vocab=2048)
    found = {}

    @tf.function
    def step(x, labels):
        loss, _ = _loss(model, x, labels)
        lowest, tight = _lowest_and_tight(loss, model)
        with planning_target(None, or_lowest=True):
            found["fits"] = memsaving.plan(loss, model.trainable_variables, budget=tight, split="auto",
                                           profile=False)
            found["nothing fits"] = memsaving.plan(loss, model.trainable_variables, budget=lowest.resident_bytes,
                                                   split="auto", profile=False)
        found.update(lowest=lowest, budget=tight)
        return loss

    step(x, labels)
    assert found["fits"].splits and found["fits"].predicted_peak <= found["budget"]
    assert found["nothing fits"].splits
    assert found["nothing fits"].predicted_peak < found["lowest"].predicted_peak


def _lowest_split_of_a_gpt_in_a_calibration():
    """Gradients (``memsaving.gradients``' and ``tf.gradients``') of bench_split's
    quick GPT with a one-byte budget in a calibration (or_lowest): nothing fits,
    so it gets the lowest split plan found."""
    from memsaving.fit_budget import planning_target  # pylint: disable=import-outside-toplevel
    from memsaving.tools import models  # pylint: disable=import-outside-toplevel

    keras.utils.set_random_seed(3)
    model = models.gpt(size=128, layers=4, dim=256, heads=4, vocab=4000)
    tokens = tf.constant(np.random.default_rng(3).integers(0, 4000, (8, 129)).astype(np.int32))

    @tf.function
    def step(tokens):
        logits = model(tokens[:, :-1], training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(tokens[:, 1:], logits, from_logits=True))
        with planning_target(None, or_lowest=True):
            # no planning time limit: the same plan however fast the machine
            ours = memsaving.gradients(loss, model.trainable_variables, checkpoints="memory", split="auto",
                                       budget=1, profile=False, planning_time=None)
        return ours, tf.gradients(loss, model.trainable_variables)

    return step(tokens)


@pytest.mark.slow  # 27 s; test_multilevel_plan_with_regions_as_inner_checkpoints_has_every_gradient
# forces the multi-level plan around regions whose lost gradients this guards against, in the default run
def test_lowest_split_of_a_gpt_in_a_calibration_has_every_gradient(monkeypatch):
    """The lowest split plan's gradients equal tf.gradients'.  ``budget=``
    plans models with split regions single-level: multi-level plans with
    regions give equal gradients (next test) but their peaks have not been
    measured yet.  Whether the search would find a multi-level plan depends
    on timing, so the planner's calls are watched as well as the gradients."""
    from memsaving.planners import registry as api  # the planners the registry picks, and what they call

    multilevel_asked = []

    def watched(model, *args, **kwargs):
        multilevel_asked.append((bool(model.splits), kwargs.get("multilevel", True)))
        return plan_for_budget(model, *args, **kwargs)

    plan_for_budget = api.plan_for_budget
    monkeypatch.setattr(api, "plan_for_budget", watched)
    _compare(*_lowest_split_of_a_gpt_in_a_calibration())
    assert any(split for split, _ in multilevel_asked), "no split model was planned"
    assert not any(split and multilevel for split, multilevel in multilevel_asked)


@pytest.mark.slow  # 64-106 s: a GPT's split model planned multi-level (opt-in) in a calibration
def test_multilevel_plan_with_regions_as_inner_checkpoints_has_every_gradient(monkeypatch):
    """Multi-level plans asked for on a split model (and preferred to
    single-level ones): regions are anchors and inner checkpoints.  The
    builder once kept an inner region but not its outputs, so the segments
    after it passed no gradient to it and every weight before it got None."""
    from memsaving.planners import registry as api  # the planners the registry picks, and what they call

    def multilevel(model, *args, **kwargs):
        return plan_for_budget(model, *args, **{**kwargs, "multilevel": True})

    plans = []

    def recorded(*args, **kwargs):
        plans.append(make_plan(*args, **kwargs))
        return plans[-1]

    plan_for_budget, make_plan = api.plan_for_budget, api.make_plan
    monkeypatch.setattr(api, "plan_for_budget", multilevel)
    monkeypatch.setattr(api, "make_plan", recorded)
    _compare(*_lowest_split_of_a_gpt_in_a_calibration())
    inner_regions = [name for plan in plans for names in plan.inner_checkpoints.values() for name in names
                     if name.startswith("split/")]
    assert inner_regions, "expected a multi-level plan with a region as an inner checkpoint"


def test_split_errors_say_what_to_do():
    model, x, labels = _lm_head()

    @tf.function
    def bad_op(x, labels):
        loss, _ = _loss(model, x, labels)
        return memsaving.gradients(loss, model.trainable_variables, checkpoints=[], split={loss.ref(): 2})

    with pytest.raises(memsaving.CheckpointError, match="cannot split"):
        bad_op.get_concrete_function(x, labels)

    @tf.function
    def bad_value(x, labels):
        loss, logits = _loss(model, x, labels)
        return memsaving.gradients(loss, model.trainable_variables, checkpoints=[], split={logits.ref(): 1})

    with pytest.raises(ValueError, match="int >= 2"):
        bad_value.get_concrete_function(x, labels)

    with pytest.raises(ValueError, match="split='auto'"):
        memsaving.options.parse_options({"split": "yes"})

    @tf.function
    def unknown_name(x, labels):
        loss, _ = _loss(model, x, labels)
        return memsaving.gradients(loss, model.trainable_variables, checkpoints=[], split={"no_such_op": 4})

    with pytest.raises(memsaving.CheckpointError, match="split: 'no_such_op' names no op between xs and ys"):
        unknown_name.get_concrete_function(x, labels)


def _gpt_step_gradients(split, size=16, dim=32, checkpoints=lambda logits: "memory"):
    from memsaving.tools import models  # pylint: disable=import-outside-toplevel

    keras.utils.set_random_seed(3)
    model = models.gpt(size=size, layers=2, dim=dim, heads=2, vocab=64)
    tokens = tf.constant(np.random.default_rng(3).integers(0, 64, (2, size + 1)).astype(np.int32))
    plans = []

    @tf.function
    def step(tokens):
        logits = model(tokens[:, :-1], training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(tokens[:, 1:], logits, from_logits=True))
        ours, plan = memsaving.gradients_and_plan(loss, model.trainable_variables, checkpoints=checkpoints(logits),
                                                  split=split(logits), profile=False)
        plans.append(plan)
        _FILLS.clear()
        for op in tf.compat.v1.get_default_graph().get_operations():
            if op.type == "Fill" and "memsaving" in op.name:
                _FILLS.setdefault("fills", []).append(op.name)
            if op.type == "Slice" and op.inputs[0].op.type == "Reshape" and op.inputs[0].op.inputs[0].op.type == "Fill":
                _FILLS.setdefault("cut_fills", []).append(op.name)
            if op.type == "LogicalAnd" and "memsaving" in op.name:
                _FILLS.setdefault("masks", []).append(op.name)
            if op.type == "IdentityN" and any(t.op.type == "Fill" for t in op.inputs):
                _FILLS.setdefault("whole_fills_read", []).append(op.name)
        return ours, tf.gradients(loss, model.trainable_variables)

    ours, plain = step(tokens)
    return ours, plain, plans[0]


_FILLS = {}
"""The split step's fills made per piece (``"fills"``), pieces cut from a
fill (``"cut_fills"``), the mask's pieces (``"masks"``) and the custom
gradients reading a whole fill (``"whole_fills_read"``), by
:func:`_gpt_step_gradients`."""


def test_gpt_head_and_last_block_split_token_by_token():
    # the region from the logits takes in the last block's MLP and norms
    # (token-wise) and stops at attention, which mixes tokens
    ours, plain, plan = _gpt_step_gradients(lambda logits: {logits.ref(): 8})
    _compare(ours, plain)
    region = plan.splits[0]
    assert region.rows == 32 and region.chunks == 8
    assert any("dense" in name for name in region.ops)


@pytest.mark.slow  # 13 s; split="auto" without a budget is in the default run on Keras (test_keras_enable_split_auto...)
def test_gpt_split_auto_without_budget():
    ours, plain, plan = _gpt_step_gradients(lambda logits: "auto")
    _compare(ours, plain)


def test_gpt_attention_regions_recomputed_piece_by_piece():
    """Each block's attention split along the batch (its region stops at the
    residual stream): the plan recomputes the regions it does not keep, and
    the causal mask's all-true fill is made per piece, not cut, once for
    every copy of the region."""

    def attention(logits):
        return {op: 2 for op in logits.graph.get_operations() if op.type == "Softmax"}

    def features(logits):
        # the head's input, kept: the blocks before it, regions included, are one recomputed segment
        head = logits.op.inputs[0].op.inputs[0].op  # BiasAdd(Reshape(MatMul(Reshape(features))))
        return [head.inputs[0].op.inputs[0]]

    # 64 tokens of width 16: the score matrices dwarf the residual stream
    ours, plain, plan = _gpt_step_gradients(attention, size=64, dim=16, checkpoints=features)
    _compare(ours, plain)
    assert len(plan.splits) == 2 and all(r.rows == 2 for r in plan.splits)
    assert not any(r.name in plan.kept_ops for r in plan.splits)  # both recomputed in a segment
    assert _FILLS.get("fills") and not _FILLS.get("cut_fills")
    # the mask is computed from constants: each region makes its 2 pieces
    # once, for the forward pass, the recomputation and the backward pass
    # alike (each op made would be a constant TensorFlow holds), and the
    # recomputed regions do not take the whole fill in
    assert len(_FILLS["masks"]) == 2 * 2, _FILLS["masks"]
    assert not _FILLS.get("whole_fills_read")


def test_unet_split_auto_whole_examples():
    from memsaving.tools import models  # pylint: disable=import-outside-toplevel

    keras.utils.set_random_seed(4)
    model = models.unet(32)
    x = tf.random.stateless_normal((4, 32, 32, 3), seed=(4, 5))
    plans = []

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        ours, plan = memsaving.gradients_and_plan(loss, model.trainable_variables, checkpoints="memory",
                                                  split="auto", profile=False)
        plans.append(plan)
        return ours, tf.gradients(loss, model.trainable_variables)

    ours, plain = step(x)
    _compare(ours, plain)
    assert plans[0].splits


def test_keras_enable_split_auto_trains_as_plain_keras():
    import memsaving.keras as mk  # pylint: disable=import-outside-toplevel

    def trained(enable):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((16, 8))
        logits = keras.layers.Dense(256)(keras.layers.Dense(8, activation="tanh")(inputs))
        model = keras.Model(inputs, logits)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if enable:
            mk.enable(model, split="auto", verbose=False)
        rng = np.random.default_rng(7)
        x = rng.standard_normal((8, 16, 8)).astype(np.float32)
        y = rng.integers(0, 256, (8, 16))
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        return history.history["loss"], [w.numpy() for w in model.trainable_weights], model

    plain_loss, plain_weights, _ = trained(False)
    split_loss, split_weights, model = trained(True)
    np.testing.assert_allclose(split_loss, plain_loss, rtol=1e-5)
    for a, b in zip(split_weights, plain_weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert mk.plan_of(model).splits  # the logits and the loss, in pieces of tokens
    with pytest.raises(ValueError, match="split='auto'"):
        mk.enable(model, split={"x": 2})
