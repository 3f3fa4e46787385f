"""The models the hard-limit benchmark trains: twelve Keras families, three
keras.applications nets and two keras_hub backbones, each with one batch of
inputs and targets.

Every model maps its inputs to one tensor; the loss is the mean squared
error against zeros (what ``compile(loss="mse")`` computes with zero
targets), so a hand-written step and Keras' ``fit`` train the same thing.
Sizes are chosen so that one step takes well under a second on 2 cores and
the plain step's own memory is tens of MiB: large enough that a budget of
a fraction of it is not lost in the allocator's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import keras
import tensorflow as tf

from memsaving.tools import models


@dataclass
class Case:
    """A built model, one batch of its inputs and targets, and the batch size."""

    model: keras.Model
    inputs: object
    targets: tf.Tensor
    batch: int
    description: str


def _normal(*shape) -> tf.Tensor:
    return tf.random.stateless_normal(shape, seed=(1, 2))


def _tokens(batch: int, length: int, vocab: int) -> tf.Tensor:
    return tf.random.stateless_uniform([batch, length], seed=(3, 4), minval=0, maxval=vocab, dtype=tf.int32)


def _case(model: keras.Model, inputs, batch: int, description: str) -> Case:
    """The case, its zero targets shaped from the model's symbolic output: a
    forward pass run eagerly here would itself need memory above a tight
    cap (Keras' functional models hold every layer's output in eager mode)."""
    shape = [batch] + list(model.outputs[0].shape[1:])
    return Case(model, inputs, tf.zeros(shape, model.outputs[0].dtype), batch, description)


def densenet(size: int = 32, channels: int = 8, blocks: int = 3, layers: int = 4, growth: int = 8) -> keras.Model:
    """DenseNet-style: in each block, BN-ReLU-Conv3x3 layers whose outputs are
    concatenated to everything before them; a 1x1 transition halves the
    channels and the size between blocks."""
    inputs = keras.Input((size, size, channels))
    h = inputs
    for block in range(blocks):
        for _ in range(layers):
            r = keras.layers.BatchNormalization()(h)
            r = keras.layers.Activation("relu")(r)
            r = keras.layers.Conv2D(growth, 3, padding="same", use_bias=False)(r)
            h = keras.layers.Concatenate()([h, r])
        if block < blocks - 1:
            h = keras.layers.Conv2D(h.shape[-1] // 2, 1, use_bias=False)(h)
            h = keras.layers.AveragePooling2D(2)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="densenet")


def depthwise_separable(size: int = 64, blocks: int = 6, channels: int = 32) -> keras.Model:
    """MobileNet-style blocks: DepthwiseConv2D, BatchNorm, SiLU, a 1x1
    Conv2D, BatchNorm, SiLU, residual sum."""
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(channels, 3, padding="same")(inputs)
    for _ in range(blocks):
        r = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Activation("silu")(r)
        r = keras.layers.Conv2D(channels, 1, use_bias=False)(r)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.Activation("silu")(r)
        h = keras.layers.Add()([h, r])
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="depthwise_separable")


def grouped_convolutions(size: int = 32, blocks: int = 6, channels: int = 32) -> keras.Model:
    """ConvNeXt's block in small: a grouped 7x7 Conv2D (one group per channel,
    a nested jit-compiled function on CPU), LayerNormalization,
    Dense(gelu), Dense, residual sum."""
    inputs = keras.Input((size, size, channels))
    h = inputs
    for _ in range(blocks):
        r = keras.layers.Conv2D(channels, 7, padding="same", groups=channels)(h)
        r = keras.layers.LayerNormalization()(r)
        r = keras.layers.Dense(2 * channels, activation="gelu")(r)
        h = keras.layers.Add()([h, keras.layers.Dense(channels)(r)])
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="grouped_convolutions")


def recurrent_layer(kind: str, steps: int = 64, features: int = 32, units: int = 128) -> keras.Model:
    """A Dense projection, one ``LSTM`` or ``GRU`` over the whole sequence, a Dense head."""
    inputs = keras.Input((steps, features))
    h = keras.layers.Dense(units)(inputs)
    layer = keras.layers.LSTM if kind == "lstm" else keras.layers.GRU
    h = layer(units, return_sequences=True)(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name=kind)


def seq2seq(steps: int = 48, features: int = 32, units: int = 128) -> keras.Model:
    """An LSTM encoder whose final states start an LSTM decoder over a second
    sequence (teacher forcing), a Dense head on the decoder's outputs."""
    source = keras.Input((steps, features), name="source")
    target = keras.Input((steps, features), name="target")
    _, h, c = keras.layers.LSTM(units, return_state=True)(keras.layers.Dense(units)(source))
    decoded = keras.layers.LSTM(units, return_sequences=True)(keras.layers.Dense(units)(target), initial_state=[h, c])
    return keras.Model([source, target], keras.layers.Dense(10)(decoded), name="seq2seq")


