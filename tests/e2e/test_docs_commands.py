"""Every `dtlaunch ...` command in README.md and docs/*.md, run where it can run here, and checked.

What runs, as written, in this process (the console entry point, as tests/fuzz drive it): `plan`,
`validate`, `config`, `recipes`, `status`, `--help`, anything with `--dry-run`, and the `ckpt` /
`generate` commands over the runs the tiny stand-ins made. `train` and `submit` without `--dry-run` run
with it (compose, validate, plan: the part that does not need the GPUs or the cluster the text names). A
command marked `<!-- docs-test: tiny ARGS -->` also trains for real: `dtlaunch train ARGS` in a subprocess,
which must write the files the marker names. Checked: the exit code the text implies, every number it
quotes from the output, the files. What cannot run here is skipped with its reason; the last test prints
the count. Markers and extraction: tests/e2e/docs_commands.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_in_process import run_cli  # noqa: E402
from cli_server import run_dtlaunch
from docs_commands import DocCommand, all_commands  # noqa: E402

COMMANDS = all_commands()
OUTCOMES: Counter = Counter()
SKIP_REASONS: Counter = Counter()

# Guides other branches add; the README and docs/README.md link them already.
PENDING_PAGES: set[str] = set()

# A bare command name in prose is a mention, not an invocation.
MENTIONS = {"train", "submit", "plan", "validate", "eval", "download", "data", "debug", "ckpt", "generate", "report"}
# Override keys and options whose value is a file or directory the user brings.
PATH_KEYS = (
    "data.path",
    "data.val_path",
    "data.tokenizer",
    "data.chat_template",
    "checkpoint.load_path",
    "objective.reference",
    "model.init_from",
    "training.eval_include",
    "recipe",
)
PATH_OPTIONS = {"--include", "--adapter", "--tokenizer"}
NOT_PATHS = {"auto", "byte", "base", "chatml", "qwen", "llama3", "mistral", ""}
POSITIONAL_PATHS = {"ckpt", "generate", "eval", "report", "status", "debug", "data"}
# The documents' `hf:/models/NAME` directories: here each holds only its config.json (planning reads
# nothing else, the docs say), written from the model group of the same published architecture.
MODEL_DIRS = {
    "Qwen3-8B": "qwen3_8b",
    "Qwen3-0.6B": "qwen3_0.6b",
    "Qwen2.5-0.5B": "qwen2.5_0.5b",
    "Llama-3.1-8B": "llama3_8b",
    "Llama-3.1-8B-Instruct": "llama3_8b",
    "Meta-Llama-3-8B": "llama3_8b",
}
# Documented commands (by their text) that fail today only because of a bug being fixed on another
# branch: run, and expected to fail until that fix lands (strict: an unexpected pass fails, saying to
# delete the entry).
AWAITING_FIX: dict[str, str] = {
    "dtlaunch train recipe=tiny_tp model.arch=hf_auto model.init_from=hf:/models/Qwen3-0.6B strategy.tp=2 "
    "strategy.sequence_parallel=false": "model.arch=hf_auto: --dry-run of a config.json-only directory asks for "
    "the weights (tensor model.embed_tokens.weight is missing)",
}


def _value_path(value: str) -> str:
    return value[3:] if value.startswith("hf:") else value


def why_not_here(cmd: DocCommand, cwd: Path) -> str | None:
    """The reason a command cannot run here as written, or None."""
    if cmd.marker_value("skip") is not None:
        return cmd.marker_value("skip")
    argv = cmd.argv
    for entry in cmd.env.get("PYTHONPATH", "").split(":"):
        if entry and not (cwd / entry).exists():
            return f"needs the user's {entry}"
    if not argv:
        return "not a command line (unbalanced quotes)"
    words = " ".join(argv)
    if re.search(r"(^|\s)\[|<|\.\.\.|\\\|", words) or any(
        re.search(r"(^|[=:])[A-Z][A-Z0-9_]*(,|$)", a) or re.fullmatch(r"[A-Z][A-Z0-9_]*=.*", a) for a in argv
    ):
        return "a synopsis with placeholders"
    if any(re.fullmatch(r"[a-z]+(/[a-z]+)+", a) for a in argv):  # `ckpt ls/inspect/verify/export`
        return "a synopsis with placeholders"
    if len(argv) == 1 and argv[0] in MENTIONS or argv == ["data", "prepare"]:
        return "names the command (no arguments)"
    if argv[0] == "--install-completion":
        return "changes the user's shell start-up files"
    if argv[0] == "--show-completion":
        # The script is for the shell it detects among its parent processes: under `make`'s /bin/sh it has none.
        return "prints the completion script of the user's own shell"
    if argv[0] == "download":
        return "downloads from the Hugging Face Hub"
    if argv[0] == "eval" and "--include" not in argv:
        return "lm-eval's own tasks read their datasets from the Hugging Face Hub"
    for i, a in enumerate(argv):
        key, _, value = a.partition("=")
        if key in PATH_KEYS and value not in NOT_PATHS and not value.startswith(("hf:auto",)):
            if key == "recipe" and not value.startswith((".", "/")):
                continue
            path = _value_path(value)
            if value.startswith("hf:") and not path.startswith((".", "/")) and path.count("/") == 1:
                if not (cwd / path).exists():
                    return "a model from the Hugging Face Hub"
            if "*" not in path and not (cwd / path).exists() or "*" in path and not list(cwd.glob(path)):
                return f"needs the user's {path}"
        if key == "data.kind" and value == "hf":
            return "a dataset from the Hugging Face Hub"
        if a in PATH_OPTIONS and i + 1 < len(argv) and not (cwd / argv[i + 1]).exists():
            return f"needs the user's {argv[i + 1]}"
        if a.startswith("$") or "$" in value:
            return "runs inside a cluster's job (node rank and address from its environment)"
    if argv[0] in POSITIONAL_PATHS and len(argv) > 1:
        first = argv[2] if argv[0] in ("ckpt", "data") and len(argv) > 2 else argv[1]
        if argv[0] == "status" and first.startswith("-"):
            first = ""
        hub = first.startswith("hf:") and not first[3:].startswith((".", "/")) and first.count("/") == 1
        if hub and not (cwd / first[3:]).exists():
            return "a model from the Hugging Face Hub"
        if first and not first.startswith("-") and not (cwd / _value_path(first)).exists():
            return f"needs {first} (a run or file of the user's, or of an earlier command)"
    if any(k.startswith("launch.rdzv_endpoint=") for k in argv) and "--dry-run" not in argv:
        return "needs a second machine at the rendezvous address"
    return None


def argv_to_run(cmd: DocCommand) -> list[str]:
    """What runs here: the command as written, with `--dry-run` for `train` and `submit`, shell
    redirections dropped."""
    argv = list(cmd.argv)
    for stop in (">", "|"):
        if stop in argv:
            argv = argv[: argv.index(stop)]
    if argv and argv[0] in ("train", "submit") and "--dry-run" not in argv and "--cfg" not in argv:
        argv.append("--dry-run")
    return argv


def run_in_process(argv: list[str], cwd: Path, python_path: str = "") -> tuple[int, str]:
    return run_cli(argv, cwd, [str(cwd / p) for p in python_path.split(":") if p], stdout=True)


@pytest.fixture(scope="session")
def docs_cwd(tmp_path_factory) -> Path:
    """One scratch directory for the whole document walk: the runs the tiny stand-ins make are there for
    the `ckpt` / `generate` commands that follow them in the text; models/ holds the MODEL_DIRS."""
    from dtlaunch.commands.common import load_job
    from dtlaunch.convert.hf import hf_config

    cwd = tmp_path_factory.mktemp("docs-cwd")
    for name, group in MODEL_DIRS.items():
        (cwd / "models" / name).mkdir(parents=True)
        config = hf_config(load_job([f"model={group}"]).cfg.model, "bfloat16")
        (cwd / "models" / name / "config.json").write_text(json.dumps(config))
    return cwd


def localize(cmd: DocCommand, cwd: Path) -> DocCommand:
    """`hf:/models/NAME` read as the scratch directory's models/NAME."""
    argv = [a.replace("hf:/models/", f"hf:{cwd}/models/") for a in cmd.argv]
    return dataclasses.replace(cmd, argv=argv)


