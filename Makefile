# ftrec: `make run` and `make test` do all the set-up on a fresh machine.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORK    ?= work

.PHONY: setup run test bench clean

# Re-installs only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[airflow,test,bench]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m dataprep synth --out $(WORK)/run/events.txt --users 3000 --items 2000 --seed 0 --quiet
	$(BIN)/python -m dataprep shards --input $(WORK)/run/events.txt --format sasrec --out $(WORK)/run/shards --world-size 2 --batch-size 64 --max-len 50 --quiet
	$(BIN)/python -m training train --shards $(WORK)/run/shards --out $(WORK)/run/train

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: setup
	mkdir -p bench-results
	$(BIN)/python -m dataprep.bench
	$(BIN)/python -m training.bench
	$(BIN)/python -m ftcore.bench
	$(BIN)/python -m ftcore.sim
	$(BIN)/python -m training.comm.bench

clean:
	rm -rf $(WORK) bench-results
