#!/usr/bin/env bash
# GPU benchmark: bash bench/gpu/run.sh [gpu_bench.py options: --part 1 --budget-s 480 --results-dir DIR ...]
# Memory features on one GPU (< 8 minutes, start-up included): bash bench/gpu/run.sh --part memory
#
# Runs on a machine whose python3 has a CUDA build of torch and nothing of ours: a bare GPU machine with
# no network gets a copy of the checkout, not our .venv. What dtlaunch needs beyond such an image
# (hydra-core, omegaconf, antlr4; torchao for the float8 runs, tokenizers for the GRPO runs) comes as
# wheels in .whl/ (made where a package registry is reachable by `bash bench/gpu/wheels.sh`), installed
# into a private directory on PYTHONPATH so the image's own environment stays as it is; dtlaunch itself
# runs from the checkout when it is not installed. --rehearse and --dry-run run on CPU with the repository's .venv.
# Interpreter: $PYTHON, else .venv/bin/python when its torch sees a GPU (or on CPU for --rehearse /
# --dry-run), else python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

cpu_only=0
for arg in "$@"; do
  case "$arg" in --rehearse | --dry-run | --merge) cpu_only=1 ;; esac
done

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  if [[ -x .venv/bin/python ]]; then
    if ((cpu_only)) || .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      PYTHON=.venv/bin/python
    fi
  fi
fi

missing() {
  "$PYTHON" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

site="${DTLAUNCH_GPU_SITE:-/tmp/dtlaunch-gpu-site}"
if [[ -d "$site" ]]; then
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
need=$(missing hydra omegaconf antlr4 torchao tokenizers)
if [[ -n "$need" ]] && compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing carried wheels for: $need (into $site)"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
    --target "$site" .whl/*.whl
  [[ ":${PYTHONPATH:-}:" == *":$site:"* ]] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  need=$(missing hydra omegaconf antlr4 torchao tokenizers)
fi
case " $need " in
  *" hydra "* | *" omegaconf "* | *" antlr4 "*)
    echo "$PYTHON lacks $need: run 'bash bench/gpu/wheels.sh' where a package registry is reachable and bring .whl/ along" >&2
    exit 2
    ;;
esac
[[ " $need " == *" torchao "* ]] && echo "torchao is not installed: the float8 runs will be skipped" >&2
[[ " $need " == *" tokenizers "* ]] && echo "tokenizers is not installed: the GRPO runs will be skipped" >&2

# Importable from anywhere, not just from this directory: the hand-written loop runs as a script from bench/.
if ! "$PYTHON" -c 'import sys; sys.path.pop(0); import dtlaunch' 2>/dev/null; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # the checkout; the bench runs `python -m dtlaunch`
fi
if ((!cpu_only)); then
  "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' ||
    { echo "$PYTHON: torch sees no CUDA GPU (on CPU: bash bench/gpu/run.sh --rehearse)" >&2; exit 2; }
fi
exec "$PYTHON" bench/gpu/gpu_bench.py "$@"
