"""The size estimates the commands refuse with, against the models they
estimate, and the memory figure they are compared with."""

import os

import keras
import pytest
import tensorflow as tf

from memsaving.tf.profiles import TRIVIAL_OPS
from memsaving.tools import demo
from memsaving.tools.arguments import UsageError
from memsaving.tools.footprints import BUILT_IN, FLOAT_BYTES, Footprint, available_memory, dense_stack, \
    refuse_if_too_big
from memsaving.tools.models import BUILDERS
from memsaving.tools.plan_command import model_footprint

MIB = 2 ** 20
APPLICATIONS = {"resnet50", "resnet50v2", "vgg16", "mobilenet", "efficientnetb0"}
"""keras.applications models: slow to trace, so their checks are marked slow."""


def forward_bytes(model, batch: int = 1) -> int:
    """Bytes of every tensor the traced forward pass of ``model`` makes at
    ``batch``, inputs included (views, reads and shape arithmetic left out)."""
    specs = [tf.TensorSpec([batch] + list(t.shape[1:]), t.dtype) for t in model.inputs]
    graph = tf.function(lambda *xs: model(list(xs) if len(xs) > 1 else xs[0], training=True)) \
        .get_concrete_function(*specs).graph
    total = 0
    for op in graph.get_operations():
        if op.type in TRIVIAL_OPS - {"Placeholder"}:
            continue
        for tensor in op.outputs:
            if tensor.dtype not in (tf.resource, tf.variant) and tensor.shape.is_fully_defined():
                total += tensor.shape.num_elements() * tensor.dtype.size
    return total


def by_speed(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in APPLICATIONS else n for n in sorted(names)]


def test_every_built_in_model_has_an_estimate():
    assert set(BUILT_IN) == set(BUILDERS)


@pytest.mark.parametrize("name", by_speed(BUILT_IN))
def test_built_in_estimate_follows_the_model(name):
    """At sizes the coefficients were not fitted at, the estimate is within
    10% of the model's parameters and 25% of its forward tensors."""
    sizes = (40, 104) if BUILT_IN[name].smallest_size > 1 or BUILT_IN[name].size_multiple > 1 else (24, 100)
    for size in sizes:
        model = BUILDERS[name](size)
        estimate = BUILT_IN[name].footprint(size)
        assert estimate.parameter_bytes == pytest.approx(FLOAT_BYTES * model.count_params(), rel=0.1), size
        assert 0.8 < estimate.activation_bytes / forward_bytes(model) < 1.25, size


@pytest.mark.parametrize("name", by_speed(n for n in BUILT_IN if BUILT_IN[n].smallest_size > 1
                                           or BUILT_IN[n].size_multiple > 1))
def test_built_in_size_rules_are_the_models_own(name):
    """The smallest size and the multiple a built-in model is refused
    without are where building it starts to fail."""
    rule = BUILT_IN[name]
    good = max(rule.smallest_size, rule.size_multiple)
    BUILDERS[name](good)
    bad = rule.smallest_size - 1 if rule.smallest_size > 1 else good + rule.size_multiple // 2
    assert rule.size_problem(good) is None and rule.size_problem(bad) is not None
    with pytest.raises(ValueError):
        BUILDERS[name](bad)


def test_demo_estimate_follows_the_demo_model():
    depth, width = 6, 32
    model = demo.dense_stack(depth, width)
    estimate = dense_stack(depth, width)
    assert estimate.parameter_bytes == FLOAT_BYTES * model.count_params()
    assert estimate.activation_bytes == forward_bytes(model)


def test_saved_model_footprint_counts_weights_and_layer_outputs():
    """A loaded model's footprint: its weights, and its layers' outputs with
    every unknown dimension at ``size`` (the input's included)."""
    inputs = keras.Input((None, 8))
    model = keras.Model(inputs, keras.layers.Dense(16)(inputs))
    footprint = model_footprint(model, size=10)
    assert footprint.parameter_bytes == FLOAT_BYTES * (8 * 16 + 16)
    assert footprint.activation_bytes == FLOAT_BYTES * (10 * 8 + 10 * 16)


def test_refusal_gives_the_estimate_the_memory_and_a_batch_that_fits():
    footprint = Footprint(parameter_bytes=MIB, activation_bytes=MIB)
    with pytest.raises(UsageError, match=r"needs about 102\.0 MiB .* more than the 50\.0 MiB this machine has "
                                         r"available \(batch 48 would fit\): give a smaller --batch"):
        refuse_if_too_big(footprint, 100, "the model", "give a smaller --batch", available=50 * MIB)
    refuse_if_too_big(footprint, 48, "the model", "give a smaller --batch", available=50 * MIB)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_available_memory_reads_meminfo_and_a_lower_container_limit(tmp_path):
    meminfo = write(tmp_path / "meminfo", "MemTotal:  8000 kB\nMemFree:  1000 kB\nMemAvailable:  4000 kB\n")
    assert available_memory(meminfo, str(tmp_path / "no_cgroup")) == 4000 * 1024
    write(tmp_path / "v2" / "memory.max", "3000000\n")
    write(tmp_path / "v2" / "memory.current", "1000000\n")
    assert available_memory(meminfo, str(tmp_path / "v2")) == 2000000
    write(tmp_path / "v1" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path / "v1" / "memory" / "memory.usage_in_bytes", "1000000\n")
    assert available_memory(meminfo, str(tmp_path / "v1")) == 4000 * 1024
    write(tmp_path / "unlimited" / "memory.max", "max\n")
    write(tmp_path / "unlimited" / "memory.current", "1000000\n")
    assert available_memory(meminfo, str(tmp_path / "unlimited")) == 4000 * 1024


def fake_sysconf(figures):
    """``os.sysconf`` on a system that knows only ``figures``."""
    def sysconf(name):
        if name not in figures:
            raise ValueError(f"unrecognized configuration name {name}")
        return figures[name]
    return sysconf


def test_available_memory_without_proc_asks_the_c_library(tmp_path, monkeypatch):
    """Without /proc (macOS): the free pages, else (no such figure) the physical ones."""
    missing = str(tmp_path / "missing")
    monkeypatch.setattr(os, "sysconf", fake_sysconf({"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 100,
                                                     "SC_PHYS_PAGES": 1000}))
    assert available_memory(missing, missing) == 100 * 4096
    monkeypatch.setattr(os, "sysconf", fake_sysconf({"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}))
    assert available_memory(missing, missing) == 1000 * 4096
    monkeypatch.setattr(os, "sysconf", fake_sysconf({}))
    assert available_memory(missing, missing) is None
