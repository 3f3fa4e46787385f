"""The profile cache file (memsaving.tf.profile_cache): what is read back is
checked before use, writers running at once keep each other's entries,
abandoned temporary files are removed, a newer format's file is left alone."""

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

import memsaving
import tensorflow as tf
import keras

from memsaving.tf import profile_cache, profiles

MIB = 2 ** 20


def _tiny_step_ops():
    """The ops of ``tanh(x @ w)`` and a small loop over it; batch 8."""
    w = tf.Variable(tf.ones([16, 16]))

    @tf.function
    def step(x):
        h = tf.tanh(tf.matmul(x, w))
        return tf.while_loop(lambda i, h: i < 4, lambda i, h: (i + 1, tf.sin(h) * h), [0, h])[1]

    return step.get_concrete_function(tf.TensorSpec([8, 16])).graph.get_operations()


def _stored():
    with open(profile_cache.cache_path(), encoding="utf-8") as handle:
        return json.load(handle)


def _rewrite(data):
    with open(profile_cache.cache_path(), "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def _key_of(data, *op_types):
    """The key of the stored profile of the op of one of ``op_types``."""
    [key] = [k for k in data["profiles"] if k.split("|")[-1].split(":")[0] in op_types]
    return key


# ------------------------------------------------------------------ values read back are checked


@pytest.mark.parametrize("field, value", [
    ("temp_bytes", 1e12), ("grad_temp_bytes", 10 ** 12), ("saved_bytes", 2 ** 31), ("temp_bytes", -5),
    ("temp_bytes", float("nan")), ("temp_bytes", "12"), ("output_bytes", [1e12]), ("seconds", float("nan")),
    ("grad_seconds", 1e9), ("seconds", -1.0), ("ok", "false"), ("saved_bytes", 10 ** 400),
])
def test_implausible_stored_figures_are_measured_again(cache_dir, field, value):
    ops = _tiny_step_ops()
    first = profiles.profile_ops(ops, batch_size=8, cache=profiles.ProfileCache())
    assert first.measured >= 3 and first.rejected == 0
    data = _stored()
    matmul = _key_of(data, "MatMul")
    data["profiles"][matmul][field] = value
    _rewrite(data)
    again = profiles.profile_ops(ops, batch_size=8, cache=profiles.ProfileCache())
    # the damaged entry alone is ignored and measured again; the others are used
    assert (again.rejected, again.measured, again.cached) == (1, 1, first.measured - 1)
    [name] = [op.name for op in ops if op.type == "MatMul"]
    remeasured = again.profiles[name]
    assert remeasured.ok and max(remeasured.temp_bytes, remeasured.grad_temp_bytes, *remeasured.output_bytes) < MIB
    assert 0 <= remeasured.seconds < 1 and 0 <= remeasured.grad_seconds < 1
    assert profile_cache.OpProfile.from_json(_stored()["profiles"][matmul]) == remeasured  # saved over the damage


def test_loops_are_bounded_by_the_machine_only(cache_dir):
    """A loop holds what its iterations make, which its shapes do not show:
    1 GiB saved by a loop over tiny tensors is kept, by a MatMul rejected."""
    ops = _tiny_step_ops()
    profiles.profile_ops(ops, batch_size=8, cache=profiles.ProfileCache())
    data = _stored()
    loop, matmul = _key_of(data, "While", "StatelessWhile"), _key_of(data, "MatMul")
    for key in (loop, matmul):
        data["profiles"][key]["saved_bytes"] = 2 ** 30
    _rewrite(data)
    run = profiles.profile_ops(ops, batch_size=8, measure=False, cache=profiles.ProfileCache())
    [loop_op] = [op.name for op in ops if op.type in ("While", "StatelessWhile")]
    assert run.profiles[loop_op].saved_bytes == 2 ** 30
    assert run.rejected == 1 and run.missing == 1  # the MatMul, not measured in a cache-only run


def _plain_peak_above_resident(model, x):
    captured = {}

    @tf.function
    def step(x):
        loss = tf.reduce_mean(tf.square(model(x, training=True)))
        captured["plan"] = memsaving.plan(loss, model.trainable_variables, checkpoints=[], batch_size=8)
        return loss

    step.get_concrete_function(x)
    plan = captured["plan"]
    return plan.plain_peak - plan.resident_bytes, plan


def test_a_damaged_cache_leaves_the_predicted_peak_sane(cache_dir):
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(16, activation="tanh")(keras.layers.Dense(32)(inputs)))
    x = tf.random.normal([8, 16])
    measured, plan = _plain_peak_above_resident(model, x)
    assert plan.profiled_signatures > 0
    data = _stored()
    for entry in data["profiles"].values():
        entry["temp_bytes"] = 1e12  # 931 GiB each
    _rewrite(data)
    profiles.CACHE.clear()  # a new process: from the file
    again, plan = _plain_peak_above_resident(model, x)
    assert plan.profiled_signatures == len(data["profiles"])  # every entry measured again
    assert again < 2 * measured + MIB


