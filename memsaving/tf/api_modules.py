"""TensorFlow's API modules that hold ``gradients``, and their lookup cache.

Code written for the TF1 gradient-checkpointing package replaces
``tf.gradients`` with ``tf.__dict__["gradients"] = ...``, usually on
``import tensorflow.compat.v1 as tf``.  In TensorFlow 2 that module is a
``TFModuleWrapper`` whose attribute lookups go through a per-module cache
(a C "fastdict" filled by the first lookup of each name); a write into the
module's ``__dict__`` bypasses the cache, so once ``tf.gradients`` had been
read (``old = tf.gradients``, or any call) or set (``tf.gradients = f``)
the replacement was silently ignored.  :func:`stop_caching_gradients` makes
the wrappers read ``gradients`` from their ``__dict__`` on every lookup,
which makes that idiom work; every other name keeps TensorFlow's cache.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Dict, List, Tuple

from tensorflow.python.util import fast_module_type
from tensorflow.python.util.module_wrapper import TFModuleWrapper

API_PREFIXES = ("tensorflow.compat.", "tensorflow._api.")
"""Names of the modules that re-export TensorFlow's public API."""

OPTIMIZER_MODULE = "tensorflow.python.ops.gradients"
"""The module ``tf.compat.v1.train`` optimizers call ``gradients`` through."""

_FAST_MODULE_TYPE = fast_module_type.get_fast_module_type_class()
_NAME = "gradients"
# The wrappers' own assignment, which puts the name in the cache.
_TENSORFLOWS_SETATTR = TFModuleWrapper.__setattr__


def gradients_holders() -> List[Tuple[ModuleType, bool]]:
    """Loaded modules through which callers reach ``gradients``, each once.

    ``tensorflow`` itself, the API modules (``tensorflow.compat.v1``,
    TensorFlow's internal ``tensorflow._api.v2...`` copies) and the module
    TensorFlow's v1 optimizers call through, when they have a ``gradients``
    attribute; each with True when it is the v1 API (where
    ``tf.compat.v1.gradients`` belongs), False for the v2 API.
    """
    found: Dict[int, Tuple[ModuleType, bool]] = {}
    for name, module in list(sys.modules.items()):
        if module is None or id(module) in found or _NAME not in getattr(module, "__dict__", {}):
            continue
        if name == "tensorflow" or name == OPTIMIZER_MODULE or name.startswith(API_PREFIXES):
            found[id(module)] = (module, name == OPTIMIZER_MODULE or name.endswith(".compat.v1"))
    return list(found.values())


def stop_caching_gradients() -> None:
    """Make TensorFlow's module wrappers look ``gradients`` up in their ``__dict__``.

    A wrapper caches what a lookup returned through its
    ``_fastdict_insert`` method, and an assignment (``module.gradients =
    f``) caches ``f``.  The class's ``_fastdict_insert`` is replaced by one
    that leaves ``gradients`` out and its ``__setattr__`` by one that drops
    ``gradients`` afterwards; every loaded wrapper drops the ``gradients``
    it cached.  ``module.__dict__["gradients"] = f`` is then what the next
    ``module.gradients`` returns, in wrappers made later too (the first
    ``import tensorflow.compat.v1`` makes one).  Lookups themselves, and
    every other name, are TensorFlow's as before.  Plain modules
    (``tensorflow`` itself, ``tf.compat.v2``) read their ``__dict__``
    anyway.  Idempotent.

    Example
    -------
    >>> import tensorflow.compat.v1 as tf1
    >>> old = tf1.gradients
    >>> stop_caching_gradients()
    >>> tf1.__dict__["gradients"] = len
    >>> tf1.gradients is len
    True
    >>> tf1.__dict__["gradients"] = old
    """
    TFModuleWrapper._fastdict_insert = _insert_unless_gradients  # pylint: disable=protected-access
    TFModuleWrapper.__setattr__ = _setattr_without_caching_gradients
    for module in list(sys.modules.values()):
        if isinstance(module, TFModuleWrapper):
            _forget_gradients(module)


def _insert_unless_gradients(module: Any, name: str, value: Any) -> None:
    """TensorFlow's cache insertion, for every name but ``gradients``."""
    if name != _NAME:
        _FAST_MODULE_TYPE._fastdict_insert(module, name, value)  # pylint: disable=protected-access


def _setattr_without_caching_gradients(module: Any, name: str, value: Any) -> None:
    """The wrapper's own assignment, then ``gradients`` taken out of its cache."""
    _TENSORFLOWS_SETATTR(module, name, value)
    if name == _NAME:
        _forget_gradients(module)


def _forget_gradients(module: Any) -> None:
    """Remove ``gradients`` from a wrapper's lookup cache, if it is there."""
    if _FAST_MODULE_TYPE._fastdict_key_in(module, _NAME):  # pylint: disable=protected-access
        _FAST_MODULE_TYPE._fastdict_pop(module, _NAME)  # pylint: disable=protected-access
