# Fresh machine: `make demo` or `make test` create .venv, install, and run.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test test-all bench lint docs install clean

$(BIN)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,test,docs,lint]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/memsaving demo

# one worker process per core (at most 4), each test file in one worker: half the wall time on 2 cores
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

test-all: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m ""

bench: $(BIN)/.installed
	$(BIN)/python -m experiments.bench_rewrite

# ruff on the whole repository, mypy on the TensorFlow-free layers (both configured in pyproject.toml)
lint: $(BIN)/.installed
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

docs: $(BIN)/.installed
	$(BIN)/python -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) *.egg-info site
