"""A griffe extension for the API reference: Sphinx roles as code.

The docstrings are numpydoc, read in a terminal and by ``help()`` as well
as on the site, and they name other objects with Sphinx roles
(``:func:`memsaving.fit_to_budget```).  mkdocstrings renders Markdown, where
a role is not markup and came out literally, colons and backquotes
included.  This extension rewrites each role to inline code
(`` `memsaving.fit_to_budget` ``; ``~a.b.c`` to `` `c` ``, as Sphinx shows
it) on every object griffe loads, before the docstring is parsed, so the
source keeps the form the other readers expect.  mkdocs.yml names this
file under the handler's ``extensions``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|term|ref):`(~?)([^`]+)`")
"""A Sphinx role and its target (``~`` first: show the last dotted part only)."""


def as_code(text: str) -> str:
    """``text`` with every Sphinx role written as inline code.

    Examples
    --------
    >>> as_code("see :func:`memsaving.fit_to_budget` and :class:`~memsaving.fit_budget.Calibration`")
    'see `memsaving.fit_to_budget` and `Calibration`'
    """
    return ROLE.sub(lambda match: f"`{match.group(2).rsplit('.', 1)[-1] if match.group(1) else match.group(2)}`",
                    text)


class SphinxRolesAsCode(griffe.Extension):
    """Rewrite the roles of each loaded object's docstring (:func:`as_code`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = as_code(obj.docstring.value)
