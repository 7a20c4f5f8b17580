# The commands: `make demo` (the main job), `make test` (lint, type check, the whole test suite) and
# `make test-fast` (the unit tier only: no processes or servers, under 30 s on pytest-xdist workers, one per
# core up to four; see tests/tiers.py).
# Both create .venv and install what they need. torch is pinned first so that pip takes the local
# CPU build instead of a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-fast lint typecheck venv dist clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile requirements/test-no-deps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,demo]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/test-no-deps.txt
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# PYTHONDONTWRITEBYTECODE is emptied for the tests: with it set (as on the project's machines), every run and every
# spawned rank compiles the sources and rewrites the test modules' asserts again (about 5 s of the unit tier).
test: lint typecheck
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest --durations=40

test-fast: $(STAMP)
	PYTHONDONTWRITEBYTECODE= RESHARD_FAST_TIER=1 $(BIN)/pytest -m unit -q -n auto --maxprocesses 4 --durations=0 --durations-min=1.0

demo: $(STAMP)
	$(BIN)/reshard demo --plot demo-loss.png

# The wheel to install into an existing training environment (README.md, "Install"); built from a clean
# build/ so that no module removed from src/ lingers in it.
dist: $(STAMP)
	rm -rf build dist
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w dist .
	@ls dist/*.whl

clean:
	rm -rf build dist $(VENV) .pytest_cache .mypy_cache .ruff_cache demo-checkpoint demo-loss.png
