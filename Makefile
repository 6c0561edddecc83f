# ftrec: `make run` and `make test` do all the set-up on a fresh machine.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORK    ?= work

.PHONY: setup run test lint bench clean

# Re-installs only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[airflow,kubernetes,test,bench]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m ftrec_airflow.local_run --work $(WORK) $(RUN_ARGS)

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# ruff (lint, then the formatter's verdict) and mypy over the whole tree; settings in pyproject.toml.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: setup
	mkdir -p bench-results
	$(BIN)/python -m dataprep.bench
	$(BIN)/python -m training.bench
	$(BIN)/python -m ftcore.bench
	$(BIN)/python benchmarks/lighthouse_scale.py
	$(BIN)/python benchmarks/lighthouse_pause.py
	$(BIN)/python benchmarks/fail_slow.py
	$(BIN)/python benchmarks/straggler.py
	$(BIN)/python benchmarks/lighthouse_abuse.py
	$(BIN)/python benchmarks/torchrun_restart.py
	$(BIN)/python -m ftcore.sim
	$(BIN)/python -m training.comm.bench
	$(BIN)/python -m training.comm.bench_trainer

clean:
	rm -rf $(WORK) bench-results
