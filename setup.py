"""The optional C extension of treedecomp; the package's metadata is in pyproject.toml."""

from setuptools import Extension, setup

# treedecomp's inner loops in C (min-fill, elimination tree): optional, the
# Python code is the reference and runs when no compiler is available.
COMPILED = Extension("treedecomp._compiled", ["treedecomp/_compiled.c"], optional=True)

setup(ext_modules=[COMPILED])
