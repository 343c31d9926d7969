# Flywheel: `make run` sets everything up and starts the platform; `make test` runs the whole suite.
# Setup is idempotent: a stamp file remembers the last install and is renewed when pyproject.toml changes.

# Python 3.11 (pyproject.toml asks for it): python3.11 when it is on PATH, else python3 if that is 3.11.
PYTHON_SYSTEM ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flywheel-installed
TORCH := torch==2.13.0
# pytest-xdist processes; `make test N=0` runs in one process.
N ?= 2
PYTEST_ARGS ?=

.PHONY: setup run test bench fuzz lint

setup: $(STAMP)

$(STAMP): pyproject.toml client/pyproject.toml
	@$(PYTHON_SYSTEM) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
	  || { echo "make setup: needs Python 3.11; set PYTHON_SYSTEM=/path/to/python3.11"; exit 1; }
	@test -x $(PY) || $(PYTHON_SYSTEM) -m venv $(VENV)
	@# torch first and pinned, so that pip takes the CPU wheel on disk instead of a CUDA build.
	$(PY) -m pip install --quiet $(TORCH)
	@# The client (client/, import name flywheel_client, the `flywheel` command) is a package of its own.
	$(PY) -m pip install --quiet -e '.[dev]' -e ./client
	@touch $(STAMP)

run: setup
	$(PY) manage.py runlocal

test: setup
	@# Exit status 5 is pytest's "no tests collected": not a failure for an empty tree.
	@$(PY) -m pytest -n $(N) $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: no tests collected"; exit 0; fi; exit $$rc

bench: setup
	@set -e; found=0; for script in bench/*.py; do \
	  [ -e "$$script" ] || continue; found=1; \
	  echo "== $$script"; $(PY) "$$script"; \
	done; [ $$found -eq 1 ] || echo "make bench: no benchmarks in bench/"

# The fuzz tests with many more examples than the suite runs (FUZZ_EXAMPLES each), on the database the
# environment names. Run it on SQLite (DATABASE_URL unset: SQLite cannot bind an integer past 64 bits, which
# PostgreSQL compares) and on PostgreSQL (export DATABASE_URL and CELERY_BROKER_URL as CI does; the OTLP fuzz
# needs it and skips without).
FUZZ_EXAMPLES ?= 500
fuzz: setup
	FLYWHEEL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -n 0 --hypothesis-show-statistics \
	  tests/platform/trajectories/test_ingest_fuzz.py tests/platform/trajectories/test_otlp_fuzz.py \
	  tests/platform/test_api_schemathesis.py

lint: setup
	$(PY) -m ruff check .
