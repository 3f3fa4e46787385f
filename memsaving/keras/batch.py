"""The batch size a Keras train step will get, found from the data.

One job: size the plan for the batch the step really gets.  Under ``fit``,
Keras usually traces the train step with an unknown (None) batch dimension
(a dataset's spec, or arrays whose last batch is partial), so the planner
cannot read the batch from the graph, and sizing it as 1 would make a
budget plan that runs out of memory at the real batch.  The wrapped ``fit``
and ``train_on_batch`` (:mod:`memsaving.keras.enabling`) look at their
arguments with :func:`data_batch_size` and :func:`num_rows` and record the
batch on the model (:func:`note_data_batch`); the train step
(:mod:`memsaving.keras.train_step`) asks :func:`plan_batch` at trace time
which size to plan for, and where it came from.

Kept apart from the rest because it reads only the data (arrays, tf.data
pipelines, generators, PyDatasets) and the settings on the model, never
the plan or the measurements.
"""

from __future__ import annotations

import logging
import math
import types
import warnings
from typing import Any, Dict, Optional, Tuple

import keras
import tensorflow as tf

from memsaving.keras.settings import SETTINGS_ATTRIBUTE

logger = logging.getLogger("memsaving")


def _first_leaf(data: Any) -> Any:
    """The first array-like leaf (something with a non-empty shape) of ``data``."""
    for leaf in keras.tree.flatten(data):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return leaf
    return None


def _leading_dim(data: Any) -> Optional[int]:
    """The first dimension of ``data``'s first array, None when unknown."""
    leaf = _first_leaf(data)
    if leaf is None:
        return None
    dim = leaf.shape[0]
    return None if dim is None else int(dim)


def _static_batch(x) -> Optional[int]:
    first = next((t for t in tf.nest.flatten(x) if t is not None and hasattr(t, "shape")), None)
    if first is None or not len(first.shape):
        return None
    return first.shape[0]


def num_rows(x: Any) -> Optional[int]:
    """Samples in array-like training data (numpy/tensors, nested, or a list of strings)."""
    rows = _leading_dim(x)
    if rows is not None:
        return rows
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (str, bytes, int, float)) for v in x):
        return len(x)  # e.g. raw text for a keras_hub task
    return None


_UNCHANGED_BATCH = ("_MapDataset", "_ParallelMapDataset")
"""tf.data transformations, besides the structure-preserving ones, that keep
the batch of their input (a map sees whole batches after ``batch``)."""


def _dataset_batch_from_structure(dataset: tf.data.Dataset) -> Optional[int]:
    """The ``batch_size`` of the last ``batch``/``padded_batch`` in ``dataset``'s pipeline.

    tf.data has no public accessor for it, so this walks the pipeline
    through the private ``_input_dataset`` / ``_batch_size`` attributes
    (stable since TF 2.0), but only through transformations that keep the
    batch (prefetch, shuffle, repeat, cache, take, map, ...): anything else
    (unbatch, rebatch, flat_map, group_by_window, zip, sources) gives None.
    Reading the first element instead would advance a shuffle's seed and
    change the order of training data compared with plain Keras.

    Raises AttributeError / TypeError when TensorFlow's internals differ.
    """
    node = dataset
    for _ in range(1000):
        size = getattr(node, "_batch_size", None)
        if size is not None and type(node).__name__.endswith("BatchDataset"):
            value = tf.get_static_value(size)
            return None if value is None else int(value)
        bases = {c.__name__ for c in type(node).__mro__}
        if "UnaryUnchangedStructureDataset" not in bases and type(node).__name__ not in _UNCHANGED_BATCH:
            return None
        node = node._input_dataset  # pylint: disable=protected-access
    return None


def _dataset_batch(dataset: tf.data.Dataset) -> Tuple[Optional[int], str]:
    """The batch of a tf.data dataset: static shape, pipeline, or first element."""
    spec = _first_leaf(dataset.element_spec)
    if spec is not None and spec.shape[0] is not None:
        return int(spec.shape[0]), "dataset element_spec"
    try:
        size = _dataset_batch_from_structure(dataset)
    except (AttributeError, TypeError, ValueError) as error:
        logger.warning("memsaving.keras: could not read the batch size from the tf.data pipeline (%s); "
                       "reading its first batch instead. Pass enable(batch_size=N) to skip this.", error)
        size = None
    if size is not None:
        return size, "dataset batch()"
    logger.info("memsaving.keras: the dataset's batch size is not in its element_spec; reading its first "
                "batch to find it (this advances an unseeded shuffle; pass enable(batch_size=N) to skip it)")
    for element in dataset.take(1):
        return _leading_dim(element), "dataset's first batch"
    return None, "empty dataset"


def _replay(first: Any, rest) -> Any:
    """A generator yielding ``first`` then the rest of ``rest`` (so peeking loses nothing)."""
    yield first
    yield from rest


