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


def transformer(size: int = 64, layers: int = 4, dim: int = 128, heads: int = 4, vocab: int = 1000) -> keras.Model:
    """A small transformer encoder over ``size`` tokens (pre-norm blocks)."""
    tokens = keras.Input((size,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(tokens)
    for _ in range(layers):
        a = keras.layers.LayerNormalization()(h)
        a = keras.layers.MultiHeadAttention(heads, dim // heads)(a, a)
        h = keras.layers.Add()([h, a])
        f = keras.layers.LayerNormalization()(h)
        f = keras.layers.Dense(4 * dim, activation="gelu")(f)
        f = keras.layers.Dense(dim)(f)
        h = keras.layers.Add()([h, f])
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(vocab)(h), name="transformer")


BUILDERS: Dict[str, Callable[[int], keras.Model]] = {
    "mlp": mlp,
    "resnet50": lambda s: keras.applications.ResNet50(weights=None, input_shape=(s, s, 3), classes=10),
    "vgg16": lambda s: keras.applications.VGG16(weights=None, input_shape=(s, s, 3), classes=10),
    "mobilenet": lambda s: keras.applications.MobileNetV2(weights=None, input_shape=(s, s, 3), classes=10),
    "unet": unet,
    "transformer": transformer,
}


def build(name: str, size: int = 64) -> keras.Model:
    """A built-in model by name (see :data:`BUILDERS`)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {sorted(BUILDERS)} "
                         "or give the path of a saved Keras model (.keras or .h5)")
    return BUILDERS[name](size)
