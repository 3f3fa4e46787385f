"""The package's layers, checked on its source without importing it.

Data flows one way: TensorFlow graph -> graph model -> candidates ->
planners -> a plan the simulator scores -> the TensorFlow emitter.  Only the
two ends touch TensorFlow.  Each subpackage of memsaving is a layer; the few
modules directly in memsaving/ are placed in one by TOP_LEVEL.  This file
fails when

* a module imports from a layer it may not (an upward import, or the
  TensorFlow side and the planning side reaching into each other);
* modules import each other in a cycle (imports inside functions count:
  a deferred import hides a cycle, it does not remove it);
* a private name (``_name``) is imported from another module, or read as an
  attribute of an imported module; a private module (``_elimination``) is
  imported from outside its package;
* a module of the planning side imports TensorFlow or Keras, or importing
  it loads TensorFlow;
* a module is in no layer, or memsaving/ holds more than MAX_TOP_LEVEL
  modules (a new module goes in a subpackage);
* a test of a planning-side layer (``tests/sim/`` and the like) imports
  TensorFlow, the TensorFlow test helpers or a TensorFlow-side module, or
  collecting those tests loads TensorFlow.

README, "Architecture", draws the layers.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
from typing import Dict, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("memsaving", "treedecomp")

SUBPACKAGES: Dict[str, str] = {
    "model": "the framework-neutral model of a step: ops, tensors, units, buffer keys",
    "sim": "replaying a plan on the model: actions, the simulator, swap timing",
    "candidates": "checkpoint candidates from graph structure",
    "planners": "choosing what to keep, recompute or swap; the plan type",
    "references": "exact references the planners are compared with",
    "tf": "the TensorFlow end: reading graphs, profiling, rewriting, measuring",
    "keras": "memsaving.keras: Keras' train step through memsaving, the batch from the data, budgets measured",
    "tools": "commands, demo, built-in models, timelines",
}
"""Each subpackage of memsaving is the layer of the same name."""

TOP_LEVEL: Dict[str, str] = {
    "memsaving": "api",  # the package's __init__: what users import
    "memsaving.api": "api",
    "memsaving.options": "api",
    "memsaving.fit_budget": "api",
    "memsaving.calibration": "api",
    "memsaving.patching": "api",
    "memsaving.offload": "api",
    "memsaving.tape_function": "api",
    "memsaving.errors": "model",  # every layer raises these
    "memsaving.__main__": "tools",
}
"""The layer of each module directly in memsaving/."""

MAX_TOP_LEVEL = 12
"""At most this many modules directly in memsaving/; the rest go in a layer."""

ALLOWED: Dict[str, Set[str]] = {
    "model": {"model"},
    "sim": {"sim", "model"},
    "candidates": {"candidates", "model"},
    "tf": {"tf", "model"},
    "planners": {"planners", "candidates", "sim", "model"},
    "references": {"references", "planners", "candidates", "sim", "model"},
    "api": {"api", "tf", "planners", "candidates", "sim", "model"},
    "keras": {"keras", "api", "tf", "planners", "candidates", "sim", "model"},
    "tools": {"tools", "keras", "api", "tf", "planners", "candidates", "sim", "model", "references"},
}
"""The layers each layer may import from (its own included)."""

TENSORFLOW_FREE = {"model", "sim", "candidates", "planners", "references"}
FRAMEWORKS = ("tensorflow", "keras", "tf_keras")

Module = str  # dotted import name: "memsaving", "memsaving.sim", "memsaving.sim.simulate"


def _module_files() -> Dict[Module, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


FILES = _module_files()


def _package(module: Module) -> str:
    return module.split(".")[0]


def _is_package(module: Module) -> bool:
    return FILES[module].name == "__init__.py"


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not _is_package(module):
        parts = parts[:-1]  # a module's "." is its package
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports(module: Module) -> List[Tuple[Module, str, int]]:
    """``(first-party module imported from, name or "", line)`` for every
    import in ``module``, at any depth; ``from pkg import mod`` counts as an
    import of ``pkg.mod`` when that is a module."""
    tree = ast.parse(FILES[module].read_text(), filename=str(FILES[module]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in FILES:
                    found.append((f"{source}.{alias.name}", "", node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
    return found


def _first_party(name: str) -> Module:
    """The module file ``name`` (a dotted import) refers to, or ''."""
    return name if name in FILES else ""


def _module_aliases(module: Module) -> Dict[str, Module]:
    """Local names bound to first-party modules (``from memsaving.candidates
    import cuts``, ``import treedecomp``)."""
    tree = ast.parse(FILES[module].read_text())
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _first_party(alias.name)
                if target and (alias.asname or "." not in alias.name):
                    bound[alias.asname or alias.name] = target
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in FILES:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    return bound


def _layer(module: Module) -> str:
    if _package(module) != "memsaving":
        return ""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in SUBPACKAGES:
        return parts[1]
    return TOP_LEVEL.get(module, "")


def _edges() -> Dict[Module, Set[Module]]:
    edges: Dict[Module, Set[Module]] = {module: set() for module in FILES}
    for module in FILES:
        for source, _, _ in _imports(module):
            target = _first_party(source)
            if target and target != module:
                edges[module].add(target)
    return edges


def test_every_module_has_a_layer():
    missing = sorted(m for m in FILES if _package(m) == "memsaving" and not _layer(m))
    assert not missing, ("put these modules in a subpackage, or name their layer in "
                         f"tests/test_architecture.py TOP_LEVEL: {missing}")
    gone = sorted(m for m in TOP_LEVEL if m not in FILES)
    assert not gone, f"TOP_LEVEL names modules that do not exist: {gone}"
    absent = sorted(p for p in SUBPACKAGES if f"memsaving.{p}" not in FILES)
    assert not absent, f"SUBPACKAGES names packages without an __init__.py: {absent}"


def test_few_modules_directly_in_the_package():
    top = sorted(path.stem for path in (ROOT / "memsaving").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules in memsaving/ (at most {MAX_TOP_LEVEL}): {top}"


def test_imports_go_down_the_layers():
    wrong = []
    for module in FILES:
        layer = _layer(module)
        for source, name, line in _imports(module):
            target = _first_party(source)
            if not target:
                continue
            if _package(target) != _package(module):
                if _package(module) == "treedecomp":
                    wrong.append(f"{module}:{line} imports {target}: treedecomp stands alone")
                continue
            if layer and _layer(target) not in ALLOWED[layer]:
                wrong.append(f"{module}:{line} ({layer}) imports {target} ({_layer(target)})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycle():
    edges = _edges()
    state: Dict[Module, int] = {}  # 1: on the stack, 2: done
    cycles = []

    def visit(module: Module, path: List[Module]):
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_crosses_a_module():
    wrong = []
    for module in FILES:
        for source, name, line in _imports(module):
            target = _first_party(source)
            if not target or target == module:
                continue
            stem = target.split(".")[-1]
            outside = not module.startswith(target.rsplit(".", 1)[0] + ".")
            if stem.startswith("_") and not stem.startswith("__") and outside:
                wrong.append(f"{module}:{line} imports the private module {target}")
            if name.startswith("_") and not name.startswith("__"):
                wrong.append(f"{module}:{line} imports {target}.{name}")
        aliases = _module_aliases(module)
        tree = ast.parse(FILES[module].read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                wrong.append(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)


@pytest.mark.parametrize("layer", sorted(TENSORFLOW_FREE))
def test_planning_side_never_imports_tensorflow(layer):
    wrong = []
    for module in sorted(m for m in FILES if _layer(m) == layer):
        for source, _, line in _imports(module):
            if source.split(".")[0] in FRAMEWORKS:
                wrong.append(f"{module}:{line} imports {source}")
    assert not wrong, f"the {layer} layer must run without TensorFlow:\n" + "\n".join(wrong)


def test_planning_side_imports_without_tensorflow():
    """Importing every planning-side module (and treedecomp) in a fresh
    interpreter loads no framework: the package's ``__init__`` must not pull
    TensorFlow in on the way."""
    modules = sorted(m for m in FILES if _layer(m) in TENSORFLOW_FREE or _package(m) == "treedecomp")
    script = ("import importlib, sys\n"
              f"for name in {modules!r}:\n"
              "    importlib.import_module(name)\n"
              f"print(sorted(n for n in sys.modules if n.split('.')[0] in {FRAMEWORKS!r}))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"loaded: {result.stdout.strip()}"


def test_the_checks_catch_what_they_guard(tmp_path, monkeypatch):
    """The checks fail on a planted upward import, cycle and private import."""
    bad = tmp_path / "memsaving"
    (bad / "model").mkdir(parents=True)
    (bad / "sim").mkdir()
    (bad / "model" / "graph.py").write_text("from memsaving.sim.simulate import Simulation\n")
    (bad / "sim" / "simulate.py").write_text("from memsaving.model.graph import _hidden\nimport tensorflow\n")
    (bad / "stray.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "FILES", {
        "memsaving.model.graph": bad / "model" / "graph.py",
        "memsaving.sim.simulate": bad / "sim" / "simulate.py",
        "memsaving.stray": bad / "stray.py"})
    with pytest.raises(AssertionError, match="memsaving.model.graph:1 \\(model\\) imports memsaving.sim.simulate"):
        test_imports_go_down_the_layers()
    with pytest.raises(AssertionError, match="memsaving.model.graph -> memsaving.sim.simulate -> memsaving.model"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match="imports memsaving.model.graph._hidden"):
        test_no_private_name_crosses_a_module()
    with pytest.raises(AssertionError, match="memsaving.sim.simulate:2 imports tensorflow"):
        test_planning_side_never_imports_tensorflow("sim")
    with pytest.raises(AssertionError, match="memsaving.stray"):
        test_every_module_has_a_layer()
    (tmp_path / "tests" / "sim").mkdir(parents=True)
    (tmp_path / "tests" / "sim" / "test_bad.py").write_text("import numpy\nimport tensorflow as tf\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="tests/sim/test_bad.py:2 imports tensorflow"):
        test_planning_side_tests_never_import_tensorflow()


TEST_HELPERS_WITH_TENSORFLOW = ("helpers", "model_zoo", "random_programs")


def test_planning_side_tests_never_import_tensorflow():
    """``tests/<layer>/`` of a planning-side layer imports only planning-side
    modules (any of those layers, and ``memsaving.errors``), so it runs
    without TensorFlow."""
    wrong = []
    for layer in sorted(TENSORFLOW_FREE):
        for path in sorted((ROOT / "tests" / layer).glob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    first = name.split(".")[0]
                    target = name if name in FILES else ""
                    if (first in FRAMEWORKS or first in TEST_HELPERS_WITH_TENSORFLOW or name == "memsaving"
                            or (target and _package(target) == "memsaving"
                                and _layer(target) not in TENSORFLOW_FREE)):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not wrong, "planning-side tests must run without TensorFlow:\n" + "\n".join(wrong)


def test_planning_side_tests_collect_without_tensorflow():
    folders = [f"tests/{layer}" for layer in sorted(TENSORFLOW_FREE)] + ["tests/treedecomp"]
    script = ("import sys, pytest\n"
              f"code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *{folders!r}])\n"
              f"print('LOADED', sorted(n for n in sys.modules if n.split('.')[0] in {FRAMEWORKS!r}))\n"
              "sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loaded = result.stdout.splitlines()[-1]
    assert loaded == "LOADED []", loaded[:300]


GOOGLE_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Example|Examples|Attributes|Note|Notes):\s*$")
"""A Google-style section header; numpydoc puts the title over a line of dashes instead."""


def _docstrings(tree: ast.Module) -> List[Tuple[str, str]]:
    """``(qualified name, docstring)`` of the module and of every class and
    function in it, nested ones included (the module is ``<module>``)."""
    found = [("<module>", ast.get_docstring(tree) or "")]

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, ast.get_docstring(child) or ""))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_docstrings_use_numpydoc_sections():
    """Docstrings use numpydoc sections (``Parameters`` over ``----------``),
    not Google-style ones (``Args:``)."""
    wrong = []
    for module in sorted(FILES):
        path = FILES[module]
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, doc in _docstrings(tree):
            headers = sorted({m.group(1) for line in doc.splitlines() if (m := GOOGLE_SECTION.match(line))})
            if headers:
                wrong.append(f"{path.relative_to(ROOT)}:{name} ({', '.join(h + ':' for h in headers)})")
    assert not wrong, "Google-style docstring sections, write numpydoc instead:\n" + "\n".join(wrong)
