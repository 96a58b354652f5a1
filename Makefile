# rlgate: `make up` runs the local stack, `make test` installs what tests need and runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# buf comes with the dev extra (the buf-bin package); nothing here needs Node.js.
BUF := $(VENV)/bin/buf
# The virtualenv is reused while constraints.txt and pyproject.toml are unchanged.
DEPS_HASH := $(shell cat constraints.txt pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)
STAMP_SERVER := $(VENV)/.installed-server-$(DEPS_HASH)
STAMP_ALL := $(VENV)/.installed-all-$(DEPS_HASH)
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
PYTEST_ARGS ?=

.PHONY: up test lint proto proto-check buf bench bench-full reliability-full venv clean help

help:
	@echo "make up          run localfleet + orchestrator + toolgateway locally (embedded defaults)"
	@echo "make test        install test dependencies and run the whole suite"
	@echo "make lint        ruff, mypy, import contracts (lint-imports), buf lint"
	@echo "make proto       regenerate clients/python/rlgate/v1 from proto/"
	@echo "make bench       quick benchmarks (results in bench/results.json)"
	@echo "make bench-full  full-size benchmarks"
	@echo "make reliability-full  the reliability suite at full sizes"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip

$(STAMP_SERVER): constraints.txt pyproject.toml | $(PY)
	$(PIP) -e '.[server,rollout,local]'
	@touch $@

$(STAMP_ALL): constraints.txt pyproject.toml | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[server,rollout,local,skyrl,tinker,dev]'
	@rm -f $(VENV)/.installed-server-*; touch $@ $(STAMP_SERVER)

venv: $(STAMP_ALL)

up: $(STAMP_SERVER)
	$(VENV)/bin/rlgate up

test: $(STAMP_ALL)
	RLGATE_BUF=$(BUF) $(PY) -m pytest -q -p no:cacheprovider --durations=25 $(PYTEST_ARGS)

lint: $(STAMP_ALL)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py
	$(VENV)/bin/lint-imports --no-cache
	$(BUF) lint

proto: $(STAMP_ALL)
	$(PY) -m rlgate.devtools.protogen clients/python

bench: $(STAMP_ALL)
	$(PY) -m bench --quick

bench-full: $(STAMP_ALL)
	$(PY) -m bench --full

reliability-full: $(STAMP_ALL)
	RLGATE_FULL=1 $(PY) -m pytest -q -p no:cacheprovider -rxXs tests/reliability

clean:
	rm -rf $(VENV) build *.egg-info .rlgate
