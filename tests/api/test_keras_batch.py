"""memsaving.keras sizes its plan for the batch the train step really gets.

Keras traces its train step with an unknown (None) batch dimension whenever
the last batch is partial or the data is a dataset, so the plan cannot read
the batch from the graph; these tests check that the plan made under
``fit`` / ``train_on_batch`` has the activation bytes of a plan of the same
step traced with a static batch of that size (with the batch sized as 1,
as before, they are a fraction of it).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import memsaving
import memsaving.keras as mkeras

ROWS = 60  # not a multiple of the batch sizes below: Keras traces a None batch


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(32, activation="tanh") for _ in range(4)]
                             + [keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(rows=ROWS):
    rng = np.random.default_rng(0)
    return rng.standard_normal((rows, 16)).astype("float32"), rng.standard_normal((rows, 4)).astype("float32")


def _activation_bytes(plan) -> int:
    """Plain peak without the resident parameters and inputs: what scales with the batch."""
    return plan.plain_peak - plan.resident_bytes


def _direct_activation_bytes(model, batch: int) -> int:
    """The same loss planned by memsaving.plan with a static batch of ``batch`` rows."""
    plans = []

    @tf.function
    def step(x, y):
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        plans.append(memsaving.plan(loss, model.trainable_weights, checkpoints="memory"))
        return loss

    step.get_concrete_function(tf.TensorSpec((batch, 16)), tf.TensorSpec((batch, 4)))
    return _activation_bytes(plans[0])


def _assert_sized_for(model, batch: int):
    plan = mkeras.plan_of(model)
    assert _activation_bytes(plan) == _direct_activation_bytes(model, batch)
    assert plan.batch_size == batch, plan.batch_source


@pytest.mark.parametrize("batch_size, expected", [(8, 8), (None, 32)])
def test_fit_on_arrays_plans_for_fits_batch_size(batch_size, expected, capsys):
    model = mkeras.enable(_model())
    x, y = _data()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    _assert_sized_for(model, expected)
    assert mkeras.plan_of(model).batch_source != "traced input shape", "the test needs an unknown traced batch"
    assert f"plan for batch {expected} (" in capsys.readouterr().out


def test_plan_grows_with_the_batch():
    sizes = {}
    for batch in (8, 32):
        model = mkeras.enable(_model(), verbose=False)
        model.fit(*_data(), batch_size=batch, epochs=1, verbose=0)
        sizes[batch] = _activation_bytes(mkeras.plan_of(model))
    assert sizes[32] > 2 * sizes[8]  # activations scale; weight gradients do not


def test_fit_on_a_dataset_plans_for_its_batch():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=1).batch(16).prefetch(1)
    assert dataset.element_spec[0].shape[0] is None
    model = mkeras.enable(_model(), verbose=False)
    model.fit(dataset, epochs=1, verbose=0)
    _assert_sized_for(model, 16)
    assert mkeras.plan_of(model).batch_source == "dataset batch()"


def test_dataset_batch_is_read_without_touching_its_order():
    """The pipeline is read, not iterated: a shuffled dataset trains as with plain Keras."""
    x, y = _data()

    def train(enabled):
        tf.random.set_seed(3)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS).batch(16)
        model = _model()
        if enabled:
            mkeras.enable(model, verbose=False)
        return model.fit(dataset, epochs=2, verbose=0).history["loss"]

    np.testing.assert_allclose(train(True), train(False), rtol=1e-5)


def _generator(x, y, batch):
    for start in range(0, len(x), batch):
        yield x[start:start + batch], y[start:start + batch]


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        return self.x[i * self.batch:(i + 1) * self.batch], self.y[i * self.batch:(i + 1) * self.batch]


def _batches(kind, x, y, batch):
    if kind == "generator":
        return _generator(x, y, batch)
    if kind == "pydataset":
        return _Batches(x, y, batch)
    spec = (tf.TensorSpec((None, 16), tf.float32), tf.TensorSpec((None, 4), tf.float32))
    return tf.data.Dataset.from_generator(lambda: _generator(x, y, batch), output_signature=spec)


@pytest.mark.parametrize("kind", ["generator", "pydataset", "from_generator"])
def test_fit_on_generators_plans_for_their_first_batch(kind):
    x, y = _data()
    histories = []
    for enabled in (False, True):
        model = _model()
        if enabled:
            mkeras.enable(model, verbose=False)
        histories.append((model.fit(_batches(kind, x, y, 12), epochs=1, verbose=0).history["loss"],
                          int(model.optimizer.iterations.numpy())))
    assert mkeras.plan_of(model).batch_size == 12
    # a peeked generator batch is still trained on: same steps and losses as plain Keras
    assert histories[1][1] == histories[0][1]
    np.testing.assert_allclose(histories[1][0], histories[0][0], rtol=1e-5)


def test_train_on_batch_plans_for_its_rows():
    model = mkeras.enable(_model(), verbose=False)
    x, y = _data()
    model.train_on_batch(x[:4], y[:4])  # traced with a static batch of 4
    _assert_sized_for(model, 4)
    model.train_on_batch(x[:6], y[:6])  # Keras retraces with a None batch
    _assert_sized_for(model, 6)
    plan = mkeras.plan_of(model)
    assert plan.batch_source != "traced input shape"
    model.train_on_batch(x[:3], y[:3])  # smaller: the plan for 6 still holds, no retrace
    assert mkeras.plan_of(model) is plan


def test_second_fit_with_another_batch_replans(capsys):
    model = mkeras.enable(_model())
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    _assert_sized_for(model, 16)
    printed = capsys.readouterr().out
    assert printed.count("memsaving:") == 2 and "plan for batch 8 (" in printed and "plan for batch 16 (" in printed


class BatchesItself(keras.Sequential):
    """Like a keras_hub task: its fit makes the (None-batch) dataset and calls Keras' fit."""

    def fit(self, x=None, y=None, batch_size=None, **kwargs):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size or 32)
        dataset = dataset.map(lambda a, b: (a, b))
        return super().fit(dataset, **kwargs)


