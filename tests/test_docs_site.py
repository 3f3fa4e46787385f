"""The documentation site's own code: the griffe extension that shows the
docstrings' Sphinx roles as inline code in the API reference."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _roles_module():
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("sphinx_roles", ROOT / "docs" / "hooks" / "sphinx_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_role_becomes_inline_code_and_the_rest_is_kept():
    as_code = _roles_module().as_code
    text = ("calls :func:`memsaving.fit_to_budget`; see :py:class:`~memsaving.fit_budget.Calibration`, "
            ":meth:`Plan.table`, :data:`memsaving.options.SHARED_DEFAULTS` and ``code`` as it was")
    assert as_code(text) == ("calls `memsaving.fit_to_budget`; see `Calibration`, `Plan.table`, "
                             "`memsaving.options.SHARED_DEFAULTS` and ``code`` as it was")


def test_the_extension_is_named_in_mkdocs_yml():
    assert "docs/hooks/sphinx_roles.py:SphinxRolesAsCode" in (ROOT / "mkdocs.yml").read_text()
