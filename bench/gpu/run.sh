#!/usr/bin/env bash
# GPU benchmark (H100/H200, ~20 minutes): bash bench/gpu/run.sh [--steps 40] [--only 1b-eager,...]
# Needs a CUDA build of torch with dtlaunch installed in it (`pip install -e .`); uses $PYTHON, else the
# repository's .venv when its torch sees a GPU, else python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PYTHON=.venv/bin/python
  fi
fi
"$PYTHON" -c 'import dtlaunch' 2>/dev/null || { echo "dtlaunch is not installed for $PYTHON: run '$PYTHON -m pip install -e .'" >&2; exit 2; }
"$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' || { echo "$PYTHON: torch sees no CUDA GPU" >&2; exit 2; }
exec "$PYTHON" bench/gpu/gpu_bench.py "$@"
