"""Checking the command line's arguments before any work, without TensorFlow.

A wrong argument used to surface only after TensorFlow was imported and the
model loaded (seconds), as a traceback from deep inside planning or
plotting.  Everything that can be told from the arguments alone is checked
here, in about a second, and reported in one line: the number
types, the budget (with the parser ``budget=`` uses), the plot's path and
format, and whether a model file is a readable Keras file at all.

Exit status: 2 for an argument that cannot work (:class:`UsageError`, as
argparse does), 1 for work that failed (a file that exists but is no model,
a budget nothing fits in).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import zipfile
import zlib
from typing import Iterator, NoReturn, Optional

from memsaving.planners.budget import parse_bytes

USAGE_STATUS = 2
"""Exit status of a wrong argument (argparse's own)."""

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""The first eight bytes of an HDF5 file (``.h5``), at offset 0 or 512, 1024, 2048, ..."""


class UsageError(Exception):
    """A command-line argument the command cannot work with; the command
    says so in one line and exits with :data:`USAGE_STATUS`."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (argparse
    prints the whole usage first), pointing to ``--help``.

    Example
    -------
    >>> parser = OneLineParser(prog="memsaving")
    >>> _ = parser.add_argument("--batch", type=positive_int)
    >>> parser.parse_args(["--batch", "0"])  # prints "memsaving: error: argument --batch: ..." and exits 2
    Traceback (most recent call last):
    SystemExit: 2
    """

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_STATUS, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a batch, a size, a depth).

    Example
    -------
    >>> positive_int("8")
    8
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give one of at least 1, e.g. 8") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1: give a whole number of at least 1, e.g. 8")
    return value


def memory_size(text: str) -> int:
    """An argparse type: a memory budget in bytes, read as ``budget=`` reads it.

    Example
    -------
    >>> memory_size("2GiB")
    2147483648
    """
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_plot_path(path: str) -> None:
    """Raise :class:`UsageError` unless an image can be saved at ``path``.

    Checked before planning, which takes seconds to minutes: matplotlib is
    installed, it writes the format the name ends with, and the folder
    exists and is writable.

    Example
    -------
    >>> check_plot_path("timeline.png")  # in a writable folder: nothing to say
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed: pip install matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    extension = os.path.splitext(path)[1][1:].lower()
    supported = FigureCanvasAgg.get_supported_filetypes()
    if extension and extension not in supported:
        raise UsageError(f"--plot {path}: matplotlib cannot write .{extension} files: end the name with one of "
                         f"{', '.join('.' + e for e in sorted(supported))}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        state = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise UsageError(f"--plot {path}: {folder} {state}: give a path in an existing folder")
    if os.path.isdir(path):
        raise UsageError(f"--plot {path}: is a folder: give a file name such as {os.path.join(path, 'plan.png')}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"--plot {path}: not writable here: give a path in a folder you can write to")


def unreadable_model_reason(path: str) -> Optional[str]:
    """Why the existing file or folder ``path`` cannot be a Keras model, or
    None when it may be one.

    Keras 3 loads ``.keras`` zip archives (or their unzipped folder, which
    holds ``config.json``) and HDF5 ``.h5`` files.  A truncated archive, a
    corrupt member or a text file renamed ``.keras`` is told here from its
    bytes (Keras itself answers "File not found" for the first and last).

    Example
    -------
    >>> unreadable_model_reason("README.md")
    "its type '.md' is not a saved Keras model: give a .keras or .h5 file"
    """
    if os.path.isdir(path):
        return None if os.path.isfile(os.path.join(path, "config.json")) else (
            "a folder without config.json: give a .keras or .h5 file (a TensorFlow SavedModel folder is not a "
            "Keras model Keras 3 can load)")
    if not os.access(path, os.R_OK):
        return "permission denied: make the file readable"
    extension = os.path.splitext(path)[1].lower()
    if extension == ".keras":
        return _keras_archive_problem(path)
    if extension in (".h5", ".hdf5"):
        return None if _has_hdf5_signature(path) else "no HDF5 signature: not an .h5 file, or a damaged one"
    return f"its type {extension or '(none)'!r} is not a saved Keras model: give a .keras or .h5 file"


def _keras_archive_problem(path: str) -> Optional[str]:
    """What is wrong with the zip archive a ``.keras`` file is, or None."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f"not a zip archive as .keras files are (truncated, or another file renamed?): {error}"
    with archive:
        if "config.json" not in archive.namelist():
            return "a zip archive without config.json, not a saved Keras model"
        try:
            damaged = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as error:
            return f"the archive is damaged ({error}): save the model again"
    if damaged is not None:
        return f"the archive's member {damaged} is damaged (its checksum does not match): save the model again"
    return None


def _has_hdf5_signature(path: str) -> bool:
    """Whether the HDF5 signature starts the file or a user block of 512, 1024, ... bytes."""
    size = os.path.getsize(path)
    with open(path, "rb") as data:
        offset = 0
        while offset + len(HDF5_SIGNATURE) <= size:
            data.seek(offset)
            if data.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return True
            offset = 512 if offset == 0 else 2 * offset
    return False


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to the null device for the block.

    TensorFlow's native libraries print to it when they load and run their
    first op ("All log messages before absl::InitializeLog() ...", oneDNN's
    notice) whatever ``TF_CPP_MIN_LOG_LEVEL`` says: a command's one-line
    answer would come with lines of noise.  Python's own errors still
    reach the user: they are raised after the descriptor is back."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="utf-8") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def import_tensorflow_quietly() -> None:
    """Import TensorFlow and Keras, and run one op, with their native start-up
    lines silenced (:func:`native_stderr_silenced`), unless the user asked
    for TensorFlow's logs (``TF_CPP_MIN_LOG_LEVEL`` below 2) or it is loaded."""
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") < "2":
        return
    with native_stderr_silenced():
        import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        tf.constant(0) + 0  # pylint: disable=expression-not-assigned
