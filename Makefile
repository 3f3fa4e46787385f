# Fresh machine: `make demo` or `make test` create .venv, install, and run.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test test-all bench install clean

$(BIN)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,test]'
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

clean:
	rm -rf $(VENV) *.egg-info
