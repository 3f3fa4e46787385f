"""Where kernel profiles are kept: in memory and in a JSON file shared by processes.

The file outlives the code and the process that wrote it, and anyone may
edit it, so nothing read from it is trusted: an entry is used only when its
figures are finite, non-negative numbers within :class:`ProfileLimits` set by
its op's shapes; any other is ignored (and measured again where measuring is
allowed).  Writers take a lock beside the file, read it again, merge and
replace it atomically, so processes profiling at once keep each other's
entries; temporary files of writers that were killed are removed then.  A
file of a newer :data:`FORMAT` is neither read nor replaced.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import re
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, Optional, Tuple

try:
    import fcntl
except ImportError:  # Windows has none: writers take turns by creating a marker file instead
    fcntl = None

logger = logging.getLogger("memsaving")

FORMAT = 7
"""Version of the measurement procedure and of the cache file (3: function
calls' gradients are measured through their own gradient functions; 4: what
an op keeps for its gradient counts the bytes its extra outputs ask for, not
the chunks they happened to hold; 5: an op given extra outputs for its
gradient records which of its inputs and outputs the gradient still reads;
6: an op's gradient kernels are measured one at a time, as the pinned step
runs them; 7: a loop's gradient is measured a second time checkpointed
inside, :mod:`memsaving.tf.loop_checkpoints`).
Entries of an older version are ignored and the file replaced; a newer
version's file is left alone (this process then keeps its profiles in
memory)."""

KERNEL_BYTES_MULTIPLE = 64
"""How many times the bytes of its inputs and outputs a kernel may hold
(beyond :data:`FIXED_WORK_BYTES`).  Kernels whose work memory grows with their
tensors hold a few copies of them: a convolution's patch matrix holds each
input element once per filter tap (49 times for a 7x7 filter), a gradient
materializes tensors of its op's input or output shapes (a broadcast's, a
reduction's) before reducing them.  64 is the power of two above 49.  An op
that truly holds more (a batched matmul's gradient for an operand broadcast
over a large batch) is only measured again whenever the file is read, where
a damaged figure taken on trust would make a wrong plan."""

FIXED_WORK_BYTES = {"CPU": 512 << 20, "GPU": 4 << 30}
"""Work buffers whose size does not follow the tensors, by device kind.  On
CPUs Eigen's convolution takes ~32 MiB whatever the tensor sizes (README,
"How profiles work"): 512 MiB leaves 16 times that.  On GPUs cuDNN may pick
an algorithm with up to 4 GiB of workspace, TensorFlow's default limit
(``TF_CUDNN_WORKSPACE_LIMIT_IN_MB``)."""

MAX_SECONDS = 3600.0
"""The longest run time an op's profile may state.  Profiling runs each op
at least three times forward and three times backward, so an op this slow
would have kept profiling busy for hours: a larger figure is damage."""

STALE_TEMP_SECONDS = 600
"""A writer's temporary file this old is abandoned (a write takes
milliseconds); so is one whose writer on this host has exited."""

LOCK_WAIT_SECONDS = 30.0
STALE_MARKER_SECONDS = 10.0
"""Where ``fcntl`` is missing: how long a writer waits for the marker file
that says another one is writing, and the age at which a marker is taken to
be left by a killed writer."""


# ------------------------------------------------------------------------------------------ values


@dataclass(frozen=True)
class OpProfile:
    """What one op signature needs beyond its tensors, measured on a device.

    Attributes
    ----------
    temp_bytes : int
        bytes the forward kernel holds while it runs beyond its
        inputs and outputs.
    grad_temp_bytes : int
        bytes the op's gradient holds while it runs beyond
        what the simulator counts there: the gradient's inputs (upstream
        gradients, forward tensors it reads) and its results.
    saved_bytes : int
        bytes the forward op keeps for its gradient that are no
        output of the forward graph (a loop's accumulated intermediates,
        which building the gradient adds to the op).
    output_bytes : tuple of int
        bytes held by each output after the forward kernel ran;
        the only way to size variant outputs (TensorLists).
    seconds, grad_seconds : float or None
        median run times of the forward op and of its
        gradient (call overhead removed); None when not measured.
    ok : bool
        False when the op could not run alone; kept so that it is not
        tried again.
    grad_reads : tuple of two tuples of int, or None
        positions of the op's inputs and of its outputs that its gradient
        reads, recorded when building the gradient gave the op extra
        outputs (a function call: the intermediates its gradient needs,
        ``saved_bytes``); None otherwise, and the graph model's rules say
        what the gradient reads.  A call compiled with XLA hands its
        gradient new buffers, not its arguments: a grouped convolution's
        gradient reads neither its input nor its output.
    """

    temp_bytes: int = 0
    grad_temp_bytes: int = 0
    saved_bytes: int = 0
    output_bytes: Tuple[int, ...] = ()
    seconds: Optional[float] = None
    grad_seconds: Optional[float] = None
    ok: bool = True
    grad_reads: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    checkpointed_grad_temp_bytes: Optional[int] = None
    """For a loop whose gradient can keep one state every k iterations
    (:mod:`memsaving.tf.loop_checkpoints`): that gradient's temporaries, the
    stored states and the chunk run again included (the forward loop then
    saves nothing); None for other ops."""
    checkpointed_grad_seconds: Optional[float] = None
    """That gradient's run time (None when not measured)."""

    def to_json(self) -> dict:
        data = asdict(self)
        data["output_bytes"] = list(self.output_bytes)
        data["grad_reads"] = None if self.grad_reads is None else [list(p) for p in self.grad_reads]
        return data

    @classmethod
    def from_json(cls, data: object) -> "OpProfile":
        """The profile ``data`` (an entry of the cache file) describes.

        Raises
        ------
        ValueError
            when ``data`` is no object, or a figure in it is not a finite,
            non-negative number (bytes: a whole one), or ``ok`` not a
            boolean: a damaged or hand-edited file.

        Examples
        --------
        >>> OpProfile.from_json({"temp_bytes": 1024, "seconds": 0.5}).temp_bytes
        1024
        """
        if not isinstance(data, dict):
            raise ValueError(f"the entry is a {type(data).__name__}, not an object")
        outputs = data.get("output_bytes", [])
        if not isinstance(outputs, list):
            raise ValueError(f"output_bytes is {outputs!r}, not a list")
        ok = data.get("ok", True)
        if not isinstance(ok, bool):
            raise ValueError(f"ok is {ok!r}, not true or false")
        return cls(_byte_count(data.get("temp_bytes", 0), "temp_bytes"),
                   _byte_count(data.get("grad_temp_bytes", 0), "grad_temp_bytes"),
                   _byte_count(data.get("saved_bytes", 0), "saved_bytes"),
                   tuple(_byte_count(b, "output_bytes") for b in outputs),
                   _optional_seconds(data.get("seconds"), "seconds"),
                   _optional_seconds(data.get("grad_seconds"), "grad_seconds"), ok,
                   _grad_reads(data.get("grad_reads")),
                   None if data.get("checkpointed_grad_temp_bytes") is None else
                   _byte_count(data["checkpointed_grad_temp_bytes"], "checkpointed_grad_temp_bytes"),
                   _optional_seconds(data.get("checkpointed_grad_seconds"), "checkpointed_grad_seconds"))


