"""What a ``tf.GradientTape`` recorded while a ``tf.function`` was traced.

A tape differentiates only the ops it recorded: those created while it was
recording (between entering it and leaving it, less the blocks of
``tape.stop_recording()``).  ``tf.gradients`` differentiates every op
between its ``xs`` and ``ys``.  To compute a tape's gradients with
``tf.gradients``' machinery (as :func:`memsaving.function` does), the ops
the tape did not record must stop the gradient: their outputs become
``stop_gradients``.

In a traced function a graph's operations are kept in creation order, so a
recording window is two positions in ``graph.get_operations()``; a
:class:`TapeRecord` keeps the windows of one tape and the tensors it was
told to ``watch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Set, Tuple

import tensorflow as tf


@dataclass
class TapeRecord:
    """The recording windows of one tape in one graph, and what it watched.

    Examples
    --------
    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with graph.as_default():
    ...     a = tf.constant(1.0, name="a")
    ...     record = TapeRecord(graph)
    ...     record.start()
    ...     b = tf.multiply(a, 2.0, name="b")
    ...     record.stop()
    ...     c = tf.add(b, 1.0, name="c")
    >>> sorted(record.recorded_op_names())
    ['b', 'b/y']
    """

    graph: Any
    windows: List[Tuple[int, Optional[int]]] = field(default_factory=list)
    watched: List[Any] = field(default_factory=list)

    def start(self) -> None:
        """The tape starts (or resumes) recording."""
        self.windows.append((len(self.graph.get_operations()), None))

    def stop(self) -> None:
        """The tape stops recording (left, or ``stop_recording`` entered)."""
        if self.windows and self.windows[-1][1] is None:
            self.windows[-1] = (self.windows[-1][0], len(self.graph.get_operations()))

    @property
    def recording(self) -> bool:
        """The tape is recording now (its last window is open)."""
        return bool(self.windows) and self.windows[-1][1] is None

    def watch(self, tensors: Iterable[Any]) -> None:
        """Tensors the tape was told to watch (variables are read from the tape itself)."""
        self.watched.extend(tensors)

    def is_watched(self, tensor: Any) -> bool:
        """``tensor`` was passed to ``tape.watch``."""
        return any(tensor is w for w in self.watched)

    def recorded_op_names(self) -> Set[str]:
        """Names of the ops created while the tape recorded (an open window ends now)."""
        operations = self.graph.get_operations()
        names: Set[str] = set()
        for begin, end in self.windows:
            names.update(op.name for op in operations[begin:len(operations) if end is None else end])
        return names


def unrecorded_boundary(targets: List[tf.Tensor], sources: List[tf.Tensor], recorded: Set[str]) -> List[tf.Tensor]:
    """Tensors made by ops the tape did not record that recorded ops (or the
    targets) read: as ``stop_gradients`` they make ``tf.gradients`` see what
    the tape saw.

    Walks back from ``targets`` through recorded ops only.  Sources are never
    stopped, nor tensors of ops without inputs (stopping them changes
    nothing).

    Examples
    --------
    >>> import tensorflow as tf
    >>> graph = tf.Graph()
    >>> with graph.as_default():
    ...     w = tf.compat.v1.placeholder(tf.float32, name="w")
    ...     before = tf.square(w, name="before")
    ...     inside = tf.multiply(before, w, name="inside")
    >>> [t.name for t in unrecorded_boundary([inside], [w], {"inside"})]
    ['before:0']
    """
    source_ids = {id(s) for s in sources}
    stops: List[tf.Tensor] = []
    stopped: Set[int] = set()
    seen: Set[str] = set()
    pending = [t.op for t in targets if t.op.name in recorded]
    stops.extend(t for t in targets if t.op.name not in recorded and _worth_stopping(t, source_ids))
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        for tensor in op.inputs:
            if tensor.op.name in recorded:
                pending.append(tensor.op)
            elif id(tensor) not in stopped and _worth_stopping(tensor, source_ids):
                stopped.add(id(tensor))
                stops.append(tensor)
    return stops


def _worth_stopping(tensor: tf.Tensor, source_ids: Set[int]) -> bool:
    """A tensor whose producer has inputs and that is no source."""
    return id(tensor) not in source_ids and len(tensor.op.inputs) > 0
