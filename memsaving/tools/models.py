"""Built-in Keras models for the command line, notebooks and benchmarks.

Each builder takes an image size (or sequence length) and returns an
uncompiled Keras 3 functional model with random weights (keras.applications
models use ``weights=None``: nothing is downloaded).
"""

from __future__ import annotations

from typing import Callable, Dict

import keras


def mlp(size: int = 64, depth: int = 32, width: int = 256) -> keras.Model:
    """A deep ReLU MLP on flattened ``size`` features."""
    inputs = keras.Input((size,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="mlp")


def unet(size: int = 64) -> keras.Model:
    """A small convolutional U-Net: three down and three up levels with skips."""
    inputs = keras.Input((size, size, 3))
    skips, h = [], inputs
    for filters in (16, 32, 64):
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        skips.append(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(128, 3, padding="same", activation="relu")(h)
    for filters, skip in zip((64, 32, 16), reversed(skips)):
        h = keras.layers.UpSampling2D()(h)
        h = keras.layers.Concatenate()([h, skip])
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    return keras.Model(inputs, keras.layers.Conv2D(1, 1)(h), name="unet")


def pre_norm_block(h, heads: int, dim: int):
    """One pre-norm transformer block: attention, then a 4x-wide GELU MLP,
    each added back to its input."""
    a = keras.layers.LayerNormalization()(h)
    a = keras.layers.MultiHeadAttention(heads, dim // heads)(a, a)
    h = keras.layers.Add()([h, a])
    f = keras.layers.LayerNormalization()(h)
    f = keras.layers.Dense(4 * dim, activation="gelu")(f)
    f = keras.layers.Dense(dim)(f)
    return keras.layers.Add()([h, f])


def transformer(size: int = 64, layers: int = 4, dim: int = 128, heads: int = 4, vocab: int = 1000) -> keras.Model:
    """A small transformer encoder over ``size`` tokens (pre-norm blocks)."""
    tokens = keras.Input((size,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(tokens)
    for _ in range(layers):
        h = pre_norm_block(h, heads, dim)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(vocab)(h), name="transformer")


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a sequence of embeddings."""

    def build(self, input_shape):
        self.positions = self.add_weight(shape=(input_shape[-2], input_shape[-1]), initializer="random_normal",
                                         name="positions")

    def call(self, inputs):
        return inputs + self.positions


def gpt(size: int = 256, layers: int = 4, dim: int = 256, heads: int = 4, vocab: int = 32000) -> keras.Model:
    """A GPT-style causal language model over ``size`` tokens: token and
    position embeddings, pre-norm blocks with causal attention, a final
    LayerNormalization and a Dense head giving the logits of every token
    over the vocabulary (``batch x size x vocab``: at a vocabulary of
    32,000 they dwarf every activation of the blocks)."""
    tokens = keras.Input((size,), dtype="int32")
    h = PositionEmbedding()(keras.layers.Embedding(vocab, dim)(tokens))
    for _ in range(layers):
        a = keras.layers.LayerNormalization()(h)
        a = keras.layers.MultiHeadAttention(heads, dim // heads)(a, a, use_causal_mask=True)
        h = keras.layers.Add()([h, a])
        f = keras.layers.LayerNormalization()(h)
        f = keras.layers.Dense(4 * dim, activation="gelu")(f)
        h = keras.layers.Add()([h, keras.layers.Dense(dim)(f)])
    h = keras.layers.LayerNormalization()(h)
    return keras.Model(tokens, keras.layers.Dense(vocab)(h), name="gpt")


def residual_convnet(size: int = 32, blocks: int = 8, filters: tuple = (16, 32),
                     batch_norm: bool = True) -> keras.Model:
    """A small ResNet: Conv2D + BatchNorm blocks with identity skips (``Add``).

    The blocks are split evenly between the widths in ``filters``; each new
    width starts with a strided block whose skip is a 1x1 projection.
    ``batch_norm=False``: biased convolutions and no BatchNorm, a third of
    the ops (quicker to trace and plan) with the same activations kept per
    block by the convolutions.
    """
    def normalized(h):
        return keras.layers.BatchNormalization()(h) if batch_norm else h

    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(filters[0], 3, padding="same", use_bias=not batch_norm)(inputs)
    h = normalized(h)
    h = keras.layers.Activation("relu")(h)
    per_width = max(blocks // len(filters), 1)
    for stage, width in enumerate(filters):
        for block in range(per_width):
            stride = 2 if stage > 0 and block == 0 else 1
            skip = h
            if stride != 1 or skip.shape[-1] != width:
                skip = keras.layers.Conv2D(width, 1, strides=stride, use_bias=not batch_norm)(skip)
                skip = normalized(skip)
            r = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=not batch_norm)(h)
            r = normalized(r)
            r = keras.layers.Activation("relu")(r)
            r = keras.layers.Conv2D(width, 3, padding="same", use_bias=not batch_norm)(r)
            r = normalized(r)
            h = keras.layers.Activation("relu")(keras.layers.Add()([skip, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="residual_convnet")


def two_tower(size: int = 256, depth: int = 12, width: int = 256) -> keras.Model:
    """Two ReLU Dense towers of ``depth`` layers on one input, concatenated."""
    inputs = keras.Input((size,))
    towers = []
    for _ in range(2):
        h = inputs
        for _ in range(depth):
            h = keras.layers.Dense(width, activation="relu")(h)
        towers.append(h)
    h = keras.layers.Concatenate()(towers)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="two_tower")


def attention_encoder(size: int = 128, blocks: int = 3, dim: int = 128, heads: int = 4) -> keras.Model:
    """Pre-norm transformer blocks (LayerNormalization, MultiHeadAttention,
    Dense) over ``size`` positions of ``dim`` float features (no embedding);
    returns the sequence."""
    inputs = keras.Input((size, dim))
    h = inputs
    for _ in range(blocks):
        h = pre_norm_block(h, heads, dim)
    return keras.Model(inputs, keras.layers.LayerNormalization()(h), name="attention_encoder")


def recurrent(size: int = 64, features: int = 32, units: int = 128) -> keras.Model:
    """Dense input projection, then LSTM and GRU over ``size`` steps (whole sequences)."""
    inputs = keras.Input((size, features))
    h = keras.layers.Dense(units)(inputs)
    h = keras.layers.LSTM(units, return_sequences=True)(h)
    h = keras.layers.GRU(units, return_sequences=True)(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="recurrent")


BUILDERS: Dict[str, Callable[[int], keras.Model]] = {
    "mlp": mlp,
    "resnet50": lambda s: keras.applications.ResNet50(weights=None, input_shape=(s, s, 3), classes=10),
    "vgg16": lambda s: keras.applications.VGG16(weights=None, input_shape=(s, s, 3), classes=10),
    "mobilenet": lambda s: keras.applications.MobileNetV2(weights=None, input_shape=(s, s, 3), classes=10),
    "unet": unet,
    "transformer": transformer,
    "gpt": gpt,
    "resnet50v2": lambda s: keras.applications.ResNet50V2(weights=None, input_shape=(s, s, 3), classes=10),
    "efficientnetb0": lambda s: keras.applications.EfficientNetB0(weights=None, input_shape=(s, s, 3), classes=10),
    "residual_convnet": residual_convnet,
    "two_tower": two_tower,
    "attention_encoder": attention_encoder,
    "recurrent": recurrent,
}


def build(name: str, size: int = 64) -> keras.Model:
    """A built-in model by name (see :data:`BUILDERS`)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {sorted(BUILDERS)} "
                         "or give the path of a saved Keras model (.keras or .h5)")
    return BUILDERS[name](size)
