# dtlaunch developer entry points. Everything runs inside .venv, created on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU build of torch from the local wheel cache; a plain `torch` would fetch a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test test-fast lint format bench bench-gpu bench-gpu-memory bench-gpu-rehearse wheel-smoke clean

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
$(SKY_STAMP):
	python3 -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install -q 'skypilot==0.14.1'
	touch $(SKY_STAMP)

# Tests run `dtlaunch` as a user does, so the venv's console script must be on PATH. The single-process
# layers (unit, fuzz) run on UNIT_WORKERS pytest-xdist workers, a test file each at a time (tests/conftest.py
# groups them): about 7 instead of 10 minutes on 2 cores. The multi-process layers already start 2-8
# processes per test and keep both cores busy, so they run serially (TEST_WORKERS=N to try workers there).
UNIT_WORKERS ?= 2
TEST_WORKERS ?= 0
PYTEST_ENV = DTLAUNCH_SKY_PYTHON="$(abspath $(SKY_VENV))/bin/python" PATH="$(abspath $(BIN)):$$PATH"
# Every test's seconds go to tests/durations.json (the layers each session ran replaced), and each session
# prints its layers' slowest tests and the total against the 30-minute goal (tests/durations_report.py).
DURATIONS ?= tests/durations.json
test: install $(SKY_STAMP)  ## the whole suite: unit, multi-process, end-to-end and system tests
	$(PYTEST_ENV) $(BIN)/pytest -q -n $(UNIT_WORKERS) --dist loadgroup --durations-file $(DURATIONS) \
		tests/unit tests/fuzz
	$(PYTEST_ENV) $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations-file $(DURATIONS) \
		tests/distributed tests/e2e tests/system

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
