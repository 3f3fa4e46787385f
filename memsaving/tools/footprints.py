"""What one training step of a command's model takes, estimated from shapes.

The commands build or load a model and then run, or profile, its ops at the
sizes given on the command line.  A size the machine cannot hold used to
show up only as memory growing for minutes (``memsaving plan transformer
--size 100000000`` reached 13.6 GB); these estimates let the command refuse
it in one line first, before TensorFlow is imported.

An estimate is the bytes of the weights and their gradients plus, for every
sample of the batch, the bytes of the forward pass's tensors (the input
included).  It is a guide to the order of magnitude, not a prediction of
the peak: :func:`refuse_if_too_big` compares it with :func:`available_memory`.
No TensorFlow here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from memsaving.planners.budget import format_bytes
from memsaving.tools.arguments import UsageError

FLOAT_BYTES = 4
"""float32, the dtype of the built-in models' weights and activations."""

GRAPH_BYTES_PER_LAYER = 2 ** 20
"""Host memory a Keras layer costs the demo besides its tensors: the layer,
its ops in the four functions the demo traces, and their plans.  Measured:
``memsaving demo --width 4 --batch 4`` grew 0.55 MB a layer from depth 200
to 800; rounded up."""


@dataclass(frozen=True)
class Footprint:
    """Bytes one training step of a model takes, by what they scale with.

    Example
    -------
    >>> Footprint(parameter_bytes=1000, activation_bytes=10).step_bytes(batch=8)
    2080
    """

    parameter_bytes: int
    """The weights (their gradients take as much again)."""
    activation_bytes: int
    """The forward pass's tensors, the input included, for one sample."""
    fixed_bytes: int = 0
    """What depends on neither: graph and Python objects of the layers."""

    def step_bytes(self, batch: int) -> int:
        """Weights, their gradients and the activations of ``batch`` samples."""
        return self.fixed_bytes + 2 * self.parameter_bytes + batch * self.activation_bytes

    def __add__(self, other: "Footprint") -> "Footprint":
        return Footprint(self.parameter_bytes + other.parameter_bytes, self.activation_bytes + other.activation_bytes,
                         self.fixed_bytes + other.fixed_bytes)


@dataclass(frozen=True)
class BuiltIn:
    """A built-in model's sizes as quadratics in its ``size`` (image size or
    sequence length), and the sizes it can be built at.

    The coefficients were fitted to the models themselves: parameter counts,
    and the bytes of every tensor of the traced forward pass at batch 1,
    at three sizes each; ``tests/tools/test_footprints.py`` checks them
    against the built models at other sizes.

    Example
    -------
    >>> BUILT_IN["transformer"].footprint(64).parameter_bytes
    4200352
    """

    parameters: Tuple[int, int, int]
    """Weights: ``c0 + c1 * size + c2 * size ** 2`` (an input-sized Dense,
    a table of positions, the Dense after a Flatten)."""
    activation_bytes: Tuple[int, int, int]
    """Forward tensors of one sample, in bytes: ``c0 + c1 * size + c2 * size ** 2``
    (attention scores grow with the square of a sequence, images with the
    square of their side)."""
    smallest_size: int = 1
    """keras.applications models take images of at least 32 x 32."""
    size_multiple: int = 1
    """The U-Net halves its image three times and concatenates it back."""

    def footprint(self, size: int) -> Footprint:
        """The footprint at ``size``."""
        return Footprint(FLOAT_BYTES * _quadratic(self.parameters, size), _quadratic(self.activation_bytes, size))

    def size_problem(self, size: int) -> Optional[str]:
        """Why the model cannot be built at ``size``, or None."""
        if size < self.smallest_size:
            return f"is at least {self.smallest_size}"
        if size % self.size_multiple:
            return f"is a multiple of {self.size_multiple}"
        return None


def _quadratic(coefficients: Sequence[int], x: int) -> int:
    c0, c1, c2 = coefficients
    return c0 + c1 * x + c2 * x * x


BUILT_IN: Dict[str, BuiltIn] = {
    "mlp": BuiltIn((2042378, 256, 0), (98384, 4, 0)),
    "resnet50": BuiltIn((23608202, 0, 0), (1390888, 656, 5488), smallest_size=32),
    "vgg16": BuiltIn((31541066, 0, 2048), (98424, 0, 3374), smallest_size=32),
    "mobilenet": BuiltIn((2270794, 0, 0), (896184, 1152, 2799), smallest_size=32),
    "unet": BuiltIn((339713, 0, 0), (384, 0, 2088), size_multiple=8),
    "transformer": BuiltIn((1050088, 0, 0), (8532, 109229, 192)),
    "gpt": BuiltIn((19575552, 256, 0), (84, 481473, 300)),
    "resnet50v2": BuiltIn((23585290, 0, 0), (1251624, 4752, 4161), smallest_size=32),
    "efficientnetb0": BuiltIn((4062381, 0, 0), (1307389, 2520, 4085), smallest_size=32),
    "residual_convnet": BuiltIn((90554, 0, 0), (22672, 0, 4684)),
    "two_tower": BuiltIn((1453066, 512, 0), (75856, 4, 0)),
    "attention_encoder": BuiltIn((595072, 0, 0), (12, 85132, 144)),
    "recurrent": BuiltIn((236170, 0, 0), (37408, 4304, 0)),
}
"""The built-in models of ``memsaving.tools.models.BUILDERS``, by name (the
same names: a test checks it), with what they take."""