# ------------------------------------------------------------------ writers at once


def _put_many(prefix, count, start):
    """One writer: ``count`` entries saved one at a time, as ``count``
    profiling runs of one process would."""
    cache = profiles.ProfileCache()
    start.wait()
    for k in range(count):
        cache.put({f"{prefix}{k}": profile_cache.OpProfile(temp_bytes=k, seconds=0.001)})


@pytest.mark.parametrize("lock", ["flock", "marker file"])
def test_processes_saving_at_once_keep_every_entry(cache_dir, monkeypatch, lock):
    if lock == "marker file":
        monkeypatch.setattr(profile_cache, "fcntl", None)  # as where fcntl is missing
    count = 150
    context = multiprocessing.get_context("fork")  # the writers only touch files, never TensorFlow
    start = context.Barrier(2)
    writers = [context.Process(target=_put_many, args=(prefix, count, start)) for prefix in ("a", "b")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert len(_stored()["profiles"]) == 2 * count
    assert not list(cache_dir.glob(".profiles-*.json"))


def test_abandoned_temporary_files_are_removed(cache_dir):
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                            text=True, check=True)
    dead_pid, live_pid, host = int(exited.stdout), os.getppid(), profile_cache._host()
    killed = cache_dir / f".profiles-{dead_pid}@{host}.k1ll3d00.json"  # its writer exited mid-write
    old = cache_dir / ".profiles-x0ld_n4m.json"  # an older memsaving's name, an hour old
    writing = cache_dir / f".profiles-{live_pid}@{host}.wr1t1ng0.json"  # a live writer's, just made
    elsewhere = cache_dir / f".profiles-{dead_pid}@other-host.r3m0te00.json"  # another host's, just made
    for path in (killed, old, writing, elsewhere):
        path.write_text('{"format": 3, "prof')
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    profiles.ProfileCache().put({"key": profile_cache.OpProfile()})
    assert not killed.exists() and not old.exists()
    assert writing.exists() and elsewhere.exists()
    assert list(_stored()["profiles"]) == ["key"]


# ------------------------------------------------------------------ formats


def test_a_newer_formats_file_is_left_alone(cache_dir, caplog):
    path = profile_cache.cache_path()
    newer = {"format": profile_cache.FORMAT + 1, "profiles": {"future": {"temp_bytes": 1, "layout": "new"}}}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(newer, handle, indent=1)
    with open(path, "rb") as handle:
        original = handle.read()
    ops = _tiny_step_ops()
    cache = profiles.ProfileCache()
    with caplog.at_level(logging.WARNING, logger="memsaving"):
        first = profiles.profile_ops(ops, batch_size=8, cache=cache)
        cache.put({"another": profile_cache.OpProfile()})
    again = profiles.profile_ops(ops, batch_size=8, cache=cache)
    with open(path, "rb") as handle:
        assert handle.read() == original
    assert first.measured >= 3 and first.cached == 0  # nothing read from it
    assert again.measured == 0 and again.cached == first.measured  # kept in memory
    warnings = [r.getMessage() for r in caplog.records if "newer memsaving" in r.getMessage()]
    assert len(warnings) == 1 and path in warnings[0] and "MEMSAVING_CACHE_DIR" in warnings[0]


def test_an_older_formats_file_is_replaced(cache_dir):
    _rewrite({"format": profile_cache.FORMAT - 1, "profiles": {"old": {"temp_bytes": 1}}})
    profiles.ProfileCache().put({"new": profile_cache.OpProfile(temp_bytes=2)})
    assert _stored() == {"format": profile_cache.FORMAT, "profiles": {"new": profile_cache.OpProfile(2).to_json()}}
