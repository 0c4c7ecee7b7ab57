#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels bench/gpu/run.sh installs on a GPU machine that has a CUDA torch
# but no network and none of these: hydra-core, omegaconf and antlr4 (dtlaunch's config stack; antlr4
# 4.9.3 is published as a source archive only, so its pure-Python wheel is built here) and torchao (the
# float8 runs; its float8 training is Python on torch's own kernels). Run where pip reaches a registry:
#     bash bench/gpu/wheels.sh        # then carry .whl/ to the GPU machine with the checkout
# Versions: those dtlaunch is tested with; the GPU image's Python is 3.12 on x86-64 (override with PY_VERSION).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION="${PY_VERSION:-3.12}"
PIP=(python3 -m pip)
[[ -x .venv/bin/python ]] && PIP=(.venv/bin/python -m pip)
mkdir -p .whl
rm -f .whl/*.whl
"${PIP[@]}" download -q --no-deps --only-binary=:all: -d .whl \
  hydra-core==1.3.8 omegaconf==2.3.1
"${PIP[@]}" wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
"${PIP[@]}" download -q --no-deps --only-binary=:all: -d .whl --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 torchao==0.18.0 tokenizers==0.23.3
ls -l .whl
