"""The Examples in the docstrings of the functions users start from run, and
print what they say."""

import ast
import doctest
import inspect

import pytest

import memsaving.api
import memsaving.errors
import memsaving.keras
import memsaving.options
import memsaving.patching
import memsaving.tape_function
import memsaving.tf.offload
import memsaving.tf.swap_rewrite
import memsaving.tf.marking
import memsaving.tf.measure

EXAMPLES = {
    "gradients": memsaving.api.gradients,
    "plan": memsaving.api.plan,
    "keras.enable": memsaving.keras.enable,
    "function": memsaving.tape_function.function,
    "MemsavingFunction.explain": memsaving.tape_function.MemsavingFunction.explain,
    "checkpoint": memsaving.tf.marking.checkpoint,
    "measure_peak": memsaving.tf.measure.measure_peak,
    "measure_peak_increase": memsaving.tf.measure.measure_peak_increase,
    "MemsavingError": memsaving.errors.MemsavingError,
    "BudgetError": memsaving.errors.BudgetError,
    "CheckpointError": memsaving.errors.CheckpointError,
    "UnsupportedGraphError": memsaving.errors.UnsupportedGraphError,
    "PeakMemoryUnavailableError": memsaving.errors.PeakMemoryUnavailableError,
    "PlanWarning": memsaving.errors.PlanWarning,
    "gradients_and_plan": memsaving.api.gradients_and_plan,
    "gradients_memory": memsaving.api.gradients_memory,
    "gradients_speed": memsaving.api.gradients_speed,
    "gradients_collection": memsaving.api.gradients_collection,
    "patch": memsaving.patching.patch,
    "patched": memsaving.patching.patched,
    "unpatch": memsaving.patching.unpatch,
    "keras.disable": memsaving.keras.disable,
    "keras.is_enabled": memsaving.keras.is_enabled,
    "keras.plan_of": memsaving.keras.plan_of,
    "keras.calibration_of": memsaving.keras.calibration_of,
    "MemsavingFunction": memsaving.tape_function.MemsavingFunction,
    "SwapOptions": memsaving.tf.swap_rewrite.SwapOptions,
    "OffloadOptions": memsaving.tf.offload.OffloadOptions,
    "options.accepts_deprecated_keys": memsaving.options.accepts_deprecated_keys,
    "options.option_keywords": memsaving.options.option_keywords,
    "options.shared_options": memsaving.options.shared_options,
}
"""Public names whose Examples use TensorFlow (the planning side's, Plan and
clear_plan_cache among them, run in tests/model/test_module_examples.py)."""


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_examples_run(name):
    tests = doctest.DocTestFinder().find(EXAMPLES[name], name)
    assert tests and tests[0].examples, f"{name} has no Examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) of {name} failed (output above)"


def test_checkpoints_collection_example_runs():
    """The Example in the docstring of the constant (the string after its
    assignment, which the finder does not see)."""
    path = inspect.getsourcefile(memsaving.tf.marking)
    body = ast.parse(open(path).read()).body
    docstring = next(after.value.value for statement, after in zip(body, body[1:])
                     if isinstance(statement, ast.Assign)
                     and any(getattr(t, "id", None) == "CHECKPOINTS_COLLECTION" for t in statement.targets))
    test = doctest.DocTestParser().get_doctest(docstring, {}, "CHECKPOINTS_COLLECTION", path, 0)
    assert test.examples, "CHECKPOINTS_COLLECTION has no Examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) of CHECKPOINTS_COLLECTION failed (output above)"
