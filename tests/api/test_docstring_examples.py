"""The Examples in the docstrings of the functions users start from run, and
print what they say."""

import doctest

import pytest

import memsaving.api
import memsaving.keras
import memsaving.tape_function

EXAMPLES = {
    "gradients": memsaving.api.gradients,
    "plan": memsaving.api.plan,
    "keras.enable": memsaving.keras.enable,
    "function": memsaving.tape_function.function,
    "MemsavingFunction.explain": memsaving.tape_function.MemsavingFunction.explain,
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_examples_run(name):
    tests = doctest.DocTestFinder().find(EXAMPLES[name], name)
    assert tests and tests[0].examples, f"{name} has no Examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) of {name} failed (output above)"
