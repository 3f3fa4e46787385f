"""Marking tensors as checkpoints from model code (the ``"collection"`` mode)."""

from typing import TypeVar

import tensorflow as tf

CHECKPOINTS_COLLECTION = "checkpoints"
"""Name of the graph collection read by ``checkpoints="collection"``.

It is the collection name the TF1 ``memory_saving_gradients`` package used, so
graphs that were marked for it keep working.
"""

T = TypeVar("T")


@tf.autograph.experimental.do_not_convert
def checkpoint(tensor: T) -> T:
    """Mark ``tensor`` as a checkpoint and return it unchanged.

    Use it inline in model code: ``h = memsaving.checkpoint(tf.nn.relu(h))``.
    Marked tensors are kept from the forward pass; with
    ``checkpoints="collection"`` (the default of :func:`memsaving.gradients`)
    everything between two marked tensors is recomputed during backprop.

    In eager mode there is no graph to rewrite, so the call does nothing; the
    same model code therefore runs eagerly and inside ``tf.function``.
    """
    if isinstance(tensor, tf.Tensor) and not tf.executing_eagerly() and hasattr(tensor, "graph"):
        collection = tensor.graph.get_collection_ref(CHECKPOINTS_COLLECTION)
        if not any(t is tensor for t in collection):
            collection.append(tensor)
    return tensor
