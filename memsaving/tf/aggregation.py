"""Summing the gradient contributions a tensor receives from several consumers."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import tensorflow as tf

Gradient = Union[tf.Tensor, tf.IndexedSlices]


def aggregate(contributions: Sequence[Optional[Gradient]]) -> Optional[Gradient]:
    """Sum gradient contributions the way tf.gradients does.

    Dense contributions are added with ``add_n``.  When every contribution is
    an ``IndexedSlices`` (gathers, embedding lookups) they are concatenated so
    the result stays sparse, as tf.gradients returns it.  A mix is densified.
    Returns None when there is no contribution.
    """
    present = [g for g in contributions if g is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    if all(isinstance(g, tf.IndexedSlices) for g in present):
        index_dtypes = {g.indices.dtype for g in present}
        cast = (lambda i: i) if len(index_dtypes) == 1 else (lambda i: tf.cast(i, tf.int64))
        return tf.IndexedSlices(
            values=tf.concat([g.values for g in present], axis=0),
            indices=tf.concat([cast(g.indices) for g in present], axis=0),
            dense_shape=present[0].dense_shape,
        )
    dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in present]
    return tf.math.add_n(dense)


def producing_ops(gradient: Optional[Gradient]) -> list:
    """The ops whose completion makes ``gradient`` available (for ordering)."""
    if gradient is None:
        return []
    if isinstance(gradient, tf.IndexedSlices):
        return [gradient.values.op, gradient.indices.op]
    return [gradient.op]