def dense_stack(depth: int, width: int) -> Footprint:
    """``depth`` ReLU ``Dense(width)`` layers on ``width`` inputs, as the demo builds them.

    Each layer holds its weights and bias, and three tensors of ``width`` a
    sample (the product, the bias added, the ReLU); the Python and graph
    objects of every layer are :data:`GRAPH_BYTES_PER_LAYER`.
    """
    parameters = depth * (width * width + width)
    return Footprint(FLOAT_BYTES * parameters, FLOAT_BYTES * (width + 3 * depth * width),
                     depth * GRAPH_BYTES_PER_LAYER)


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes of memory this process can still take, or None where the system does not say.

    Linux's ``MemAvailable`` (free memory plus the caches it can drop);
    elsewhere, or without /proc, the free (else the physical) pages the C
    library reports.  A container's memory limit, when lower, wins.
    """
    system = _meminfo_available(meminfo) or _pages("SC_AVPHYS_PAGES") or _pages("SC_PHYS_PAGES")
    figures = [f for f in (system, _cgroup_room(cgroup)) if f is not None]
    return min(figures) if figures else None


def _meminfo_available(path: str) -> Optional[int]:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the figure is in KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: str) -> Optional[int]:
    """The memory limit of this process's control group less what it uses (cgroup v2, else v1)."""
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(root, limit)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(root, usage)) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit():  # v2 writes "max" when there is no limit
            return max(int(limit_text) - used, 0)
        return None
    return None


def _pages(name: str) -> Optional[int]:
    try:
        pages, size = os.sysconf(name), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def archive_footprint(path: str, size: Optional[int] = None) -> Optional[Footprint]:
    """A lower bound on a training step of the ``.keras`` archive at ``path``,
    read without loading it: its weights file's bytes, and for every sample
    the bytes of its inputs (their shapes in ``config.json``; an unknown
    non-batch dimension is ``size``, 1 when None).  None for other files or
    an archive whose config does not say.

    Loading a saved model takes TensorFlow and seconds; an absurd batch is
    refused before that from this bound alone."""
    import json
    import zipfile

    if not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
            weights = sum(info.file_size for info in archive.infolist() if info.filename.endswith(".h5"))
    except (KeyError, ValueError, OSError, zipfile.BadZipFile):
        return None
    per_sample = sum(_elements(shape[1:], size) for shape in _input_shapes(config)) * FLOAT_BYTES
    return Footprint(parameter_bytes=weights, activation_bytes=per_sample)


def _input_shapes(config) -> list:
    """The ``batch_shape`` of every InputLayer in a Keras config, however deeply nested."""
    found = []
    if isinstance(config, dict):
        if config.get("class_name") == "InputLayer":
            shape = config.get("config", {}).get("batch_shape") or config.get("config", {}).get("batch_input_shape")
            if isinstance(shape, list):
                found.append(shape)
        for value in config.values():
            found += _input_shapes(value)
    elif isinstance(config, list):
        for value in config:
            found += _input_shapes(value)
    return found


def _elements(dims, size: Optional[int]) -> int:
    count = 1
    for dim in dims:
        count *= int(dim) if isinstance(dim, int) else (size or 1)
    return count


def refuse_if_too_big(footprint: Footprint, batch: int, what: str, advice: str,
                      available: Optional[int] = None) -> None:
    """Raise :class:`UsageError` when ``what`` at ``batch`` needs more than the machine has.

    ``available`` defaults to :func:`available_memory`; when the system does
    not say, nothing is refused.  The message gives both figures, the
    largest batch that would fit (when the weights do), and ``advice``.

    Example
    -------
    >>> refuse_if_too_big(Footprint(0, 2 ** 30), 64, "the demo", "give a smaller --batch", available=2 ** 34)
    Traceback (most recent call last):
    ...
    memsaving.tools.arguments.UsageError: the demo needs about 64.0 GiB ...
    """
    available = available_memory() if available is None else available
    needed = footprint.step_bytes(batch)
    if available is None or needed <= available:
        return
    fitting = (available - footprint.step_bytes(0)) // max(footprint.activation_bytes, 1)
    hint = f" (batch {fitting} would fit)" if 1 <= fitting < batch else ""
    raise UsageError(f"{what} needs about {format_bytes(needed)} (weights, their gradients and the activations "
                     f"of batch {batch}, estimated from the shapes), more than the {format_bytes(available)} this "
                     f"machine has available{hint}: {advice}")
