"""Programs written the way the TF1 gradient-checkpointing package's users
wrote them, each run in a fresh process by ``test_patching``.

What matters is the order in which TensorFlow's ``tensorflow.compat.v1``
module is first imported and read and memsaving's functions are first
loaded, so nothing but the standard library is imported at the top.
"""

ORDERS = ("tensorflow.compat.v1 first", "memsaving first", "tf.compat.v1 first")
"""``tensorflow.compat.v1 first``: ``import tensorflow.compat.v1 as tf`` and
a read of ``tf.gradients`` before memsaving's functions load;
``memsaving first``: ``from memsaving import gradients_memory`` before that
import (the order isort gives); ``tf.compat.v1 first``: the module reached
as ``tensorflow.compat.v1`` after ``import tensorflow``, read before
memsaving's functions load."""


def idiom_takes_effect(order: str, function: str = "gradients_memory") -> list:
    """``[tf.gradients is memsaving's, tensorflow.compat.v1.gradients is
    memsaving's]`` after ``tf.__dict__["gradients"] = memsaving.<function>``,
    with ``tf`` and memsaving brought in in ``order``."""
    import importlib

    if order == "memsaving first":
        replacement = getattr(importlib.import_module("memsaving"), function)
        import tensorflow.compat.v1 as tf
        tensorflows = tf.gradients
    elif order == "tensorflow.compat.v1 first":
        import tensorflow.compat.v1 as tf
        tensorflows = tf.gradients
        replacement = getattr(importlib.import_module("memsaving"), function)
    else:
        import tensorflow

        tf = tensorflow.compat.v1
        tensorflows = tf.gradients
        replacement = getattr(importlib.import_module("memsaving"), function)
    assert tensorflows is not replacement
    tf.__dict__["gradients"] = replacement
    import tensorflow

    return [tf.gradients is replacement, tensorflow.compat.v1.gradients is replacement]


def tf1_user_program(length: int = 100) -> dict:
    """The TF1 package's README usage on a ``length``-node chain of 1 MB
    tanh nodes, in a v1 graph and session: TensorFlow's ``tf.gradients`` is
    kept (to compare with), ``tf.__dict__["gradients"] =
    memsaving.gradients_memory``, then ``tf.gradients(y, x)``.

    Returns the peak of memsaving's session run (first in the process), the
    peak of TensorFlow's gradients of the same graph run afterwards, the
    largest difference between the two gradients and the number of ops in
    memsaving's name scope.
    """
    import tensorflow.compat.v1 as tf

    import memsaving
    from helpers import session_peak, tf1_session, tf1_tanh_chain

    tensorflows_gradients = tf.gradients
    tf.__dict__["gradients"] = memsaving.gradients_memory

    def run(gradients_fn) -> tuple:
        graph = tf.Graph()
        with graph.as_default():
            nodes = tf1_tanh_chain(length)
            grads = gradients_fn(nodes[-1], nodes[0])
            ops = sum(1 for op in graph.get_operations() if op.name.startswith("memsaving_gradients/"))
            with tf1_session(graph) as session:
                values, peak = session_peak(session, grads)
        return values[0], peak, ops

    ours, ours_peak, ops = run(lambda y, x: tf.gradients(y, x))
    plain, plain_peak, _ = run(tensorflows_gradients)
    return {"ours_peak": ours_peak, "plain_peak": plain_peak, "memsaving_ops": ops,
            "largest_difference": float(abs(ours - plain).max())}
