"""Marking tensors as checkpoints from model code (the ``"collection"`` mode)."""

from typing import TypeVar

import tensorflow as tf

CHECKPOINTS_COLLECTION = "checkpoints"
"""Name of the graph collection read by ``checkpoints="collection"``.

It is the collection name the TF1 ``memory_saving_gradients`` package used, so
graphs that were marked for it keep working.

Examples
--------
:func:`checkpoint` adds to it; TF1 code may add to it directly:

>>> import tensorflow as tf
>>> import memsaving
>>> memsaving.CHECKPOINTS_COLLECTION
'checkpoints'
>>> graph = tf.Graph()
>>> with graph.as_default():
...     x = tf.compat.v1.placeholder(tf.float32, [2, 4])
...     h = tf.tanh(x)
...     tf.compat.v1.add_to_collection(memsaving.CHECKPOINTS_COLLECTION, h)
>>> graph.get_collection(memsaving.CHECKPOINTS_COLLECTION) == [h]
True
"""

T = TypeVar("T")


@tf.autograph.experimental.do_not_convert
def checkpoint(tensor: T) -> T:
    """Mark ``tensor`` as a checkpoint and return it unchanged.

    Use it inline in model code: ``h = memsaving.checkpoint(tf.nn.relu(h))``.
    Marked tensors are kept from the forward pass; with
    ``checkpoints="collection"`` (or :func:`memsaving.gradients_collection`)
    everything between two marked tensors is recomputed during backprop.

    In eager mode there is no graph to rewrite, so the call does nothing; the
    same model code therefore runs eagerly and inside ``tf.function``.

    Parameters
    ----------
    tensor : tf.Tensor
        the graph tensor to keep; it is added (once) to its graph's
        :data:`CHECKPOINTS_COLLECTION`.  Any other value (an eager tensor,
        a variable) is returned without being marked.

    Returns
    -------
    tf.Tensor
        ``tensor`` itself.

    Examples
    --------
    >>> import tensorflow as tf
    >>> import memsaving
    >>> w = tf.Variable(tf.fill([4, 4], 0.1))
    >>> marked = []
    >>> @tf.function
    ... def step(x):
    ...     h = memsaving.checkpoint(tf.tanh(x @ w))
    ...     loss = tf.reduce_sum(tf.tanh(h @ w))
    ...     marked.extend(h.graph.get_collection(memsaving.CHECKPOINTS_COLLECTION))
    ...     return memsaving.gradients(loss, [w])  # checkpoints="collection": keeps h
    >>> step(tf.ones([2, 4]))[0].shape, len(marked)
    (TensorShape([4, 4]), 1)

    Eagerly, the tensor comes back as it is:

    >>> x = tf.ones([2, 4])
    >>> memsaving.checkpoint(x) is x
    True
    """
    if isinstance(tensor, tf.Tensor) and not tf.executing_eagerly() and hasattr(tensor, "graph"):
        collection = tensor.graph.get_collection_ref(CHECKPOINTS_COLLECTION)
        if not any(t is tensor for t in collection):
            collection.append(tensor)
    return tensor
