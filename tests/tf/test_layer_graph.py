"""The layer-level graph of Keras functional models."""

import keras
import pytest

from memsaving.model.graph import validate_model
from memsaving.references.layer_graph import layer_graph_model
from memsaving.references.milp import solve_milp
from memsaving.sim.replay import plain_schedule, simulate_schedule
from memsaving.sim.simulate import simulate

BATCH = 2


def tiny_model():
    inp = keras.Input((8, 8, 3))
    c = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inp)
    b = keras.layers.BatchNormalization(name="bn")(c)
    r = keras.layers.ReLU(name="relu")(b)
    a = keras.layers.Add(name="add")([r, c])
    f = keras.layers.Flatten(name="flatten")(a)
    d = keras.layers.Dense(5, activation="relu", name="dense")(f)
    return keras.Model(inp, d)


def _by_name(model):
    return {op.name: op for op in model.ops}


def test_tiny_functional_model_has_one_op_per_layer_with_sizes_and_reads():
    model = layer_graph_model(tiny_model(), BATCH)
    validate_model(model)
    assert [op.name for op in model.ops] == ["conv", "bn", "relu", "add", "flatten", "dense", "loss"]
    ops = _by_name(model)
    out = {name: ops[name].outputs[0] for name in ops}
    sizes = [model.tensors[out[n]].nbytes for n in ("conv", "bn", "relu", "add", "flatten")]
    assert sizes == [BATCH * 8 * 8 * 4 * 4] * 5
    assert model.tensors[out["dense"]].nbytes == BATCH * 5 * 4
    assert model.tensors[out["loss"]].nbytes == 4 and model.ys == [out["loss"]]
    image = ops["conv"].inputs[0]
    assert model.tensors[image].producer == -1 and not model.tensors[image].trainable
    # what each gradient reads: conv its input (linear), BN input and output,
    # ReLU its output, Add and Flatten nothing, Dense (relu) input and output
    assert ops["conv"].grad_reads == (image,)
    assert ops["bn"].grad_reads == (out["conv"], out["bn"])
    assert ops["relu"].grad_reads == (out["relu"],)
    assert ops["add"].grad_reads == () and ops["flatten"].grad_reads == ()
    assert ops["dense"].grad_reads == (out["flatten"], out["dense"])
    assert ops["loss"].grad_reads == (out["dense"],)
    assert sorted(model.consumers(out["conv"])) == [1, 3]
    # weights: 6 trainable (xs), BN's moving statistics resident only
    assert len(model.xs) == 6 and all(model.tensors[x].producer == -1 for x in model.xs)
    weights = (3 * 3 * 3 * 4 + 4) + 4 * 4 + (256 * 5 + 5)
    assert model.resident_bytes == 4 * weights + BATCH * 8 * 8 * 3 * 4
    # FLOPs: conv 2 * outputs * window * in-channels + bias; dense 2 * out * in + bias + relu
    assert ops["conv"].cost == 2 * (BATCH * 8 * 8 * 4) * 27 + BATCH * 8 * 8 * 4
    assert ops["dense"].cost == 2 * (BATCH * 5) * 256 + 2 * BATCH * 5
    assert all(op.forward for op in model.ops)


def test_tiny_model_simulates_and_solves():
    model = layer_graph_model(tiny_model(), BATCH)
    plain = simulate(model)
    assert simulate_schedule(model, plain_schedule(model)).peak_bytes == plain.peak_bytes
    result = solve_milp(model, plain.peak_bytes)
    assert result is not None and result.recompute_cost == 0


def test_prefix_ends_in_a_loss_over_the_dangling_tensors():
    model = layer_graph_model(tiny_model(), BATCH, max_layers=3)
    validate_model(model)
    ops = _by_name(model)
    assert [op.name for op in model.ops] == ["conv", "bn", "relu", "loss"]
    # Add (dropped) read relu's and conv's outputs: the loss reads both
    assert sorted(ops["loss"].inputs) == sorted([ops["relu"].outputs[0], ops["conv"].outputs[0]])


def test_vgg16_has_one_op_per_layer():
    keras_model = keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
    model = layer_graph_model(keras_model, BATCH)
    validate_model(model)
    layers = [layer.name for layer in keras_model.layers if not isinstance(layer, keras.layers.InputLayer)]
    assert [op.name for op in model.ops] == layers + ["loss"]
    assert len(model.xs) == 2 * 16  # 13 convolutions and 3 dense layers, kernel and bias
    assert all(op.forward for op in model.ops)
    convs = [op for op in model.ops if op.type == "Conv2D"]
    assert all(len(op.grad_reads) == 2 for op in convs)  # relu: input and output
    assert model.ops[-2].cost > 0 and model.tensors[model.ys[0]].nbytes == 4


def test_input_only_layers_are_not_differentiated():
    inp = keras.Input((6, 6, 2))
    pad = keras.layers.ZeroPadding2D(name="pad")(inp)
    out = keras.layers.Conv2D(3, 3, name="conv")(pad)
    model = layer_graph_model(keras.Model(inp, out), BATCH)
    ops = _by_name(model)
    assert not ops["pad"].forward and ops["conv"].forward
    assert [model.ops[i].name for i in (0, 1)] == ["pad", "conv"]


def test_rejects_non_symbolic_tensors():
    class Fake:
        outputs = [object()]
        inputs = []
    with pytest.raises(ValueError, match="symbolic"):
        layer_graph_model(Fake(), BATCH)
