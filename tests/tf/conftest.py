"""Fixtures of the TensorFlow-side tests.  Nothing is imported from
memsaving at the top: conftest files load before tests/conftest.py has
configured TensorFlow."""

import pytest


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private profile cache: each test starts cold."""
    from memsaving.tf import profiles

    monkeypatch.setenv("MEMSAVING_CACHE_DIR", str(tmp_path))
    profiles.CACHE.clear()
    yield tmp_path
    profiles.CACHE.clear()
