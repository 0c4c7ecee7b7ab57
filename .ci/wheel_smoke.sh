#!/usr/bin/env bash
# Wheel smoke test: build the wheel, install it as a user would (with its dependencies, from the package
# registry) into a fresh virtual environment outside the checkout, and use it from an empty directory.
# This catches what the editable install hides: package data left out of the wheel, paths relative to
# the source tree, files that should not ship (tests, run outputs, benchmark results).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
# CPU build of torch (the same pin as the Makefile): a plain `torch` would fetch a multi-GB CUDA build.
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dtlaunch-wheel-smoke.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "wheel-smoke: FAILED: $*" >&2; exit 1; }
step() { echo "wheel-smoke: $*"; }

step "building the wheel"
# From a copy of the working tree: setuptools writes build/ and *.egg-info next to the sources. The top-level
# entries are named one by one (not "."): CI installs the venvs beside this, which changes the checkout's root
# (and its *.egg-info) while it is read.
mkdir "$WORK/src"
entries=()
for path in "$REPO"/.[!.]* "$REPO"/*; do
  name=$(basename "$path")
  case "$name" in .venv* | .git | runs | build | *.egg-info | .pytest_cache | .ruff_cache | .hypothesis) continue ;; esac
  [ -e "$path" ] && entries+=("$name")
done
tar -C "$REPO" -cf - "${entries[@]}" | tar -C "$WORK/src" -xf -
"$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WORK/dist" "$WORK/src" >/dev/null
WHEEL=$(ls "$WORK"/dist/dtlaunch-*.whl)

step "checking the wheel's file list ($(basename "$WHEEL"))"
"$PYTHON" - "$WHEEL" <<'EOF' || fail "the wheel's contents are wrong (above)"
import sys, zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if not (n.startswith("dtlaunch/") or ".dist-info/" in n)]
bad += [n for n in names if any(part in n.split("/") for part in ("tests", "bench", "runs", "results", "__pycache__"))]
bad += [n for n in names if n.endswith((".pyc", ".jsonl", ".png", ".pt", ".distcp"))]
for n in bad:
    print(f"  must not ship: {n}", file=sys.stderr)
needed = ["dtlaunch/configs/job.yaml", "dtlaunch/recipes/demo.yaml", "dtlaunch/recipes/llama405b_3d.yaml"]
for n in needed:
    if n not in names:
        print(f"  missing: {n}", file=sys.stderr)
if not any(n.startswith("dtlaunch/configs/model/") for n in names):
    print("  missing: dtlaunch/configs/model/*.yaml", file=sys.stderr)
    bad.append("configs")
sys.exit(1 if bad or any(n not in names for n in needed) else 0)
EOF

step "installing $TORCH_PIN and the wheel into a fresh venv under $WORK"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$TORCH_PIN" "$WHEEL" || fail "pip install of the wheel"
"$WORK/venv/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'"

# An empty directory: nothing of the checkout is reachable from here (not on sys.path, not the cwd).
mkdir "$WORK/empty"
cd "$WORK/empty"
export PATH="$WORK/venv/bin:$PATH" DTLAUNCH_PROGRESS=plain
unset PYTHONPATH DTLAUNCH_RECIPE_PATH || true
[ "$(command -v dtlaunch)" = "$WORK/venv/bin/dtlaunch" ] || fail "dtlaunch is not the wheel's console script"
"$WORK/venv/bin/python" -c "import dtlaunch, sys; sys.exit(dtlaunch.__file__.startswith('$REPO'))" \
  || fail "dtlaunch was imported from the checkout, not the wheel"

run() { step "\$ $*"; "$@" || fail "'$*' exited $?"; }
want="dtlaunch $(cd "$REPO" && "$PYTHON" -c 'import dtlaunch; print(dtlaunch.__version__)')"
got=$(dtlaunch --version) || fail "dtlaunch --version"
[ "$got" = "$want" ] || fail "--version says '$got', the package says '$want'"
step "\$ dtlaunch --version -> $got"
out=$(COLUMNS=100 dtlaunch recipes) || fail "dtlaunch recipes"
echo "$out"
for name in demo llama8b_fsdp llama405b_3d tiny_ddp; do
  grep -q "$name" <<<"$out" || fail "dtlaunch recipes does not list '$name'"
done
run dtlaunch validate recipe=llama8b_fsdp
run dtlaunch plan recipe=llama405b_3d
run dtlaunch train recipe=demo training.steps=4 training.loss_plot=false run.root="$WORK/empty/runs"
summary=$(ls "$WORK"/empty/runs/demo-*/summary.json) || fail "the demo run wrote no summary.json"
"$WORK/venv/bin/python" -c "import json,sys; s=json.load(open(sys.argv[1])); assert s['final_step']==4, s" "$summary" \
  || fail "the demo run did not reach step 4"
step "passed"
