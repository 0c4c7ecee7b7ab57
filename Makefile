# dtlaunch developer entry points. Everything runs inside .venv, created on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch from the local wheel cache; a plain `torch` would fetch a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install sky-venv demo test test-single test-multi test-fast lint format bench bench-gpu bench-gpu-memory bench-gpu-rehearse wheel-smoke clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The demo needs dtlaunch and its runtime dependencies only; `make install` adds the test tools.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)  ## train the embedded default: ~5M-param Llama, 2 gloo workers, Python stdlib text
	$(BIN)/dtlaunch train recipe=demo

# SkyPilot pins an older click than typer needs, so it gets a venv of its own; the tests that parse
# SkyPilot task YAML run its python (DTLAUNCH_SKY_PYTHON). Submitting calls the `sky` CLI the same way.
SKY_VENV ?= .venv-sky
SKY_STAMP := $(SKY_VENV)/.installed
sky-venv: $(SKY_STAMP)

$(SKY_STAMP):
	python3 -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install -q 'skypilot==0.14.1'
	touch $(SKY_STAMP)

# Tests run `dtlaunch` as a user does, so the venv's console script must be on PATH. `make test` runs two
# pytest sessions side by side, each printing when it ends: the multi-process layers (2-8 gloo processes per
# test, but only ~1.3 of 2 cores busy on average: start-up, rendezvous, checkpoint I/O) and, in the cores they
# leave idle, the single-process tests with one torch thread (unit, fuzz, the documented commands, mostly
# `plan`/`validate` in-process), then the tests named below. Measured on 2 cores: a multi-process sample
# 273 -> 305 s, a unit sample 270 -> 338 s, together 338 s instead of 543 s one after the other (issue #49).
# Both sessions run torch on one thread per process: the machine is saturated (98 % busy through `make test`), and
# the multi-process session's single-process references on 2 threads spun against the other session
# (tests/distributed/test_dpo_layouts.py beside one busy core: 141 CPU-s / 113 s with 2 threads, 117 / 95 with 1).
# Launched workers get launch.threads_per_worker's count either way; with TEST_WORKERS=N, conftest.py shares the cores.
# TEST_WORKERS=N runs the multi-process session on N pytest-xdist workers (machines with cores to spare).
TEST_WORKERS ?= 0
PYTEST_ENV = DTLAUNCH_SKY_PYTHON="$(abspath $(SKY_VENV))/bin/python" PATH="$(abspath $(BIN)):$$PATH"
# The single-process session ends with the system tests and the planner-accuracy runs (real 2-process runs whose
# measured peaks do not depend on the cores they get), so that both sessions end about together (CI, 2 cores:
# 20.4 and 27.9 min before these moved; 23.3 and 26.4 before test_fault_tolerance.py joined them, 30.6 and 32.6 on a
# busy machine before test_hub_cli.py did; 22.0 and 24.3 before test_kto_reward_resume.py and test_eval_cli.py did).
MOVED = tests/e2e/test_docs_commands.py tests/e2e/test_fault_tolerance.py tests/e2e/test_hub_cli.py \
	tests/e2e/test_kto_reward_resume.py tests/e2e/test_eval_cli.py \
	tests/distributed/test_plan_accuracy.py tests/distributed/test_offload_accuracy.py
SINGLE_TESTS = tests/unit tests/fuzz tests/system $(MOVED)
MULTI_TESTS = tests/distributed tests/e2e $(addprefix --ignore=,$(MOVED))
# Every test's seconds go to tests/durations.json (each session merges the test files it ran), and each session
# prints its layers' slowest tests and the stored sessions' wall time against the 30-minute goal
# (tests/durations_report.py).
DURATIONS ?= tests/durations.json
test: install $(SKY_STAMP)  ## the whole suite: unit, multi-process, end-to-end and system tests
	@$(MAKE) --no-print-directory -j2 -k --output-sync=target test-single test-multi

test-single: install $(SKY_STAMP)
	OMP_NUM_THREADS=1 $(PYTEST_ENV) $(BIN)/pytest -q --durations-file $(DURATIONS) \
		--durations-session single $(SINGLE_TESTS)

test-multi: install $(SKY_STAMP)
	$(if $(filter 0,$(TEST_WORKERS)),OMP_NUM_THREADS=1) $(PYTEST_ENV) $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations-file $(DURATIONS) \
		--durations-session multi $(MULTI_TESTS)

test-fast: install  ## unit tests only
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pytest -q tests/unit

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install  ## CPU benchmark suite (<= 15 min); results in bench/results/
	$(PY) bench/run_all.py

bench-gpu:  ## GPU benchmark (one or more CUDA GPUs, ~30 min); results in bench/results/gpu-<date>-<device>.*
	bash bench/gpu/run.sh

bench-gpu-memory:  ## memory features on one GPU vs their plans (peaks, tokens/s; < 8 min); results in bench/results/
	bash bench/gpu/run.sh --part memory

bench-gpu-rehearse: install  ## the GPU benchmark's every run on CPU at tiny shapes (no compile; ~5-10 min)
	PATH="$(abspath $(BIN)):$$PATH" bash bench/gpu/run.sh --rehearse

wheel-smoke:  ## build the wheel, install it in a fresh venv outside the checkout, run it from an empty dir
	TORCH_PIN=$(TORCH_PIN) .ci/wheel_smoke.sh

clean:
	rm -rf $(VENV) $(SKY_VENV) runs .pytest_cache .ruff_cache *.egg-info build dist
