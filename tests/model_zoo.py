"""Small models for comparing memsaving.gradients with tf.gradients.

Each model has ``param_shapes`` and ``forward(x, params) -> (loss, checkpoints)``
written with plain TensorFlow ops, so the same code builds a tf.function and a
tf.compat.v1 graph.  ``make_input(rng)`` gives the data.
"""

import numpy as np
import tensorflow as tf


class DeepMLP:
    name = "deep_mlp"
    depth, width, batch = 12, 16, 8

    def param_shapes(self):
        return [(self.width, self.width)] * self.depth + [(self.width,)] * self.depth

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.width)).astype(np.float32)

    def forward(self, x, params):
        ws, bs = params[: self.depth], params[self.depth:]
        h, cps = x, []
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = tf.tanh(tf.matmul(h, w) + b)
            if i % 4 == 3:
                cps.append(h)
        return tf.reduce_sum(h * h), cps


class ResidualNet:
    name = "residual"
    blocks, width, batch = 5, 12, 6

    def param_shapes(self):
        return [(self.width, self.width)] * (2 * self.blocks)

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.width)).astype(np.float32)

    def forward(self, x, params):
        h, cps = x, []
        for i in range(self.blocks):
            w1, w2 = params[2 * i], params[2 * i + 1]
            h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2)
            cps.append(h)
        return tf.reduce_mean(tf.square(h)), cps[1:-1]


class TwoTower:
    name = "two_tower"
    width, batch = 10, 5

    def param_shapes(self):
        return [(self.width, self.width)] * 6 + [(2 * self.width, 1)]

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.width)).astype(np.float32)

    def forward(self, x, params):
        a, b, cps = x, x * 0.5, []
        for i in range(3):
            a = tf.nn.relu(tf.matmul(a, params[i]))
            b = tf.sigmoid(tf.matmul(b, params[3 + i]))
            if i == 1:
                cps += [a, b]
        out = tf.matmul(tf.concat([a, b], axis=1), params[6])
        return tf.reduce_sum(out), cps


class EmbeddingModel:
    """Embedding lookups give IndexedSlices gradients for the table."""

    name = "embedding"
    vocab, dim, batch = 30, 8, 7

    def param_shapes(self):
        return [(self.vocab, self.dim), (self.dim, self.dim), (self.dim, self.dim)]

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.dim)).astype(np.float32)

    def forward(self, x, params):
        table, w1, w2 = params
        ids = tf.constant([1, 3, 3, 7, 0, 29, 11])
        e = tf.gather(table, ids)  # ResourceGather on the variable
        h1 = tf.nn.relu(tf.matmul(e + x, w1))
        h2 = tf.tanh(tf.matmul(h1, w2))
        return tf.reduce_sum(h2 * e), [h1]


class DropoutModel:
    """tf.nn.dropout draws random numbers: they must never be redrawn."""

    name = "dropout"
    width, batch = 16, 9

    def param_shapes(self):
        return [(self.width, self.width)] * 4

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.width)).astype(np.float32)

    def forward(self, x, params):
        h, cps = x, []
        for i, w in enumerate(params):
            h = tf.nn.dropout(tf.nn.relu(tf.matmul(h, w)), rate=0.5)
            if i == 1:
                cps.append(h)
        return tf.reduce_sum(h), cps


class SplitModel:
    """Multi-output ops (split, unstack) with a checkpoint on one output."""

    name = "split_unstack"
    width, batch = 12, 4

    def param_shapes(self):
        return [(self.width, self.width), (4, self.width), (self.width, 3)]

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.width)).astype(np.float32)

    def forward(self, x, params):
        w1, w2, w3 = params
        h = tf.tanh(tf.matmul(x, w1))
        p, q, r = tf.split(h, 3, axis=1)
        rows = tf.unstack(tf.nn.relu(p * q + r), axis=0)
        z = tf.stack(rows[::-1], axis=0)
        z = tf.matmul(z, w2)
        z = tf.matmul(tf.sin(z) + h, w3)
        return tf.reduce_sum(z * z), [q, rows[1]]


class IntBoolModel:
    """Integer and boolean tensors inside the recomputed segments."""

    name = "int_bool"
    width, batch = 10, 6

    def param_shapes(self):
        return [(self.width, self.width)] * 3

    def make_input(self, rng):
        return rng.standard_normal((self.batch, self.width)).astype(np.float32)

    def forward(self, x, params):
        h = tf.matmul(x, params[0])
        mask = h > 0.1
        h = tf.where(mask, h, 0.3 * h)
        idx = tf.argmax(h, axis=1)
        picked = tf.gather(h, idx, axis=1, batch_dims=1)
        h2 = tf.matmul(h, params[1]) * tf.cast(tf.shape(h)[0], tf.float32)
        h3 = tf.nn.elu(tf.matmul(h2, params[2]))
        return tf.reduce_sum(h3) + tf.reduce_sum(picked), [h2]


ALL_MODELS = [DeepMLP, ResidualNet, TwoTower, EmbeddingModel, DropoutModel, SplitModel, IntBoolModel]
