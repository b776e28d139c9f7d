# The README's two commands: `make demo` and `make test`.  Each creates .venv if
# missing and installs into it; a stamp keyed on pyproject.toml keeps reruns fast.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install demo test lint typecheck pytest bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev,ray]'
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps tractor==0.1.0a5
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/omni-trio demo --model builtin:shapes --out demo-grid.png

lint: $(STAMP)
	$(BIN)/ruff check omni_trio tests property_tests scripts
	$(BIN)/ruff format --check omni_trio tests property_tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/omni-trio bench overhead

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache
