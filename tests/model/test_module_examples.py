"""The Examples in the planning side's docstrings (model, sim, candidates,
planners, references) and in treedecomp's run and print what they say,
without TensorFlow."""

import doctest
import importlib
import pkgutil

import pytest

import treedecomp

PLANNING_SIDE = ["model", "sim", "candidates", "planners", "references"]


def _modules():
    names = []
    for layer in PLANNING_SIDE:
        package = importlib.import_module(f"memsaving.{layer}")
        names += [f"memsaving.{layer}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]
    names += [f"treedecomp.{info.name}" for info in pkgutil.iter_modules(treedecomp.__path__)
              if info.name != "__main__"]
    return sorted(names)


def test_the_planning_side_has_examples():
    with_examples = [name for name in _modules()
                     if any(test.examples for test in doctest.DocTestFinder().find(importlib.import_module(name)))]
    # the finder must see both packages' docstrings, or the test below checks nothing
    assert any(name.startswith("memsaving.") for name in with_examples), with_examples
    assert any(name.startswith("treedecomp.") for name in with_examples), with_examples


@pytest.mark.parametrize("name", _modules())
def test_module_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module):
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) in {name} failed (output above)"
