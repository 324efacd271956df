# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help venv test test-fast test-field typecheck demo bench bench-smoke sql docs sync sync-check clean
.PHONY: test-matrix test-matrix-ci pg-binaries

help:
	@echo "make demo       run the narrated demo on an embedded PostgreSQL"
	@echo "make test       mypy and the test suite in parallel, field and chaos aside (creates $(VENV) first; TEST_WORKERS=4)"
	@echo "make test-field the field and chaos suites: PgBouncer, pg_cron, pg_auto_failover, crashes, clocks"
	@echo "make typecheck  mypy --strict over ledger/"
	@echo "make bench      benchmarks side by side with the raw SQL floor, into BENCHMARKS.md (minutes;"
	@echo "                BENCH_DURATION=10 s per pgbench side, BENCH_ROUNDS=2, BENCH_JOBS=10000)"
	@echo "make bench-smoke  the benchmark harness in seconds: every script runs; no timing, writes nothing"
	@echo "make sql        print the full install script for psql"
	@echo "make sync       write the sync client and its tests from their async sources (tools/async_to_sync.py)"
	@echo "make docs       build the documentation site into site/ (mkdocs build --strict)"
	@echo "make test-matrix     the SQL tests on PostgreSQL 13 to 18; writes docs/support.md"
	@echo "make test-matrix-ci  the same on the oldest and the newest (13, 18), as CI runs it"
	@echo "make test-drivers     the examples/ of every client stack, directly and behind PgBouncer"

venv: $(STAMP)

$(STAMP): pyproject.toml ledger/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,embedded]'
	touch $(STAMP)

# mypy and pytest both run, whatever the first says; the target fails if either did.
# The tests run in parallel (pytest-xdist): most of their time is spent waiting (for a
# lease to expire, a cluster to promote, a subprocess), so more workers than cores pay.
# A file runs whole on one worker (--dist loadfile), the slowest files first
# (--no-loadscope-reorder keeps the order of SLOW_FIRST in tests/conftest.py).
# The last line is the skip summary (tests/conftest.py); a failure adds one after it.
TEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# Their own targets: make test-field (field and chaos), make test-drivers (examples/).
FIELD_AND_DRIVERS := --ignore=tests/field --ignore=tests/chaos --ignore=tests/drivers

test: $(STAMP)
	@pytest_status=0; mypy_status=0; \
	$(VENV)/bin/mypy --strict ledger || mypy_status=$$?; \
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(FIELD_AND_DRIVERS) || pytest_status=$$?; \
	if [ $$pytest_status -ne 0 ] || [ $$mypy_status -ne 0 ]; then \
		echo "make test: pytest exit $$pytest_status, mypy exit $$mypy_status"; exit 1; fi

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not cluster" -x $(PYTEST_PARALLEL) $(FIELD_AND_DRIVERS)

# Where users run it (tests/field: PgBouncer, pg_cron, pg_auto_failover, crashes, skewed clocks,
# the Node.js example) and the chaos suite: real daemons and clusters, minutes of waiting. CI runs
# it after make test; the default suite stays under 8 minutes without it.
test-field: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) tests/field tests/chaos

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict ledger

demo: $(STAMP)
	$(VENV)/bin/jobledger demo

# The benchmarks (benchmarks/run.py): pgbench side by side with the raw SQL
# floor, the Python client, references; the `bench` extra (redis, matplotlib)
# into $(VENV) when it is missing. bench-smoke checks the harness only.
BENCH_DURATION ?= 10
BENCH_ROUNDS   ?= 2
BENCH_JOBS     ?= 10000

bench: $(STAMP)
	@$(PY) -c "import redis, matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/run.py --duration $(BENCH_DURATION) --rounds $(BENCH_ROUNDS) --jobs $(BENCH_JOBS)

bench-smoke: $(STAMP)
	$(PY) benchmarks/run.py --smoke
	$(PY) benchmarks/bench_client.py --smoke > /dev/null

sql: $(STAMP)
	@$(PY) -m ledger sql

# The sync client is generated from the async one (tools/async_to_sync.py);
# tests/release/test_generated.py, and so `make test`, fails when it is stale.
sync:
	$(PYTHON) tools/async_to_sync.py

sync-check:
	$(PYTHON) tools/async_to_sync.py --check

# The documentation site (mkdocs.yml, docs/): the `docs` extra into $(VENV) when
# it is missing, then a strict build (a broken link or anchor fails it).
docs: $(STAMP)
	@$(PY) -c "import mkdocs, material, mkdocs_include_markdown_plugin" 2>/dev/null \
		|| $(PY) -m pip install --quiet -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

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
-include Makefile.package
-include Makefile.drivers