def test_subclass_fit_is_read_from_the_callers_arguments():
    keras.utils.set_random_seed(0)
    model = BatchesItself([keras.Input((16,))] + [keras.layers.Dense(32, activation="tanh") for _ in range(4)]
                           + [keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    mkeras.enable(model, verbose=False)
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0)
    _assert_sized_for(model, 8)
    assert mkeras.plan_of(model).batch_source == "fit(batch_size=8)"


def test_explicit_batch_size_wins():
    model = mkeras.enable(_model(), batch_size=20, verbose=False)
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0)
    _assert_sized_for(model, 20)
    assert mkeras.plan_of(model).batch_source == "enable(batch_size=20)"


def test_data_batch_size():
    x, y = _data()
    assert mkeras.data_batch_size(x, y, batch_size=8)[:2] == (8, "fit(batch_size=8)")
    assert mkeras.data_batch_size(x, y)[0] == 32
    assert mkeras.data_batch_size(x[:10], y[:10])[0] == 10
    assert mkeras.data_batch_size(x, y, steps_per_epoch=4)[0] == 15
    assert mkeras.data_batch_size(x, y, batch_size=64, validation_split=0.5)[0] == 30
    assert mkeras.data_batch_size({"a": x, "b": x}, y, batch_size=5)[0] == 5
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(7, drop_remainder=True)
    assert mkeras.data_batch_size(batched)[:2] == (7, "dataset element_spec")
    rebatched = tf.data.Dataset.from_tensor_slices((x, y)).batch(7).unbatch().batch(9).map(lambda a, b: (a, b))
    assert mkeras.data_batch_size(rebatched)[:2] == (9, "dataset batch()")
    # the pipeline is read only through transformations that keep the batch; else the first element is read
    grouped = tf.data.Dataset.from_tensor_slices((x, y)).batch(7).unbatch().batch(5).rebatch(3)
    assert mkeras.data_batch_size(grouped)[:2] == (3, "dataset's first batch")


def test_unknown_sequence_dimension_warns_once():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(50, 8)(tokens)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8, activation="tanh")(h))
    model = keras.Model(tokens, keras.layers.Dense(4)(h))
    model.compile(optimizer="sgd", loss="mse")
    mkeras.enable(model, verbose=False)
    dataset = tf.data.Dataset.range(20).map(
        lambda i: (tf.ones([i % 5 + 1], tf.int32), tf.zeros([4]))).padded_batch(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=2, verbose=0)
        model.fit(dataset, epochs=1, verbose=0)
    messages = [str(w.message) for w in caught if "unknown dimensions besides the batch" in str(w.message)]
    assert len(messages) == 1 and "enable(model, batch_size=N)" in messages[0]
    assert mkeras.plan_of(model).batch_size == 8


def test_disable_restores_fit_and_train_on_batch():
    model = mkeras.enable(_model(), verbose=False)
    assert "fit" in model.__dict__ and "train_on_batch" in model.__dict__
    mkeras.disable(model)
    assert "fit" not in model.__dict__ and "train_on_batch" not in model.__dict__
    model.fit(*_data(), batch_size=8, epochs=1, verbose=0)
