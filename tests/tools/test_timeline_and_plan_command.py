"""memsaving.timeline (predicted and measured) and the `memsaving plan` command."""

import keras
import pytest
import tensorflow as tf

import memsaving
from memsaving.tools.cli import main

WIDTH, DEPTH, BATCH = 128, 24, 512


def _weights():
    return [tf.Variable(tf.random.normal([WIDTH, WIDTH], stddev=WIDTH ** -0.5, seed=i)) for i in range(DEPTH)]


def _loss_fn(ws):
    def loss(x):
        h = x
        for w in ws:
            h = tf.nn.relu(tf.matmul(h, w))
        return tf.reduce_mean(h * h)
    return loss


@pytest.mark.parametrize("checkpoints", [[], "memory"], ids=["plain", "memory"])
def test_timeline_measured_peak_equals_measure_peak(checkpoints):
    ws = _weights()
    loss = _loss_fn(ws)
    x = tf.random.normal([BATCH, WIDTH], seed=2)

    @tf.function
    def step(x):
        grads = memsaving.gradients(loss(x), ws, checkpoints=checkpoints)
        return tf.add_n([tf.reduce_sum(g) for g in grads])

    step(x)
    measured = memsaving.measure_peak_increase(step, x)
    line = memsaving.timeline(loss, ws, [x], checkpoints=checkpoints)
    print(f"{checkpoints}: timeline peak {line.measured_peak / 2**20:.2f} MiB, measure_peak "
          f"{measured / 2**20:.2f} MiB, predicted {line.predicted_peak / 2**20:.2f} MiB")
    # Plain backprop runs in about one order (within 5% in a full test run); a checkpointed step's order (and so
    # its peak) varies a little between graphs and processes, because the
    # executor orders ready ops partly by measured op costs.
    tolerance = 0.08 if checkpoints == [] else 0.15
    assert abs(line.measured_peak - measured) <= tolerance * measured
    assert len(line.predicted) == len(line.labels) and len(line.measured) == len(line.unit_ends)
    if checkpoints == "memory":
        peaks = [peak for _, _, peak in line.measured]
        assert sum(peak > 0.5 * line.measured_peak for peak in peaks) >= 3, "one rise per recomputed segment"


def test_plot_timeline_writes_an_image(tmp_path):
    ws = _weights()
    x = tf.random.normal([64, WIDTH], seed=2)
    lines = {name: memsaving.timeline(_loss_fn(ws), ws, [x], checkpoints=c)
             for name, c in (("plain", []), ("sqrt(n)", "memory"))}
    path = tmp_path / "zigzag.png"
    memsaving.plot_timeline(lines, str(path))
    assert path.stat().st_size > 10_000


def test_plan_command_on_a_saved_model(tmp_path, capsys):
    inputs = keras.Input((32,))
    h = inputs
    for _ in range(12):
        h = keras.layers.Dense(64, activation="relu")(h)
    path = tmp_path / "model.keras"
    keras.Model(inputs, keras.layers.Dense(3)(h)).save(path)
    plot = tmp_path / "plan.png"
    assert main(["plan", str(path), "--batch", "16", "--plot", str(plot)]) == 0
    out = capsys.readouterr()
    assert "memsaving plan (memory)" in out.out and "x lower" in out.out and "more compute" in out.out
    assert "tracing and planning" in out.err
    assert plot.stat().st_size > 10_000


def test_plan_command_budget_and_bad_input(capsys):
    assert main(["plan", "mlp", "--batch", "4", "--budget", "1GiB"]) == 0
    assert "memsaving plan (budget)" in capsys.readouterr().out
    assert main(["plan", "mlp", "--batch", "4", "--budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert "smallest feasible budget" in err
    assert 'File "' not in err  # the message, not the frames tf.function adds when it re-raises
    assert main(["plan", "no-such-model"]) == 2  # a usage error, before loading anything
    assert "no such file, and no built-in model of that name" in capsys.readouterr().err
    assert main(["plan", "mlp", "--batch", "64", "--budget", "1GiB", "--swap", "auto"]) == 0
    out = capsys.readouterr().out
    assert "memsaving plan (hybrid)" in out and "predicted step time" in out
    assert main(["plan", "mlp", "--swap", "auto"]) == 2
    assert "give a --budget" in capsys.readouterr().err
