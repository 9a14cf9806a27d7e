# Two commands for a newcomer: `make demo` and `make test`. Both build .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast lint clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml scripts/install.sh
	PY=$(PY) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

EXAMPLE ?= grpo

demo: $(STAMP)
	$(BIN)/python examples/$(EXAMPLE).py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check yatt_ray examples tests release
	$(BIN)/ruff format --check yatt_ray examples tests release
	$(BIN)/mypy yatt_ray

# the 30 slowest tests are listed at the end (CI keeps the tail of the output): where the suite's time goes
test: $(STAMP) lint
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# the tests that need no Ray cluster (under two minutes): for iteration; `make test` is what CI runs
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not cluster and not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
