# The two commands a user needs: `make parity` and `make test`. Both set up .venv first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TF_KERAS := tf_keras==2.21.0
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: help install lint test parity bench

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z]+):.*## /  make \1\t/'

install: $(STAMP)  ## create .venv and install requirements.txt (once per change of it)

# tf_keras (legacy Keras 2) asks for the `tensorflow` package, which tensorflow-cpu provides: --no-deps.
$(STAMP): requirements.txt Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps $(TF_KERAS)
	touch $(STAMP)

lint: install  ## ruff check and ruff format --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install lint  ## set up, lint, then run every test
	$(PY) -m pytest -n 2 --dist loadgroup --durations=20

parity: install  ## set up, then the cross-framework parity report (exit 1 on any FAIL)
	$(PY) -m shared_tests.parity --keras tensorflow,jax,torch $(ARGS)

bench: install  ## set up, then the benchmark; writes bench/results.md (ARGS=--quick: a smoke run into out/bench_quick.md)
	$(PY) -m bench.benchmark $(ARGS)
