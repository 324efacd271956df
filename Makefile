# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help venv test test-fast typecheck demo bench sql clean
.PHONY: test-matrix test-matrix-ci pg-binaries

help:
	@echo "make demo       run the narrated demo on an embedded PostgreSQL"
	@echo "make test       run the whole test suite (creates $(VENV) first)"
	@echo "make typecheck  mypy --strict over ledger/"
	@echo "make bench      run the benchmarks, numbers for BENCHMARKS.md"
	@echo "make sql        print the full install script for psql"
	@echo "make test-matrix     the SQL tests on PostgreSQL 13 to 18; writes docs/support.md"
	@echo "make test-matrix-ci  the same on the oldest and the newest (13, 18), as CI runs it"

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,embedded]'
	touch $(STAMP)

# pytest and mypy both run, whatever the first says; the target fails if either did.
test: $(STAMP)
	@pytest_status=0; mypy_status=0; \
	$(PY) -m pytest -q || pytest_status=$$?; \
	$(VENV)/bin/mypy --strict ledger || mypy_status=$$?; \
	echo "make test: pytest exit $$pytest_status, mypy exit $$mypy_status"; \
	[ $$pytest_status -eq 0 ] && [ $$mypy_status -eq 0 ]

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

# PostgreSQL 13 to 18 (docs/support.md). Server binaries: tools/pg_binaries.py,
# cached in .pg/<major>/; one version after another. PG_VERSIONS to choose.
PG_VERSIONS ?= 13 14 15 16 17 18
PG_VERSIONS_CI ?= 13 18

test-matrix: $(STAMP)
	$(PY) tests/matrix.py --write-docs $(PG_VERSIONS)

test-matrix-ci: $(STAMP)
	$(PY) tests/matrix.py $(PG_VERSIONS_CI)

pg-binaries:
	@for v in $(PG_VERSIONS); do $(PYTHON) tools/pg_binaries.py $$v; done

clean:
	rm -rf $(VENV) build dist *.egg-info

-include Makefile.migrations