def text_convolutions(length: int = 256, vocab: int = 5000, dim: int = 128, layers: int = 4) -> keras.Model:
    """Embedding, then Conv1D + ReLU layers with max pooling, a Dense head."""
    inputs = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(inputs)
    for _ in range(layers):
        h = keras.layers.Conv1D(dim, 5, padding="same", activation="relu")(h)
    h = keras.layers.GlobalMaxPooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="text_convolutions")


def _application(name: str, size: int = 64, batch: int = 8) -> Callable[[bool], Case]:
    builders = {
        "resnet50v2": keras.applications.ResNet50V2,
        "efficientnetb0": keras.applications.EfficientNetB0,
        "mobilenetv3small": keras.applications.MobileNetV3Small,
    }

    def build(quick: bool) -> Case:
        s, b = (32, 4) if quick else (size, batch)
        model = builders[name](weights=None, input_shape=(s, s, 3), classes=10)
        return _case(model, _normal(b, s, s, 3), b, f"keras.applications.{builders[name].__name__}, "
                     f"weights=None, {s}x{s}, classes=10, batch {b}")
    return build


def keras_hub_backbone(kind: str) -> Callable[[bool], Case]:
    """A keras_hub ``"gpt2"`` or ``"bert"`` backbone built from constructor
    arguments (no preset, nothing downloaded), wrapped so it returns its
    ``sequence_output``."""
    def build(quick: bool) -> Case:
        import keras_hub  # pylint: disable=import-outside-toplevel

        layers, seq, batch = (2, 64, 2) if quick else (4, 128, 4)
        cls = keras_hub.models.GPT2Backbone if kind == "gpt2" else keras_hub.models.BertBackbone
        backbone = cls(vocabulary_size=1000, num_layers=layers, num_heads=4, hidden_dim=128, intermediate_dim=512,
                       max_sequence_length=seq)
        inputs = {"token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask")}
        if kind == "bert":
            inputs["segment_ids"] = keras.Input((seq,), dtype="int32", name="segment_ids")
        outputs = backbone(inputs)
        if isinstance(outputs, dict):  # BERT returns its pooled output too
            outputs = outputs["sequence_output"]
        model = keras.Model(inputs, outputs, name=kind)
        data = {"token_ids": _tokens(batch, seq, 1000), "padding_mask": tf.ones([batch, seq], tf.int32)}
        if kind == "bert":
            data["segment_ids"] = tf.zeros([batch, seq], tf.int32)
        return _case(model, data, batch, f"keras_hub {cls.__name__}(vocabulary_size=1000, num_layers={layers}, "
                     f"num_heads=4, hidden_dim=128, intermediate_dim=512), seq {seq}, batch {batch}")
    return build


def _family(builder: Callable[[], keras.Model], inputs: Callable[[int], object], batch: int, quick_batch: int,
            description: str) -> Callable[[bool], Case]:
    def build(quick: bool) -> Case:
        b = quick_batch if quick else batch
        keras.utils.set_random_seed(0)
        return _case(builder(), inputs(b), b, f"{description}, batch {b}")
    return build