def data_batch_size(
    x: Any,
    y: Any = None,
    batch_size: Optional[int] = None,
    steps_per_epoch: Optional[int] = None,
    validation_split: float = 0.0,
) -> Tuple[Optional[int], str, Any]:
    """The batch ``fit(x, y, batch_size=...)`` will feed the train step.

    Keras traces its step with an unknown batch dimension, so memsaving has
    to know from the data how large a batch is: numpy arrays / tensors are
    cut into ``batch_size`` rows (Keras' default 32, or
    ``ceil(n / steps_per_epoch)``), never more than the training rows; a
    tf.data dataset gives its batch in its element_spec or its ``batch()``
    (else its first element is read); a generator or PyDataset, its first
    batch (the generator is re-wrapped so nothing is lost).

    Returns ``(batch, source, x)``: the batch (None when not found), a short
    description of where it came from, and ``x`` to pass on (a generator is
    replaced by one that replays the peeked batch).
    """
    if isinstance(x, tf.data.Dataset):
        batch, source = _dataset_batch(x)
        return batch, source, x
    if isinstance(x, keras.utils.PyDataset):
        return _leading_dim(x[0]), "PyDataset's first batch", x
    if isinstance(x, types.GeneratorType):
        try:
            first = next(x)
        except StopIteration:
            return None, "empty generator", (item for item in ())  # Keras reports the empty generator
        return _leading_dim(first), "generator's first batch", _replay(first, x)
    rows = num_rows(x)
    if rows is None and y is not None:
        rows = num_rows(y)
    if rows is not None and validation_split:
        rows = int(math.floor(rows * (1.0 - validation_split)))
    if batch_size:
        source = f"fit(batch_size={batch_size})"
    elif steps_per_epoch and rows:
        batch_size, source = int(math.ceil(rows / steps_per_epoch)), f"{rows} rows / steps_per_epoch"
    elif rows is not None:
        batch_size, source = 32, "fit's default batch_size 32"
    else:
        size = getattr(x, "batch_size", None)  # torch DataLoader, a custom keras DataAdapter
        if isinstance(size, int) and size > 0:
            return size, f"{type(x).__name__}.batch_size", x
        return None, "unknown", x
    if rows is not None and rows < batch_size:
        return rows, f"{rows} training rows ({source})", x
    return batch_size, source, x


def _per_replica(model: keras.Model, batch: Optional[int]) -> Optional[int]:
    """The batch one replica's step sees (Keras splits a global batch across replicas)."""
    replicas = getattr(getattr(model, "distribute_strategy", None), "num_replicas_in_sync", 1) or 1
    return None if batch is None else int(math.ceil(batch / replicas))


def note_data_batch(model: keras.Model, batch: Optional[int], source: str, exact: bool) -> None:
    """Record the batch the next trace of an unknown-batch step is sized for.

    When a step was already traced with an unknown batch for another size,
    ``train_function`` is dropped so Keras traces (and memsaving plans)
    again: for ``fit`` (``exact``) whenever the size differs, for
    ``train_on_batch`` only when the new batch is larger (a plan for a larger
    batch is safe for smaller ones, and alternating sizes would otherwise
    retrace each call); an unknown-batch trace there is sized for the largest
    batch seen.
    """
    settings = model.__dict__[SETTINGS_ATTRIBUTE]
    if settings["batch_size"] is not None:
        return  # the user's batch_size wins
    batch = _per_replica(model, batch)
    previous = settings.get("data_batch")
    if not exact and previous is not None and (batch is None or previous[0] > batch):
        batch, source = previous
    settings["data_batch"] = None if batch is None else (batch, source)
    traced = settings.get("unknown_trace")
    if traced is None or batch is None:
        return
    traced_batch, traced_function = traced
    if traced_function is not model.train_function:
        settings["unknown_trace"] = None  # Keras rebuilt the function since
    elif batch > traced_batch or (exact and batch != traced_batch):
        logger.info("memsaving.keras: replanning %s for batch %d (planned for %d)", model.name, batch, traced_batch)
        settings["unknown_trace"] = None
        model.train_function = None


def plan_batch(model: keras.Model, x: Any, settings: Dict[str, Any]) -> Tuple[int, int, str]:
    """``(size for unknown dims, batch the plan is for, where it came from)`` at trace time."""
    static = _static_batch(x)
    _warn_unknown_dims(model, x, settings)
    explicit = settings["batch_size"]
    if static is not None:
        return explicit or static, static, "traced input shape"
    if explicit is not None:
        return explicit, explicit, f"enable(batch_size={explicit})"
    found = settings.get("data_batch")
    if found is not None:
        settings["unknown_trace"] = (found[0], model.train_function)
        return found[0], found[0], found[1]
    warnings.warn(
        f"memsaving.keras: the batch dimension of {model.name}'s train step is unknown and the batch was not "
        "found from fit / train_on_batch, so the plan is sized for a batch of 1 and can run out of memory at "
        "larger batches: pass memsaving.keras.enable(model, batch_size=N).", stacklevel=3)
    return 1, 1, "unknown (sized as 1)"


def _warn_unknown_dims(model: keras.Model, x: Any, settings: Dict[str, Any]) -> None:
    """Warn once per model when an input has an unknown dimension besides the batch.

    The planner gives every unknown dimension the same size (the batch
    size), so a variable sequence length is sized as the batch and the
    predicted peak can be far off.
    """
    if settings.get("warned_dims"):
        return
    for t in tf.nest.flatten(x):
        shape = getattr(t, "shape", None)
        if not isinstance(shape, tf.TensorShape):
            continue
        if shape.rank is not None and None not in shape.as_list()[1:]:
            continue
        settings["warned_dims"] = True
        warnings.warn(
            f"memsaving.keras: {model.name}'s input {getattr(t, 'name', '')!r} has shape {shape}: unknown "
            "dimensions besides the batch (e.g. a variable sequence length) are sized as the batch size "
            "when planning, so the predicted peak can be far off. Give the inputs fixed shapes "
            "(keras.Input(shape=(length, ...)), batches padded to a fixed length), or pass "
            "memsaving.keras.enable(model, batch_size=N) to choose the size used for every unknown "
            "dimension.", stacklevel=4)
        return
