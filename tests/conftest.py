"""Test setup: TensorFlow must be configured before it starts.

* ``TF_CPU_ALLOCATOR_USE_BFC=true`` so peak memory can be measured on CPU;
* one inter-op thread so measured peaks repeat to the byte;
* two logical CPU devices so placement across devices can be tested.

Tests are grouped like the package: ``tests/<layer>/`` tests
``memsaving/<layer>/``.  The planning side's tests (TENSORFLOW_FREE) never
import TensorFlow; it is imported and configured only before the first
test module of another folder is collected, so ``pytest tests/sim`` (or
any planning-side folder) runs without it.
"""

import gc
import os
import tempfile

import pytest

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Kernel profiles (memsaving.tf.profiles) are cached on disk; a fresh folder per
# run keeps a test's predictions from depending on what earlier runs cached.
os.environ["MEMSAVING_CACHE_DIR"] = tempfile.mkdtemp(prefix="memsaving-test-profiles-")

TENSORFLOW_FREE = {"model", "sim", "candidates", "planners", "references", "treedecomp"}
"""The test folders whose tests run without TensorFlow."""


def configure_tensorflow():
    """One inter-op thread and two logical CPUs; a no-op once TensorFlow
    has started, or when it is not installed."""
    try:
        import tensorflow as tf
    except ImportError:  # treedecomp tests run without TensorFlow
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )
    except RuntimeError:
        pass  # already initialised by an earlier import


def pytest_collectstart(collector):
    """Configure TensorFlow before the first test module that may start it
    is imported."""
    if isinstance(collector, pytest.Module) and collector.path.parent.name not in TENSORFLOW_FREE:
        configure_tensorflow()


@pytest.fixture(autouse=True)
def _plan_each_test_afresh():
    """Plans are remembered per graph and arguments for the whole process
    (memsaving.planners.cache); a test plans what it builds itself, whatever
    earlier tests built the same graph, with its own patches in force."""
    from memsaving.planners.cache import clear_plan_cache

    clear_plan_cache()
    yield


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_between_modules():
    """Plans count the bytes the allocator holds (garbage included, until
    Python collects it); collecting once per module keeps what earlier
    modules dropped out of this module's predictions and budgets."""
    gc.collect()
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long benchmark-like tests, not in the default run")