def _grad_reads(value: object) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """An entry's ``grad_reads``: None, or two lists of positions."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(p, list) for p in value) or \
            not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for p in value for k in p):
        raise ValueError(f"grad_reads is {value!r}, not two lists of positions")
    return tuple(value[0]), tuple(value[1])


def _figure(value: object, name: str) -> float:
    """``value`` when it is a finite, non-negative number (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is {value!r}, not a number")
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        raise ValueError(f"{name} is {value!r}, not a finite non-negative number")
    return value


def _byte_count(value: object, name: str) -> int:
    figure = _figure(value, name)
    if figure != int(figure):
        raise ValueError(f"{name} is {value!r}, not a whole number of bytes")
    return int(figure)


def _optional_seconds(value: object, name: str) -> Optional[float]:
    return None if value is None else float(_figure(value, name))


def machine_bytes() -> int:
    """The host's physical memory: no profile measured on it holds more.

    A GPU with more memory than its host would see its largest profiles
    rejected, which only costs measuring them again.

    Examples
    --------
    >>> machine_bytes() > 0
    True
    """
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): a bound no host reaches
        return 1 << 50


@dataclass(frozen=True)
class ProfileLimits:
    """The largest figures a plausible profile of one op states.

    Attributes
    ----------
    max_bytes : int
        the most any of its byte counts (temporaries, saved bytes, each
        output) may be.
    max_seconds : float
        the longest either run time may be.
    """

    max_bytes: int
    max_seconds: float = MAX_SECONDS

    @classmethod
    def for_op(cls, io_bytes: Optional[int], device: str) -> "ProfileLimits":
        """The limits of an op whose inputs and outputs hold ``io_bytes``.

        Parameters
        ----------
        io_bytes : int or None
            bytes of the op's inputs and outputs (variables' values for
            their handles); None where shapes do not bound what the op
            holds: loops and function calls (their memory grows with the
            iterations and calls they run) and ops with tensors a static
            shape cannot size (TensorLists, unknown ranks).  Such ops are
            bounded by the machine's memory only.
        device : str
            the device profiled (``"CPU:0"``, ``"GPU:0"``), whose kind sets
            the fixed allowance for work buffers.

        Examples
        --------
        >>> limits = ProfileLimits.for_op(4096, "CPU:0")
        >>> limits.max_bytes == min(64 * 4096 + (512 << 20), machine_bytes())
        True
        """
        machine = machine_bytes()
        if io_bytes is None:
            return cls(machine)
        kind = "GPU" if device.upper().startswith("GPU") else "CPU"
        return cls(min(machine, KERNEL_BYTES_MULTIPLE * io_bytes + FIXED_WORK_BYTES[kind]))

    def violation(self, profile: OpProfile) -> Optional[str]:
        """Why ``profile`` cannot be right for this op, or None when it may be."""
        byte_counts = [("temp_bytes", profile.temp_bytes), ("grad_temp_bytes", profile.grad_temp_bytes),
                       ("saved_bytes", profile.saved_bytes),
                       ("checkpointed_grad_temp_bytes", profile.checkpointed_grad_temp_bytes or 0)]
        byte_counts += [(f"output_bytes[{k}]", b) for k, b in enumerate(profile.output_bytes)]
        for name, value in byte_counts:
            if value > self.max_bytes:
                return f"{name} is {value}, above the {self.max_bytes} bytes this op's shapes allow"
        for name, seconds in (("seconds", profile.seconds), ("grad_seconds", profile.grad_seconds),
                              ("checkpointed_grad_seconds", profile.checkpointed_grad_seconds)):
            if seconds is not None and seconds > self.max_seconds:
                return f"{name} is {seconds}, above {self.max_seconds:.0f} s"
        return None


