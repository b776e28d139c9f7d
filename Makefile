# The README's commands: `make demo`, `make test` and, for contributors, `make test-fast`.
# Each creates .venv if missing and installs into it.  One venv, two stamps keyed on
# pyproject.toml: the runtime (`pip install -e .`, all `make demo` needs) and, on top of it,
# the dev and ray extras (`make test`, `make test-fast`, lint, typecheck).  A stamp is made
# only after its install succeeded; a changed pyproject.toml installs both again.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
KEY := $(shell cksum pyproject.toml | cut -d' ' -f1)
RUNTIME_STAMP := $(VENV)/.installed-runtime-$(KEY)
DEV_STAMP := $(VENV)/.installed-dev-$(KEY)
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install install-runtime bytecode demo test test-fast lint typecheck pytest bench clean

install-runtime: $(RUNTIME_STAMP)

install: $(DEV_STAMP)

$(RUNTIME_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	$(PIP) --no-deps tractor==0.1.0a5
	rm -f $(VENV)/.installed-runtime-* $(VENV)/.installed-[0-9]*
	touch $@

$(DEV_STAMP): $(RUNTIME_STAMP)
	$(PIP) -e '.[dev,ray]'
	rm -f $(VENV)/.installed-dev-*
	touch $@

# omni_trio's bytecode, compiled ahead (an up-to-date tree takes a tenth of a second): where
# Python writes none (PYTHONDONTWRITEBYTECODE, a read-only checkout) every process of a
# daemon (the CLI, its fork server, a stage process) would compile the package's ~200 modules
# from source again, 0.1-0.2 s each on the way to the first answer.
bytecode: $(RUNTIME_STAMP)
	@$(BIN)/python -m compileall -q omni_trio >/dev/null 2>&1 || \
		echo "omni_trio's bytecode not written here (read-only?): every process compiles it"

demo: $(RUNTIME_STAMP) bytecode
	$(BIN)/omni-trio demo --model builtin:shapes --out demo-grid.png

lint: $(DEV_STAMP)
	$(BIN)/ruff check omni_trio tests property_tests scripts
	$(BIN)/ruff format --check omni_trio tests property_tests scripts

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

pytest: $(DEV_STAMP) bytecode
	$(BIN)/python -m pytest -p no:cacheprovider

# The whole suite: lint, types, every test (tests/ and property_tests/).
test: lint typecheck pytest

# The inner loop: every test not marked slow, so none that starts a process
# (tests/spawn_guard.py fails an unmarked one that does), and a few Hypothesis examples.
test-fast: $(DEV_STAMP) bytecode
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -p no:cacheprovider -q -m "not slow"

bench: $(RUNTIME_STAMP) bytecode
	$(BIN)/omni-trio bench overhead

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache
