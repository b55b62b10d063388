# singleton: `make test` sets up everything it needs (venv, Python deps, the Go-built
# control plane, PostgreSQL) and runs the linters and the whole test suite.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := sidecar testbed

.PHONY: test lint unit venv testbed testbed-up testbed-down clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

testbed: ## build (once) the control plane binaries from Go modules
	bash testbed/build.sh

lint: venv
	$(BIN)/ruff check $(PACKAGES) tests benchmarks
	$(BIN)/mypy

test: venv testbed lint
	$(BIN)/pytest -ra $(PYTEST_ARGS)

unit: venv ## fast tests that need no server
	$(BIN)/pytest -ra -m "not k8s and not postgres" $(PYTEST_ARGS)

testbed-up: venv testbed ## start PostgreSQL + control plane in the background
	$(BIN)/singleton-testbed up

testbed-down: venv
	$(BIN)/singleton-testbed down

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
