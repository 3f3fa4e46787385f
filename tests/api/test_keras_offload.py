"""memsaving.keras.enable(model, offload_params=True): training equals plain
Keras to the bit, variables and optimizer state live on the host, the
optimizer's updates run there, checkpoints still work.

Two logical CPUs stand in for the devices (tests/conftest.py): the host is
"/CPU:1", the accelerator "/CPU:0"."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving.keras as mkeras
from helpers import optimized_graphs
from memsaving.tf.placement import same_device, variable_device

HOST, ACCELERATOR = "/CPU:1", "/CPU:0"
STEPS = 20
BATCH = 16


def _mlp():
    return keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(32, activation="relu") for _ in range(4)]
                            + [keras.layers.Dense(4)])


def _conv():
    return keras.Sequential([keras.Input((12, 12, 3)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                             keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                             keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(4)])


SHAPES = {"mlp": (16,), "conv": (12, 12, 3)}
BUILDERS = {"mlp": _mlp, "conv": _conv}


class _StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _data(kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH,) + SHAPES[kind]).astype("float32")
    return x, rng.integers(0, 4, STEPS * BATCH)


def _train(kind, **enabled):
    """Weights and per-step losses after ``STEPS`` steps of ``fit`` with Adam
    (``enabled``: the arguments of memsaving.keras.enable, None for plain Keras)."""
    keras.utils.set_random_seed(0)
    model = BUILDERS[kind]()
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if enabled.get("on"):
        mkeras.enable(model, verbose=False, **{k: v for k, v in enabled.items() if k != "on"})
    losses = _StepLosses()
    x, y = _data(kind)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[losses])
    assert len(losses.losses) == STEPS
    return model, model.get_weights(), losses.losses


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_offloaded_training_equals_plain_keras_to_the_bit(kind):
    _, plain_weights, plain_losses = _train(kind)
    _, enabled_weights, enabled_losses = _train(kind, on=True)
    model, ours_weights, ours_losses = _train(kind, on=True, offload_params=True, offload_device=HOST)
    assert ours_losses == plain_losses == enabled_losses
    for plain, enabled, ours in zip(plain_weights, enabled_weights, ours_weights):
        np.testing.assert_array_equal(ours, plain)
        np.testing.assert_array_equal(ours, enabled)
    plan = mkeras.plan_of(model)
    assert plan.offload is not None
    trainable = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert plan.offload.offloaded_bytes == trainable
    assert plan.offload.copied_bytes >= trainable, "every weight comes to the device at least once"
    assert plan.offload.slot_bytes >= 2 * trainable, "Adam's two slots per weight are on the host"
    assert "parameters offloaded to the host" in plan.table()


def _functional(policy):
    """Conv, BatchNormalization (moving statistics updated on the host), dropout and a skip connection."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12, 12, 3))
        h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        skip = h
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
        h = keras.layers.Dropout(0.2)(h)
        h = keras.layers.Add()([keras.layers.Conv2D(8, 3, padding="same")(h), skip])
        h = keras.layers.GlobalAveragePooling2D()(h)
        return keras.Model(inputs, keras.layers.Dense(4, dtype="float32")(h))
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_batch_norm_dropout_and_loss_scaling_train_as_without_offload(policy):
    trained = []
    for offload in (False, True):
        model = _functional(policy)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        mkeras.enable(model, verbose=False, offload_params=offload, offload_device=HOST)
        x, y = _data("conv")
        history = model.fit(x[:64], y[:64], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        trained.append((model, history.history["loss"]))
    (enabled, enabled_loss), (ours, ours_loss) = trained
    assert ours_loss == enabled_loss
    for a, b in zip(enabled.get_weights(), ours.get_weights()):  # the moving statistics included
        np.testing.assert_array_equal(a, b)
    assert all(same_device(variable_device(v), HOST) for v in ours.variables + ours.optimizer.variables)


def test_variables_and_optimizer_state_live_on_the_host_and_updates_run_there():
    model, _, _ = _train("mlp", on=True, offload_params=True, offload_device=HOST)
    optimizer_variables = model.optimizer.variables
    assert len(optimizer_variables) > 2 * len(model.trainable_weights), "Adam's slots"
    for variable in model.variables + optimizer_variables:
        assert same_device(variable_device(variable), HOST), variable.path
    graphs = [g for g in optimized_graphs(lambda: model.train_on_batch(*(a[:BATCH] for a in _data("mlp"))))
              if any(n.name.startswith(model.name + "_") and "/offload/" in n.name  # this model's step alone
                     for n in g.node)]
    assert graphs
    nodes = [n for graph in graphs for n in graph.node]
    updates = [n for n in nodes if n.op.startswith(("Assign", "ResourceApply")) and "adam" in n.name.lower()]
    assert len(updates) >= 3 * len(model.trainable_weights), "Adam updates m, v and the weight"
    assert all(same_device(n.device, HOST) for n in updates), [(n.name, n.device) for n in updates
                                                               if not same_device(n.device, HOST)]
    arithmetic = [n for n in nodes if "adam" in n.name.lower() and n.op in ("Mul", "Sqrt", "AddV2", "RealDiv")]
    assert arithmetic and all(same_device(n.device, HOST) for n in arithmetic), "the update's math runs on the host"
    copies = [n for n in nodes if n.op == "Snapshot" and n.name.endswith("_copy")]
    kernels = [w for w in model.trainable_weights if len(w.shape) == 2]
    # a forward copy of every weight, a backward one of every kernel a data gradient reads (not the first's)
    assert len(copies) >= len(model.trainable_weights) + len(kernels) - 1
    assert all(same_device(n.device, ACCELERATOR) for n in copies)
    products = [n for n in nodes if n.op in ("MatMul", "_FusedMatMul")]
    assert products and all(same_device(n.device, ACCELERATOR) for n in products)


def test_checkpoints_of_an_offloaded_model_save_and_restore(tmp_path):
    model, weights, _ = _train("mlp", on=True, offload_params=True, offload_device=HOST)
    path = str(tmp_path / "offloaded.weights.h5")
    model.save_weights(path)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved = checkpoint.save(str(tmp_path / "ckpt"))
    slots = [v.numpy() for v in model.optimizer.variables]
    for variable in model.variables + model.optimizer.variables:  # spoil everything
        variable.assign(tf.zeros_like(variable))
    model.load_weights(path)
    for restored, expected in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(restored, expected)
    for variable in model.variables + model.optimizer.variables:
        variable.assign(tf.zeros_like(variable))
    checkpoint.restore(saved).assert_consumed()
    for restored, expected in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(restored, expected)
    for restored, expected in zip(model.optimizer.variables, slots):
        np.testing.assert_array_equal(restored.numpy(), expected)
    assert all(same_device(variable_device(v), HOST) for v in model.variables + model.optimizer.variables)


def test_disable_moves_the_variables_back_and_training_goes_on():
    model, _, _ = _train("mlp", on=True, offload_params=True, offload_device=HOST)
    before = model.get_weights()
    mkeras.disable(model)
    for variable in model.variables + model.optimizer.variables:
        assert same_device(variable_device(variable), ACCELERATOR), variable.path
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in model.get_weights()]),
                                  np.concatenate([w.ravel() for w in before]))
    x, y = _data("mlp")
    loss = model.train_on_batch(x[:BATCH], y[:BATCH])
    assert np.isfinite(loss)


class LazyModel(keras.Model):
    """Built at its first call, inside ``fit``: no variable exists at ``enable``."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(24, activation="tanh")
        self.head = keras.layers.Dense(4)

    def call(self, x):
        return self.head(self.hidden(x))


def test_a_model_built_inside_fit_is_built_on_the_host():
    """Keras builds a subclassed model inside the traced step; its variables
    are made on the host all the same.  Its tanh layers also check that the
    copies' triggers keep Grappler's fused kernels (fused and unfused tanh
    round differently): training equals ``enable(model)``'s to the bit.
    The plan keeps the matmuls ("speed"): on this tiny model memory mode's
    plans tie, and which one wins is not what is tested."""
    def train(**enabled):
        keras.utils.set_random_seed(0)
        model = LazyModel()
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        mkeras.enable(model, checkpoints="speed", verbose=False, **enabled)
        assert not model.variables
        x, y = _data("mlp")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return model

    ours, enabled = train(offload_params=True, offload_device=HOST), train()
    assert all(same_device(variable_device(v), HOST) for v in ours.variables + ours.optimizer.variables)
    for a, b in zip(enabled.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)
