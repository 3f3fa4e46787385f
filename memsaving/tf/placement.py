"""Moving Keras variables, and an optimizer's state, to another device.

Parameter offloading (:mod:`memsaving.tf.offload`) keeps a model's weights
and its optimizer's state in host memory.  A TensorFlow variable stays on
the device it was created on, so moving one means making its backing
``tf.Variable`` again on the host, with the same value, dtype, name and
flags, and pointing the ``keras.Variable`` at the new one (its ``_value``,
which Keras 3 sets in ``Variable._initialize``).  The ``keras.Variable``
object itself is unchanged, so layers, optimizers, ``get_weights``,
``save_weights`` and ``tf.train.Checkpoint`` (which serialise a Keras
variable through its backing variable) all keep working.

This must happen before a step is traced: a traced function holds the
handles it captured.  A built optimizer finds its model variables by the
backing variable's id (``TFOptimizer._var_key``), so its index is rebuilt
after the model's variables move (:func:`place_optimizer`).

Plain ``tf.Variable`` objects cannot be moved in place (the caller holds
the object): create them under ``tf.device(host)`` instead.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import tensorflow as tf


def same_device(a: Optional[str], b: Optional[str]) -> bool:
    """Whether two device strings name the same device (type and index;
    job, replica and task only when both give them).  An index left out
    means 0, as TensorFlow places it.

    Examples
    --------
    >>> same_device("/job:localhost/replica:0/task:0/device:CPU:1", "/CPU:1")
    True
    >>> same_device("/CPU:0", "/device:CPU:1"), same_device("", "/CPU:0")
    (False, False)
    """
    if not a or not b:
        return False
    x, y = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    if (x.device_type or "").upper() != (y.device_type or "").upper():
        return False
    if (x.device_index or 0) != (y.device_index or 0):
        return False
    return all(getattr(x, part) is None or getattr(y, part) is None or getattr(x, part) == getattr(y, part)
               for part in ("job", "replica", "task"))


def backing_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind a ``keras.Variable`` (the variable itself
    for a ``tf.Variable``)."""
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def variable_device(variable: Any) -> str:
    """The device a (Keras or TensorFlow) variable's value lives on."""
    return backing_variable(variable).device


def place_variables(variables: Iterable[Any], device: str) -> int:
    """Make each Keras variable of ``variables`` live on ``device``
    (see the module docstring); returns how many moved.  Variables already
    there, and Keras variables not yet created, are left alone.

    Raises
    ------
    TypeError
        a plain ``tf.Variable`` not on ``device``: it cannot be
        moved in place; create it under ``tf.device(device)``.
    """
    moved = 0
    for variable in variables:
        inner = backing_variable(variable)
        if inner is variable:
            if isinstance(variable, tf.Variable) and not same_device(variable.device, device):
                raise TypeError(
                    f"memsaving: cannot move the tf.Variable {variable.name} to {device} in place; create it "
                    f"under `with tf.device({device!r}):` (Keras variables are moved for you)")
            continue
        if inner is None or same_device(inner.device, device):
            continue
        with tf.init_scope(), tf.device(device):
            replacement = tf.Variable(
                inner.read_value(), dtype=inner.dtype, trainable=inner.trainable,
                name=getattr(variable, "name", None) or inner.name.split(":")[0],
                aggregation=inner.aggregation, synchronization=inner.synchronization,
                shape=inner.shape,
            )
        variable._value = replacement  # pylint: disable=protected-access  # Keras 3 keeps it there
        moved += 1
    return moved


def place_optimizer(optimizer: Any, device: str) -> int:
    """Move a Keras optimizer's variables (iteration count, learning rate,
    slots) to ``device`` and re-key its index of the model's variables
    (it is keyed by their backing variables, which may have moved); returns
    how many moved.  An unbuilt optimizer makes its slots next to the model
    variables they shadow (``add_variable_from_reference`` colocates them),
    so moving the model's variables first is enough for those."""
    moved = 0
    for current in _optimizer_chain(optimizer):
        moved += place_variables(current.variables, device)
        indices = getattr(current, "_trainable_variables_indices", None)
        trainable = getattr(current, "_trainable_variables", None)
        if getattr(current, "built", False) and indices is not None and trainable is not None:
            indices.clear()
            key = current._var_key  # pylint: disable=protected-access  # the optimizer's own key
            indices.update({key(v): i for i, v in enumerate(trainable)})
    return moved


def _optimizer_chain(optimizer: Any) -> List[Any]:
    """``optimizer`` and the optimizers it wraps (a ``LossScaleOptimizer``'s ``inner_optimizer``)."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def bytes_of(variables: Iterable[Any]) -> int:
    """The bytes of the values of ``variables``."""
    total = 0
    for variable in variables:
        inner = backing_variable(variable)
        if inner is not None and inner.shape.is_fully_defined():
            total += inner.shape.num_elements() * inner.dtype.size
    return total