# ------------------------------------------------------------------------------------------ the file


def cache_path() -> str:
    """The JSON file holding profiles: ``$MEMSAVING_CACHE_DIR/profiles.json``,
    by default under ``~/.cache/memsaving``.

    Examples
    --------
    >>> os.path.basename(cache_path())
    'profiles.json'
    """
    folder = os.environ.get("MEMSAVING_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "memsaving")
    return os.path.join(folder, "profiles.json")


@dataclass
class _Stored:
    """What a cache file holds: its entries as read (checked only when
    looked up), and its format when that is newer than :data:`FORMAT`."""

    entries: Dict[str, object]
    newer_format: Optional[int] = None


def _read_file(path: str) -> _Stored:
    """The entries stored at ``path``; none when the file is missing,
    unreadable, corrupt or of another format (it is replaced on save,
    unless its format is newer)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return _Stored({})
    except (OSError, ValueError, RecursionError) as err:
        logger.warning("memsaving: ignoring the unreadable profile cache %s (%s)", path, err)
        return _Stored({})
    version = data.get("format") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT:
        return _Stored({}, newer_format=version)
    if version != FORMAT or not isinstance(data.get("profiles"), dict):
        return _Stored({})
    return _Stored({str(k): v for k, v in data["profiles"].items()})


def _save(path: str, new: Dict[str, OpProfile]) -> _Stored:
    """Merge ``new`` into the file at ``path``, one writer at a time: the
    file is read again under the lock, so entries other processes saved
    since this one read it are kept.  Returns what the file held; a file of
    a newer format is left as it was."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with _writers_lock(path):
        _remove_abandoned_temporaries(folder)
        stored = _read_file(path)
        if stored.newer_format is None:
            _write_file(path, {**stored.entries, **{k: v.to_json() for k, v in new.items()}})
    return stored


def _write_file(path: str, entries: Dict[str, object]) -> None:
    """Write ``entries`` atomically: a temporary file in the same folder,
    named after this process (so an abandoned one can be told), replaces
    the old one, so readers never see half a file."""
    data = {"format": FORMAT, "profiles": dict(sorted(entries.items()))}
    fd, tmp = tempfile.mkstemp(prefix=f".profiles-{os.getpid()}@{_host()}.", suffix=".json",
                               dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _host() -> str:
    """This host's name as it goes in a temporary file's name."""
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"


_TEMPORARY_WRITER = re.compile(r"\.profiles-(\d+)@([A-Za-z0-9_-]+)\.")


def _remove_abandoned_temporaries(folder: str) -> None:
    """Delete the temporary files of writers that died mid-write.  Writers
    write under the lock this runs under, so a temporary file seen here
    belongs to no write in progress unless its writer skips the lock (an
    older memsaving); its age or its writer's exit says it is abandoned."""
    now = time.time()
    for tmp in glob.glob(os.path.join(glob.escape(folder), ".profiles-*.json")):
        writer = _TEMPORARY_WRITER.match(os.path.basename(tmp))
        try:
            exited = writer is not None and writer.group(2) == _host() and not _running(int(writer.group(1)))
            if exited or now - os.path.getmtime(tmp) > STALE_TEMP_SECONDS:
                os.unlink(tmp)
                logger.debug("memsaving profiles: removed the abandoned temporary file %s", tmp)
        except OSError:  # removed meanwhile, or not ours to remove
            continue


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (assumed so where that cannot be
    asked without harm: on Windows, os.kill ends the process)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, as another user's
        return True
    return True


@contextlib.contextmanager
def _writers_lock(path: str) -> Iterator[None]:
    """Hold the lock of the cache file ``path``: an exclusive ``flock`` on
    ``<path>.lock``, which the system releases when its holder dies."""
    if fcntl is None:
        with _marker_lock(path + ".lock-held"):
            yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _marker_lock(marker: str) -> Iterator[None]:
    """Where ``fcntl`` is missing: the writer that creates ``marker`` holds
    the lock until it deletes it; a marker older than
    :data:`STALE_MARKER_SECONDS` was left by a killed writer."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(marker) > STALE_MARKER_SECONDS:
                    os.unlink(marker)
            if time.monotonic() > deadline:
                raise OSError(f"{marker} was held for {LOCK_WAIT_SECONDS:.0f} s; "
                              "delete it if no memsaving process is saving profiles") from None
            time.sleep(0.005)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)


# ------------------------------------------------------------------------------------------ the cache


class ProfileCache:
    """Profiles by ``device key|signature``: in memory, backed by a file
    read once and merged into on every save (other processes may add to it).

    Entries measured by this process are trusted; entries read from the
    file are checked against their op's :class:`ProfileLimits` when looked
    up.

    Examples
    --------
    >>> profile, rejected = ProfileCache().get("tf2.21|CPU-x86_64-2-onednn|threads1-0|MatMul:0f3a",
    ...                                        ProfileLimits.for_op(4096, "CPU:0"))
    >>> profile is None and rejected is None  # never measured
    True
    """

    def __init__(self):
        self.entries: Dict[str, OpProfile] = {}  # measured here, or read and found plausible
        self._stored: Dict[str, object] = {}  # the file's entries, not yet checked
        self._loaded: Optional[str] = None
        self._warned_newer: Optional[str] = None
        self._lock = threading.Lock()

    def _load(self) -> None:
        path = cache_path()
        if self._loaded != path:  # first use, or $MEMSAVING_CACHE_DIR changed: that file's profiles
            self._loaded = path
            self.entries = {}
            stored = _read_file(path)
            self._stored = stored.entries
            self._warn_if_newer(path, stored)

    def get(self, key: str, limits: ProfileLimits) -> Tuple[Optional[OpProfile], Optional[str]]:
        """``(profile, None)`` when ``key`` holds a plausible profile,
        ``(None, why)`` when the file's entry for it was rejected, and
        ``(None, None)`` when there is none."""
        with self._lock:
            self._load()
            if key in self.entries:
                return self.entries[key], None
            if key not in self._stored:
                return None, None
            try:
                profile = OpProfile.from_json(self._stored[key])
            except ValueError as err:
                return None, str(err)
            why = limits.violation(profile)
            if why is not None:
                return None, why
            self.entries[key] = profile
            return profile, None

    def put(self, new: Dict[str, OpProfile]) -> None:
        """Add ``new`` and save (a failed save only loses the disk copy)."""
        if not new:
            return
        with self._lock:
            self._load()
            self.entries.update(new)
            path = cache_path()
            try:
                self._warn_if_newer(path, _save(path, new))
            except OSError as err:
                logger.warning("memsaving: could not save kernel profiles to %s (%s)", path, err)

    def _warn_if_newer(self, path: str, stored: _Stored) -> None:
        if stored.newer_format is None or self._warned_newer == path:
            return
        self._warned_newer = path
        logger.warning("memsaving: leaving the profile cache %s alone: a newer memsaving wrote it (format %d, "
                       "this one has format %d); profiles measured now are kept in memory only (set "
                       "MEMSAVING_CACHE_DIR to another folder to keep them)", path, stored.newer_format, FORMAT)

    def clear(self) -> None:
        """Forget the in-memory copy (the file is read again when needed)."""
        with self._lock:
            self.entries = {}
            self._stored = {}
            self._loaded = None
