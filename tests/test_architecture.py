"""The package's layers, checked on its source without importing it.

Data flows one way: TensorFlow graph -> graph model -> candidates ->
planners -> a plan the simulator scores -> the TensorFlow emitter.  Only the
two ends touch TensorFlow.  This file names the layer of every module and
fails when

* a module imports from a layer it may not (an upward import, or the
  TensorFlow side and the planning side reaching into each other);
* modules import each other in a cycle (imports inside functions count:
  a deferred import hides a cycle, it does not remove it);
* a private name (``_name``) is imported from another module, or read as an
  attribute of an imported module; a private module (``_elimination``) is
  imported from outside its package;
* a module of the planning side imports TensorFlow or Keras;
* a module of the package is in no layer (a new module must be placed).

README, "Architecture", draws the layers.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from typing import Dict, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("memsaving", "treedecomp")

LAYERS: Dict[str, Set[str]] = {
    # the framework-neutral model of a step: ops, tensors, units, buffers
    "model": {"graph", "schedule", "errors", "buffers", "parameters"},
    # replaying a plan on the model: actions, the simulator, swap timing
    "sim": {"actions", "simulate", "swap", "executor", "replay"},
    # checkpoint candidates from graph structure
    "candidates": {"candidates", "selection"},
    # choosing what to keep, recompute or swap; the result type
    "planners": {"budget", "chain", "nested", "refine", "hybrid", "modes", "planning"},
    # exact references the planners are compared with
    "references": {"exact", "milp", "layer_graph"},
    # the TensorFlow end: reading graphs, profiling, rewriting, measuring
    "tf": {"marking", "forward", "extract", "checkpoints", "rewrite", "swap_rewrite", "order", "aggregation",
           "loop_pinning", "profiles", "measure"},
    # what users call
    "api": {"__init__", "gradients", "fit_budget", "patching", "keras"},
    # commands, demo, built-in models, timelines
    "tools": {"__main__", "cli", "demo", "models", "plan_command", "memory_timeline"},
}

ALLOWED: Dict[str, Set[str]] = {
    "model": {"model"},
    "sim": {"sim", "model"},
    "candidates": {"candidates", "model"},
    "tf": {"tf", "model"},
    "planners": {"planners", "candidates", "sim", "model"},
    "references": {"references", "planners", "candidates", "sim", "model"},
    "api": {"api", "tf", "planners", "candidates", "sim", "model"},
    "tools": {"tools", "api", "tf", "planners", "candidates", "sim", "model", "references"},
}
"""The layers each layer may import from (its own included)."""

TENSORFLOW_FREE = {"model", "sim", "candidates", "planners", "references"}
FRAMEWORKS = ("tensorflow", "keras", "tf_keras")

Module = str  # dotted name, "memsaving.simulate"


def _module_files() -> Dict[Module, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            found[f"{package}.{path.stem}"] = path
    return found


FILES = _module_files()


def _package(module: Module) -> str:
    return module.split(".")[0]


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names."""
    if node.level == 0:
        return node.module or ""
    base = _package(module)  # the packages are flat: one level up is the package
    return base + ("." + node.module if node.module else "")


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
    if name in FILES:
        return name
    if name in PACKAGES:
        return f"{name}.__init__"
    return ""


def _module_aliases(module: Module) -> Dict[str, Module]:
    """Local names bound to first-party modules (``from memsaving import
    candidates``, ``import treedecomp``)."""
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
    if not module.startswith("memsaving."):
        return ""
    stem = module.split(".", 1)[1]
    return next((layer for layer, members in LAYERS.items() if stem in members), "")


def _edges() -> Dict[Module, Set[Module]]:
    edges: Dict[Module, Set[Module]] = {module: set() for module in FILES}
    for module in FILES:
        for source, _, _ in _imports(module):
            target = _first_party(source)
            if target and target != module:
                edges[module].add(target)
    return edges


def test_every_module_has_a_layer():
    placed = [stem for members in LAYERS.values() for stem in members]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    missing = sorted(m for m in FILES if m.startswith("memsaving.") and not _layer(m))
    assert not missing, f"place these modules in a layer of tests/test_architecture.py LAYERS: {missing}"
    gone = sorted(stem for stem in placed if f"memsaving.{stem}" not in FILES)
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


def test_imports_go_down_the_layers():
    wrong = []
    for module in FILES:
        layer = _layer(module)
        for source, name, line in _imports(module):
            target = _first_party(source)
            if not target:
                continue
            if _package(target) != _package(module):
                if module.startswith("treedecomp."):
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
            stem = target.split(".")[1]
            if stem.startswith("_") and not stem.startswith("__") and _package(target) != _package(module):
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


def test_the_checks_catch_what_they_guard(tmp_path, monkeypatch):
    """The checks fail on a planted upward import, cycle and private import."""
    bad = tmp_path / "memsaving"
    bad.mkdir()
    (bad / "graph.py").write_text("from memsaving.simulate import Simulation\n")
    (bad / "simulate.py").write_text("from memsaving.graph import _hidden\nimport tensorflow\n")
    monkeypatch.setattr(sys.modules[__name__], "FILES", {
        "memsaving.graph": bad / "graph.py", "memsaving.simulate": bad / "simulate.py"})
    with pytest.raises(AssertionError, match="memsaving.graph:1 \\(model\\) imports memsaving.simulate"):
        test_imports_go_down_the_layers()
    with pytest.raises(AssertionError, match="memsaving.graph -> memsaving.simulate -> memsaving.graph"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match="imports memsaving.graph._hidden"):
        test_no_private_name_crosses_a_module()
    with pytest.raises(AssertionError, match="memsaving.simulate:2 imports tensorflow"):
        test_planning_side_never_imports_tensorflow("sim")