@pytest.fixture(scope="session", autouse=True)
def _wide_tables():
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"  # table cells unwrapped, so quoted numbers appear whole
    yield
    if old is None:
        os.environ.pop("COLUMNS")
    else:
        os.environ["COLUMNS"] = old


def train_tiny(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        COLUMNS="200",
        DTLAUNCH_PROGRESS="plain",
        DTLAUNCH_DATA_CACHE=str(cwd / "token-cache"),
    )
    return run_dtlaunch(["train", *args], cwd=cwd, env=env, timeout=300)


def newest_run(cwd: Path, args: list[str]) -> Path:
    for a in args:
        if a.startswith("run.name="):
            return cwd / "runs" / a.split("=", 1)[1]
    return max((cwd / "runs").iterdir(), key=lambda p: p.stat().st_mtime)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(cmd: DocCommand, docs_cwd: Path, request: pytest.FixtureRequest) -> None:
    OUTCOMES["found"] += 1
    for name, text in cmd.files.items():
        (docs_cwd / name).write_text(text)
    cmd = localize(cmd, docs_cwd)
    reason = why_not_here(cmd, docs_cwd)
    tiny = cmd.marker_value("tiny")
    if reason is not None and tiny is None:
        OUTCOMES["skipped"] += 1
        SKIP_REASONS[reason.split(" (")[0] if reason.startswith("needs") else reason] += 1
        pytest.skip(reason)
    OUTCOMES["run"] += 1
    if cmd.text in AWAITING_FIX:
        request.applymarker(pytest.mark.xfail(reason=AWAITING_FIX[cmd.text], strict=True))
    if reason is None:
        argv = argv_to_run(cmd)
        code, out = run_in_process(argv, docs_cwd, cmd.env.get("PYTHONPATH", ""))
        expected = cmd.expected_exit()
        assert code == expected, (
            f"{cmd.id}: `dtlaunch {' '.join(argv)}` exited {code}, the text implies {expected}:\n{out[-3000:]}"
        )
        missing = [n for n in cmd.quoted_numbers() if n not in out]
        assert not missing, (
            f"{cmd.id}: the text quotes {missing}, the output of `dtlaunch {' '.join(argv)}` has not:\n{out[-4000:]}"
        )
        shows = cmd.marker_value("shows")
        assert shows is None or shows in " ".join(out.split()), (
            f"{cmd.id}: the text says the output shows {shows!r}:\n{out[-4000:]}"
        )
    if tiny is not None:
        words = tiny.split()
        files = [w.split("=", 1)[1].split(",") for w in words if w.startswith("files=")]
        args = [w for w in words if not w.startswith("files=")]
        proc = train_tiny(args, docs_cwd)
        assert proc.returncode == 0, (
            f"{cmd.id}: stand-in `dtlaunch train {tiny}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
        run_dir = newest_run(docs_cwd, args)
        absent = [f for f in (files[0] if files else []) if not (run_dir / f).exists()]
        assert not absent, f"{cmd.id}: the text says a run writes {absent}; {run_dir} has {sorted(os.listdir(run_dir))}"
    OUTCOMES["checked"] += 1


def test_links_resolve() -> None:
    """Every relative link in README.md and docs/*.md names a file that exists (the three pending guides
    aside, until their branches land)."""
    from docs_commands import doc_files

    broken = []
    for f in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (f.parent / target).resolve()
            rel = os.path.relpath(resolved, Path(__file__).resolve().parents[2])
            if not resolved.exists() and rel not in PENDING_PAGES:
                broken.append(f"{f.name}: {target}")
    assert not broken, broken


def test_readme_is_a_front_door() -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    assert len(readme.read_text().splitlines()) <= 200


def test_count() -> None:
    """The tally of the walk above (run with -s to see it): found, run, checked, skipped by reason."""
    if OUTCOMES["found"] != len(COMMANDS):
        pytest.skip("the document walk did not run in full in this session")
    print(f"\ndocs commands: {dict(OUTCOMES)}")
    for reason, n in SKIP_REASONS.most_common():
        print(f"  skipped {n:3d}: {reason}")
    assert OUTCOMES["checked"] + OUTCOMES["skipped"] <= OUTCOMES["found"]
