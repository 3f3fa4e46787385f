"""memsaving.keras: fit through memsaving equals plain Keras training."""

import keras
import numpy as np
import pytest

import memsaving
import memsaving.keras as mkeras


def _sequential():
    return keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(32, activation="tanh") for _ in range(8)]
                            + [keras.layers.Dense(4)])


def _functional():
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    skip = h
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    h = keras.layers.Dropout(0.2)(h)
    h = keras.layers.Conv2D(8, 3, padding="same")(h)
    h = keras.layers.Add()([h, skip])
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h))


class ResidualDenseModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.blocks = [keras.layers.Dense(24, activation="relu") for _ in range(6)]
        self.head = keras.layers.Dense(4)

    def call(self, x):
        for block in self.blocks:
            x = block(x) + x if x.shape[-1] == 24 else block(x)
        return self.head(x)


def _data(kind, n=64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 12, 12, 3) if kind == "functional" else (n, 16)).astype("float32")
    y = rng.integers(0, 4, n)
    return x, y


def _train(kind, enabled, **settings):
    keras.utils.set_random_seed(0)
    model = {"sequential": _sequential, "functional": _functional, "subclassed": ResidualDenseModel}[kind]()
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    if enabled:
        mkeras.enable(model, verbose=False, **settings)
    x, y = _data(kind)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history.history


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_fit_matches_plain_keras(kind):
    plain_model, plain = _train(kind, enabled=False)
    ours_model, ours = _train(kind, enabled=True)
    np.testing.assert_allclose(ours["loss"], plain["loss"], rtol=1e-4)
    np.testing.assert_allclose(ours["accuracy"], plain["accuracy"])
    for a, b in zip(plain_model.get_weights(), ours_model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    plan = mkeras.plan_of(ours_model)
    assert plan is not None and plan.mode == "memory"
    if kind == "sequential":
        assert plan.checkpoints, "a deep MLP gets checkpoints"


def test_budget_and_train_on_batch():
    keras.utils.set_random_seed(0)
    model = _sequential()
    model.compile(optimizer="sgd", loss="mse")
    mkeras.enable(model, budget="1GiB", verbose=False)  # budgets count all the process holds: leave room
    x = np.ones((32, 16), "float32")
    loss = model.train_on_batch(x, np.zeros((32, 4), "float32"))
    assert np.isfinite(loss)
    plan = mkeras.plan_of(model)
    assert plan.mode == "budget" and plan.budget == 2 ** 30


def test_planning_time_reaches_the_keras_step():
    keras.utils.set_random_seed(0)
    model = _sequential()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="planning_time"):
        mkeras.enable(model, planning_time=-1)
    mkeras.enable(model, budget="1GiB", verbose=False, calibration_rounds=0, planning_time=1e-9)
    model.train_on_batch(np.ones((32, 16), "float32"), np.zeros((32, 4), "float32"))
    assert mkeras.plan_of(model).planning_stopped == 1e-9


def test_enable_then_disable_restores_keras(capsys):
    keras.utils.set_random_seed(0)
    model = _sequential()
    model.compile(optimizer="sgd", loss="mse")
    mkeras.enable(model)
    assert mkeras.is_enabled(model)
    x, y = np.ones((8, 16), "float32"), np.zeros((8, 4), "float32")
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
    printed = capsys.readouterr().out
    assert printed.count("memsaving:") == 1 and "predicted peak" in printed
    mkeras.disable(model)
    assert not mkeras.is_enabled(model) and mkeras.plan_of(model) is None
    assert model.train_step.__func__ is type(model).train_step
    model.train_on_batch(x, y)
    assert capsys.readouterr().out == ""


def test_fit_with_swapping_matches_plain_keras():
    plain_model, plain = _train("sequential", enabled=False)
    ours_model, ours = _train("sequential", enabled=True, swap=True)
    np.testing.assert_allclose(ours["loss"], plain["loss"], rtol=1e-4)
    assert mkeras.plan_of(ours_model).swapped
    with pytest.raises(ValueError, match="needs budget"):
        mkeras.enable(_sequential(), swap="auto")
    # a bad swap= fails at enable, not at the first step
    with pytest.raises(TypeError, match="swap=3 .* is not supported"):
        mkeras.enable(_sequential(), swap=3)


def test_memsaving_keras_is_reachable_from_the_package():
    assert memsaving.keras.enable is mkeras.enable
