# ftrec: `make run` and `make test` do all the set-up on a fresh machine.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORK    ?= work

.PHONY: setup run test lint bench clean gpu-wheels

# Re-installs only when pyproject.toml changed since the last install.
# ftrec_airflow moved to plugins/: a folder of bytecode git left at the top would be a namespace
# package that shadows the installed one; it is removed when it holds no .py file. A build in the
# checkout (pip wheel ., and pip install -e . itself) leaves ftrec.egg-info here: with the checkout on sys.path (python -m from
# it) that is a second ftrec distribution, whose entry point Airflow loads again ("already registered").
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	if [ -d ftrec_airflow ] && [ -z "$$(find ftrec_airflow -name '*.py' -print -quit)" ]; then rm -rf ftrec_airflow; fi
	rm -rf ftrec.egg-info
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[airflow,kubernetes,test,bench]'
	rm -rf ftrec.egg-info  # the editable build leaves it too; the install's metadata is in the venv
	touch $(STAMP)

setup: $(STAMP)

# make run's time box: 14 epochs (the trainer's default is 20), about 7 minutes end to end here
# with the model above the public state of the art on Beauty (BENCHMARKS.md); RUN_ARGS come after
MAKE_RUN_SETS = --set params.epochs=14

run: setup
	$(BIN)/python -m ftrec_airflow.local_run --work $(WORK) $(MAKE_RUN_SETS) $(RUN_ARGS)

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 tests

# ruff (lint, then the formatter's verdict) and mypy over the whole tree; settings in pyproject.toml.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Every benchmark lives in benchmarks/ (none in the library packages); the scale model runs as a module.
bench: setup
	mkdir -p bench-results
	$(BIN)/python benchmarks/dataprep_bench.py
	$(BIN)/python benchmarks/training_bench.py
	$(BIN)/python benchmarks/time_to_quality.py  # against the public state of the art: about 80 minutes
	$(BIN)/python benchmarks/ftcore_bench.py
	$(BIN)/python benchmarks/lighthouse_scale.py
	$(BIN)/python benchmarks/lighthouse_pause.py
	$(BIN)/python benchmarks/fail_slow.py
	$(BIN)/python benchmarks/fail_slow.py --scenario duty --seconds 30
	$(BIN)/python benchmarks/stall.py --partitions 8
	$(BIN)/python benchmarks/heal_size.py
	$(BIN)/python benchmarks/straggler.py
	$(BIN)/python benchmarks/lighthouse_abuse.py
	$(BIN)/python benchmarks/big_job.py
	$(BIN)/python benchmarks/preauth_flood.py
	$(BIN)/python benchmarks/lighthouse_soak.py
	$(BIN)/python benchmarks/partition.py
	$(BIN)/python benchmarks/torchrun_restart.py
	$(BIN)/python -m benchmarks.sim
	$(BIN)/python benchmarks/comm_bench.py
	$(BIN)/python benchmarks/comm_trainer_bench.py
	$(BIN)/python benchmarks/airflow_bench.py
	$(BIN)/python benchmarks/install_weight.py
	$(BIN)/python benchmarks/scale.py  # scale_dataprep.py and scale_training.py at their small sizes

# The wheels the offline GPU machine lacks (benchmarks/gpu_check_wheels.txt), for its Python
# (GPU_PY, 3.12) on manylinux x86-64, into GPU_WHEELS; then one device command runs the check:
# `bash benchmarks/gpu_check.sh "$$OUT"` (docs/cluster.md, "The GPU check"). Uses pip: after `make setup`.
GPU_PY      ?= 3.12
GPU_WHEELS  ?= gpu-wheels
gpu-wheels:
	$(BIN)/pip download -q --no-deps --only-binary=:all: --implementation cp --python-version $(GPU_PY) \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS) -r benchmarks/gpu_check_wheels.txt
	ls $(GPU_WHEELS)

clean:
	rm -rf $(WORK) bench-results
