# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help venv test test-fast typecheck demo bench sql clean

help:
	@echo "make demo       run the narrated demo on an embedded PostgreSQL"
	@echo "make test       run the whole test suite (creates $(VENV) first)"
	@echo "make typecheck  mypy --strict over ledger/"
	@echo "make bench      run the benchmarks, numbers for BENCHMARKS.md"
	@echo "make sql        print the full install script for psql"

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,embedded]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q
	$(VENV)/bin/mypy --strict ledger

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not cluster" -x

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict ledger

demo: $(STAMP)
	$(VENV)/bin/jobledger demo

bench: $(STAMP)
	$(PY) benchmarks/run.py

sql: $(STAMP)
	@$(PY) -m ledger sql

clean:
	rm -rf $(VENV) build dist *.egg-info

-include Makefile.migrations
