"""Bad command-line arguments: one line on stderr, the right exit status,
no traceback, in seconds, without the process growing.

Each case runs the command in a fresh process, through a small runner
that reports the command's exit status, wall time and peak resident memory
(``getrusage(RUSAGE_CHILDREN)`` once it has exited).  The runner kills the
command past :data:`KILL_BYTES` or :data:`KILL_SECONDS`, so a command that
would eat the machine fails its test instead.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import List

import keras
import pytest

GIB = 2 ** 30
PEAK_LIMIT = 2 * GIB
"""No command may grow past this before it refuses."""
KILL_BYTES = int(2.5 * GIB)
KILL_SECONDS = 40
ANSWER_SECONDS = 5
"""What can be told without TensorFlow is answered within this."""

RUNNER = r"""
import json, os, resource, subprocess, sys, time

def resident(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0  # no /proc: getrusage below still measures the peak

kill_bytes, kill_seconds, stderr_path = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
start = time.perf_counter()
with open(stderr_path, "w") as err:
    child = subprocess.Popen([sys.executable, "-m", "memsaving", *sys.argv[4:]], stdout=subprocess.DEVNULL,
                             stderr=err)
    while child.poll() is None:
        if time.perf_counter() - start > kill_seconds or resident(child.pid) > kill_bytes:
            child.kill()
            child.wait()
            break
        time.sleep(0.05)
seconds = time.perf_counter() - start
scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
print(json.dumps({"status": child.returncode, "seconds": seconds, "peak": peak}))
"""


@dataclass
class Answer:
    status: int
    seconds: float
    peak: int
    """Peak resident bytes of the command."""
    lines: List[str]
    """Its stderr, line by line."""


def run_command(folder, *arguments: str) -> Answer:
    """``memsaving ARGUMENTS`` run in ``folder`` by the runner."""
    stderr_path = folder / "stderr.txt"
    done = subprocess.run([sys.executable, "-c", RUNNER, str(KILL_BYTES), str(KILL_SECONDS), str(stderr_path),
                           *arguments], cwd=folder, capture_output=True, text=True, timeout=KILL_SECONDS + 30)
    report = json.loads(done.stdout)
    return Answer(report["status"], report["seconds"], report["peak"], stderr_path.read_text().splitlines())


def assert_one_line(answer: Answer, status: int, words: str) -> None:
    """The command said ``words`` in one line on stderr and exited with ``status``, in seconds."""
    assert answer.lines and len(answer.lines) == 1, answer.lines
    assert "Traceback" not in answer.lines[0] and words in answer.lines[0], answer.lines
    assert answer.status == status, (answer.status, answer.lines)
    assert answer.seconds < ANSWER_SECONDS, (answer.seconds, answer.lines)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with a small saved model and files that are no model."""
    path = tmp_path_factory.mktemp("cli")
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Dense(16)(keras.layers.Embedding(100, 16)(tokens))
    keras.Model(tokens, keras.layers.GlobalAveragePooling1D()(h)).save(path / "model.keras")
    saved = (path / "model.keras").read_bytes()
    (path / "truncated.keras").write_bytes(saved[: len(saved) // 2])
    middle = len(saved) // 2
    (path / "damaged.keras").write_bytes(saved[:middle] + b"x" * 64 + saved[middle + 64:])
    (path / "text.keras").write_text("not a model\n")
    (path / "random.h5").write_bytes(bytes(range(256)) * 4)
    (path / "notes.txt").write_text("a file, not a folder\n")
    (path / "empty_folder").mkdir()
    return path


@pytest.mark.parametrize("arguments, status, words", [
    (["plan", "mlp", "--batch", "abc"], 2, "'abc' is not a whole number"),
    (["plan", "mlp", "--batch", "0"], 2, "--batch: 0 is below 1"),
    (["plan", "mlp", "--size", "-3"], 2, "--size: -3 is below 1"),
    (["plan", "mlp", "--budget", "abc"], 2, "cannot read memory budget 'abc'"),
    (["plan", "mlp", "--budget", "0"], 2, "a budget must be a positive number of bytes"),
    (["plan", "mlp", "--swap", "auto"], 2, "--swap auto: give a --budget too"),
    (["plan", "no_such_model"], 2, "no such file, and no built-in model of that name"),
    (["plan", "missing.keras"], 2, "no such file"),
    (["plan", "resnet50", "--size", "8"], 2, "image size that is at least 32"),
    (["plan", "unet", "--size", "12"], 2, "image size that is a multiple of 8"),
    (["plan", "mlp", "--plot", "no_such_folder/plan.png"], 2, "does not exist"),
    (["plan", "mlp", "--plot", "notes.txt/plan.png"], 2, "is not a folder"),
    (["plan", "mlp", "--plot", "empty_folder"], 2, "is a folder"),
    (["plan", "mlp", "--plot", "plan.xyz"], 2, "matplotlib cannot write .xyz files"),
    (["plan", "text.keras"], 1, "text.keras: not a readable Keras model: not a zip archive"),
    (["plan", "truncated.keras"], 1, "truncated.keras: not a readable Keras model: not a zip archive"),
    (["plan", "damaged.keras"], 1, "damaged.keras: not a readable Keras model: the archive's member"),
    (["plan", "random.h5"], 1, "random.h5: not a readable Keras model: no HDF5 signature"),
    (["plan", "notes.txt"], 1, "notes.txt: not a readable Keras model: its type '.txt'"),
    (["plan", "empty_folder"], 1, "empty_folder: not a readable Keras model: a folder without config.json"),
    (["demo", "--depth", "0"], 2, "--depth: 0 is below 1"),
    (["demo", "--width", "abc"], 2, "--width: 'abc' is not a whole number"),
])
def test_bad_argument_is_one_line_before_tensorflow(folder, arguments, status, words):
    assert_one_line(run_command(folder, *arguments), status, words)


@pytest.mark.parametrize("arguments", [
    ["plan", "transformer", "--size", "100000000"],
    ["plan", "mlp", "--batch", "1000000000"],
    ["demo", "--batch", "1000000000"],
    ["demo", "--width", "1000000"],
    ["demo", "--depth", "10000000", "--width", "1", "--batch", "1"],
])
def test_too_big_for_the_machine_is_refused_before_building(folder, arguments):
    answer = run_command(folder, *arguments)
    assert_one_line(answer, 2, "estimated from the shapes), more than the")
    assert "give a smaller" in answer.lines[0]
    assert answer.peak < PEAK_LIMIT, answer.peak


def test_saved_model_with_too_large_inputs_is_refused_before_loading(folder):
    """A saved model's inputs and weights are read from its archive, without
    TensorFlow: a batch whose inputs alone exceed the machine is refused in
    one line, before the model is loaded."""
    answer = run_command(folder, "plan", "model.keras", "--batch", "1000000000", "--size", "1000")
    assert_one_line(answer, 2, "a training step of model.keras needs about")
    assert answer.peak < PEAK_LIMIT, answer.peak


def test_saved_model_too_big_is_refused_once_loaded(folder):
    """Its layers' sizes are known once it is loaded (TensorFlow's start-up
    lines silenced): one error line after the loading line, before the step
    is traced and its ops profiled (which would print a "tracing and
    planning" line first).  Not timed: loading TensorFlow and Keras alone
    took 8 s on a loaded 2-core CI machine."""
    answer = run_command(folder, "plan", "model.keras", "--size", "100000000")
    errors = [line for line in answer.lines if line.startswith("memsaving plan:")]
    assert len(errors) == 1 and errors[0] == answer.lines[-1], answer.lines
    assert all(line.startswith("loading model.keras") for line in answer.lines[:-1]), answer.lines
    assert "a training step of model.keras at size 100000000 needs about" in errors[0]
    assert answer.status == 2 and answer.peak < PEAK_LIMIT, answer