FAMILIES: Dict[str, Callable[[bool], Case]] = {
    "mlp": _family(lambda: models.mlp(size=256, depth=24, width=256), lambda b: _normal(b, 256), 512, 128,
                   "Dense(256, relu) x 24, 256 features"),
    "resconv": _family(lambda: models.residual_convnet(size=32, blocks=8, filters=(16, 32)),
                       lambda b: _normal(b, 32, 32, 3), 16, 4, "8 residual blocks (Conv2D+BatchNorm+Add), 32x32"),
    "two_tower": _family(lambda: models.two_tower(size=256, depth=12, width=256), lambda b: _normal(b, 256), 512, 128,
                         "two towers of Dense(256, relu) x 12, concatenated"),
    "unet": _family(lambda: models.unet(64), lambda b: _normal(b, 64, 64, 3), 4, 2, "tools.models.unet, 64x64"),
    "attention": _family(lambda: models.attention_encoder(size=128, blocks=3, dim=128, heads=4),
                         lambda b: _normal(b, 128, 128), 8, 2, "3 pre-norm MultiHeadAttention blocks, seq 128, dim 128"),
    "densenet": _family(densenet, lambda b: _normal(b, 32, 32, 8), 16, 4,
                        "3 DenseNet blocks of 4 BN-ReLU-Conv-Concat layers, 32x32x8"),
    "depthwise": _family(depthwise_separable, lambda b: _normal(b, 64, 64, 3), 8, 2,
                         "6 depthwise-separable blocks (BatchNorm, SiLU, residual), 64x64, 32 channels"),
    "grouped": _family(grouped_convolutions, lambda b: _normal(b, 32, 32, 32), 8, 2,
                       "6 ConvNeXt-style blocks (grouped 7x7 Conv2D, LayerNorm, Dense gelu), 32x32x32"),
    "lstm": _family(lambda: recurrent_layer("lstm"), lambda b: _normal(b, 64, 32), 32, 8, "LSTM(128) over 64 steps"),
    "gru": _family(lambda: recurrent_layer("gru"), lambda b: _normal(b, 64, 32), 32, 8, "GRU(128) over 64 steps"),
    "gpt": _family(lambda: models.gpt(size=128, layers=2, dim=128, heads=4, vocab=16000),
                   lambda b: _tokens(b, 128, 16000), 8, 2,
                   "GPT-style, 2 pre-norm blocks of width 128, 128 tokens, a Dense head over 16,000 tokens"),
    "seq2seq": _family(seq2seq, lambda b: [_normal(b, 48, 32), _normal(b, 48, 32)], 32, 8,
                       "LSTM(128) encoder-decoder, 48 steps each"),
    "text": _family(text_convolutions, lambda b: _tokens(b, 256, 5000), 32, 8,
                    "Embedding(5000, 128), 4 Conv1D(128, 5) layers, 256 tokens"),
    "resnet50v2": _application("resnet50v2"),
    "efficientnetb0": _application("efficientnetb0"),
    "mobilenetv3small": _application("mobilenetv3small"),
    "gpt2": keras_hub_backbone("gpt2"),
    "bert": keras_hub_backbone("bert"),
}
"""Name -> builder(quick) of each model the benchmark trains."""

NEEDS_KERAS_HUB = frozenset({"gpt2", "bert"})

SPLIT_MODELS = frozenset({"gpt"})
"""Models whose budgets are also tried with ``split="auto"`` plans: a wide
vocabulary head, whose logits no checkpoint plan makes smaller."""


def build(name: str, quick: bool = False) -> Optional[Case]:
    """The case ``name`` (None when it needs keras_hub and keras_hub is not installed)."""
    if name in NEEDS_KERAS_HUB:
        try:
            import keras_hub  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError:
            return None
    keras.utils.set_random_seed(0)
    return FAMILIES[name](quick)
