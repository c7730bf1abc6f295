# Two set-up commands: `make demo` and `make test`. Each creates .venv if absent and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-docs docs lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/clozax demo --out runs/demo

# pytest-xdist workers (tests/README.md: two on 2 cores, each test file on one worker)
TEST_WORKERS ?= 2

test: $(STAMP)  # everything but the docs run: CI's command and the README's
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not docs_run"

test-docs: $(STAMP)  # every block of the tutorials and how-to pages, as written (CI runs it too)
	$(BIN)/python -m pytest -m docs_run tests/test_docs_run.py

test-fast: $(STAMP)  # the edit-test loop: the pure-function tier, under 3 minutes
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "fast and not slow"

docs: $(STAMP)  # the documentation site, into site/ (--strict: a broken link or reference fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
