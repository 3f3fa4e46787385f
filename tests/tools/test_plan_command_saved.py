"""`memsaving plan` on saved models: named, several and integer inputs,
unknown sequence lengths (--size), custom layers (--import), --verbose."""

import io
import sys
import textwrap
import time

import keras
import pytest

from memsaving.tools.cli import main
from memsaving.tools.plan_command import run, trace_plans


def _deep(h, depth=10, width=64):
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    return h


def _run(path, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    plan = run(str(path), out=out, err=err, **kwargs)
    return plan, out.getvalue(), err.getvalue()


def test_dict_of_named_inputs(tmp_path):
    image, meta = keras.Input((24,), name="image"), keras.Input((4,), name="meta")
    h = _deep(keras.layers.Concatenate()([image, meta]))
    path = tmp_path / "named.keras"
    keras.Model({"image": image, "meta": meta}, keras.layers.Dense(3)(h)).save(path)
    plan, out, err = _run(path, batch=16, verbose=True)
    assert "memsaving plan (memory)" in out and "x lower" in out
    assert len(plan.checkpoints) > 0
    assert "image float32[16, 24]" in err and "meta float32[16, 4]" in err
    assert "memsaving.plan (memory)" in err and "tracing the step" in err and "ops traced" in err


def test_two_positional_inputs_and_two_outputs(tmp_path):
    a, b = keras.Input((8,)), keras.Input((8,))
    h = _deep(keras.layers.Add()([keras.layers.Dense(32)(a), keras.layers.Dense(32)(b)]))
    path = tmp_path / "two.keras"
    keras.Model([a, b], [keras.layers.Dense(2)(h), keras.layers.Dense(1)(h)]).save(path)
    plan, out, _ = _run(path, batch=8)
    assert "memsaving plan (memory)" in out and len(plan.checkpoints) > 0


def test_unknown_sequence_length_is_set_by_size(tmp_path, capsys):
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    h = _deep(keras.layers.Embedding(100, 32)(tokens), depth=8, width=32)
    h = keras.layers.GlobalAveragePooling1D()(h)
    path = tmp_path / "tokens.keras"
    keras.Model(tokens, keras.layers.Dense(5)(h)).save(path)
    with pytest.raises(SystemExit, match=r"'token_ids' has shape \(None, None\).*--size"):
        _run(path, batch=4)
    plan, out, err = _run(path, batch=4, size=16, verbose=True)
    assert "memsaving plan (memory)" in out and len(plan.checkpoints) > 0
    assert "token_ids int32[4, 16]" in err
    # the command line, with the same model
    assert main(["plan", str(path), "--batch", "4", "--size", "12"]) == 0
    assert "memsaving plan (memory)" in capsys.readouterr().out


def test_size_on_a_model_with_known_shapes_is_noted(tmp_path):
    x = keras.Input((6,))
    path = tmp_path / "known.keras"
    keras.Model(x, keras.layers.Dense(2)(_deep(x, depth=3))).save(path)
    _, out, err = _run(path, batch=4, size=32)
    assert "memsaving plan" in out and "--size 32 was not used" in err


CUSTOM = """
import keras


@keras.saving.register_keras_serializable(package="memsaving_test")
class ScaledRelu(keras.layers.Layer):
    def __init__(self, scale=2.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, x):
        return keras.ops.relu(x) * self.scale

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}
"""


def test_custom_layer_needs_import(tmp_path, monkeypatch, capsys):
    module = "memsaving_test_custom_layers"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(CUSTOM))
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = __import__(module)
    x = keras.Input((16,))
    h = x
    for _ in range(10):
        h = custom.ScaledRelu(0.5)(keras.layers.Dense(32)(h))
    path = tmp_path / "custom.keras"
    keras.Model(x, keras.layers.Dense(1)(h)).save(path)
    # a fresh process would not know the class: forget it
    keras.saving.get_custom_objects().pop("memsaving_test>ScaledRelu")
    monkeypatch.delitem(sys.modules, module)
    with pytest.raises(SystemExit, match=r"'ScaledRelu'.*--import MODULE"):
        main(["plan", str(path), "--batch", "4"])
    assert main(["plan", str(path), "--batch", "4", "--import", module]) == 0
    out = capsys.readouterr().out
    assert "memsaving plan (memory)" in out and "0 checkpoints" not in out


def test_import_failures_name_the_module(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"--import no_such_module_for_memsaving: .*ModuleNotFoundError"):
        main(["plan", "mlp", "--import", "no_such_module_for_memsaving"])
    (tmp_path / "memsaving_test_broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match=r"--import memsaving_test_broken: .*RuntimeError: broken on purpose"):
        main(["plan", "mlp", "--import", "memsaving_test_broken"])


def test_models_that_cannot_be_traced_say_why(tmp_path):
    class Sub(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(SystemExit, match="no recorded inputs"):
        trace_plans(Sub(), 4)
    x = keras.Input((4,), batch_size=2)
    with pytest.raises(SystemExit, match="fixed batch size 2.*--batch 2"):
        trace_plans(keras.Model(x, keras.layers.Dense(2)(x)), 4)


def test_keras_hub_backbone(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=200, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=64)
    path = tmp_path / "bert.keras"
    backbone.save(path)
    plan, out, err = _run(path, batch=2, size=32, imports=["keras_hub"], verbose=True)
    assert "memsaving plan (memory)" in out and len(plan.checkpoints) > 0
    assert "token_ids int32[2, 32]" in err and "padding_mask int32[2, 32]" in err


@pytest.mark.slow
def test_resnet50v2_trace_and_plan_time(tmp_path):
    """Trace and plan of a saved ResNet50V2 (64x64, batch 8) in under 45 s."""
    path = tmp_path / "resnet50v2.keras"
    keras.applications.ResNet50V2(weights=None, input_shape=(64, 64, 3), classes=10).save(path)
    model = keras.models.load_model(path, compile=False)
    wall, cpu = time.perf_counter(), time.process_time()
    traced = trace_plans(model, 8, plain=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"ResNet50V2 trace and plan: {wall:.1f} s wall, {cpu:.1f} s CPU; memsaving.plan "
          f"{traced.clocks['plan'].wall:.1f} s wall; {traced.graph_ops} ops")
    assert len(traced.plan.checkpoints) > 0
    assert wall < 45
