"""Hostile input, generated: a few hundred cases with a fixed seed, through the real CLI entry point
in-process (cli.run, SystemExit captured). Override sets with bad keys, values, types and ranges;
recipe files with broken YAML; broken token data; spoiled checkpoints; hostile output paths.

Every case must end with exit 0, 2 or 3; no traceback; at most one short message on stderr; no file
created outside the run directory / output path it was given; no existing file changed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_in_process import run_cli

SEED = 16
MARKER = "PWNED"

KEYS = [
    "training.micro_batch",
    "training.global_batch",
    "training.seq_len",
    "training.steps",
    "training.seed",
    "training.grad_clip",
    "training.compile",
    "training.activation_checkpointing",
    "optim.lr",
    "optim.beta1",
    "optim.beta2",
    "optim.eps",
    "optim.min_lr_ratio",
    "optim.schedule",
    "model.dim",
    "model.n_heads",
    "model.n_kv_heads",
    "model.n_layers",
    "model.ffn_dim",
    "model.vocab_size",
    "model.norm_eps",
    "model.max_seq_len",
    "model.rope_scaling",
    "model.rope_scaling.factor",
    "strategy.tp",
    "strategy.pp",
    "strategy.dp_shard",
    "strategy.dp_replicate",
    "strategy.zero_stage",
    "strategy.pp_schedule",
    "strategy.pp_layers_per_stage",
    "strategy.pp_microbatches",
    "precision.param_dtype",
    "hardware.memory_gib",
    "hardware.gpus_per_node",
    "hardware.peak_tflops_fp32",
    "hardware.fragmentation",
    "launch.nnodes",
    "launch.nproc_per_node",
    "launch.timeout_s",
    "launch.backend",
    "checkpoint.every_steps",
    "checkpoint.keep_last",
    "checkpoint.load_path",
    "data.kind",
    "data.path",
    "data.tokenizer",
    "run.name",
    "cluster.kind",
    "debug.fail_mode",
]
GROUPS = ["model", "strategy", "precision", "hardware", "data", "checkpoint", "cluster", "recipe"]
VALUES = [
    "0",
    "1",
    "2",
    "-1",
    "-5",
    "3",
    "7",
    "1.5",
    "0.5",
    "1e308",
    "1e-12",
    "nan",
    "inf",
    "-inf",
    "99999999999999999999",
    "abc",
    "''",
    "true",
    "null",
    "[1,2]",
    "[]",
    "{a: 1}",
    f"'$(touch {MARKER})'",
    f"'`touch {MARKER}`'",
    "'a b; c'",
    "é",
    "'/nonexistent/x'",
    "tiny",
    "llama3_405b",
    "fsdp",
    "'..'",
    "'../escape'",
]


@dataclass
class Case:
    argv: list[str]
    allowed: list[Path] = field(default_factory=list)  # where this case may create files


def _typo(rng: random.Random, key: str) -> str:
    i = rng.randrange(len(key))
    return key[:i] + rng.choice("xqz_.") + key[i + 1 :]


def override_cases(rng: random.Random, n: int, root: Path) -> list[Case]:
    cases = []
    for _ in range(n):
        overrides = []
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.6:
                overrides.append(f"{rng.choice(KEYS)}={rng.choice(VALUES)}")
            elif r < 0.72:
                overrides.append(f"{_typo(rng, rng.choice(KEYS))}={rng.choice(VALUES)}")
            elif r < 0.82:
                overrides.append(f"{rng.choice(GROUPS)}={rng.choice(VALUES)}")
            else:
                overrides.append(
                    rng.choice(
                        [
                            "=1",
                            "training",
                            "training.steps",
                            "~training",
                            "++x=1",
                            "a==b",
                            "[",
                            "training.steps=[",
                            "+model.foo=1",
                        ]
                    )
                )
        command = rng.choice(["validate", "validate", "validate", "plan", "config"])
        cases.append(Case([command, f"run.root={root / 'runs'}", *overrides]))
    return cases


GOOD_RECIPE = """# @package _global_
defaults:
  - override /model: tiny
  - override /strategy: ddp
training:
  micro_batch: 2
  steps: 4
optim:
  lr: 0.001
"""


def recipe_cases(rng: random.Random, n: int, root: Path) -> list[Case]:
    d = root / "recipes"
    d.mkdir()
    mutations = [
        lambda t: t.replace("  ", "\t", 1),
        lambda t: t.replace("]", "", 1) + "x: [1, 2\n",
        lambda t: t + "training:\n  steps: 9\n",
        lambda t: t.replace("steps: 4", "steps: 4\n  steps: 5"),
        lambda t: "",
        lambda t: "- a\n- b\n",
        lambda t: "just words\n",
        lambda t: t + "training: null\n",
        lambda t: t.replace("# @package _global_\n", ""),
        lambda t: t[: rng.randrange(len(t))],
        lambda t: t.replace(":", "", 1),
        lambda t: t + "model: {dim: -3}\n",
        lambda t: t + "optim:\n  lr: nan\n",
        lambda t: t + "\x00\x01\x02",
        lambda t: t.replace("tiny", "nope"),
        lambda t: t + "foo: {bar: 1}\n",
        lambda t: t + "training:\n  micro_bach: 3\n",
        lambda t: "\ufeff" + t,
        lambda t: t + "  - stray\n",
        lambda t: t + "defaults: 3\n",
    ]
    cases = []
    for i in range(n):
        text = GOOD_RECIPE
        for m in rng.sample(mutations, rng.randint(1, 2)):
            text = m(text)
        f = d / f"r{i}.yaml"
        f.write_text(text, errors="surrogateescape")
        cases.append(Case(["validate", f"recipe={f}"]))
    return cases


def data_cases(rng: random.Random, n: int, root: Path) -> list[Case]:
    import numpy as np

    from dtlaunch.data.shards import ShardWriter

    cases = []
    for i in range(n):
        d = root / "data" / f"d{i}"
        ids = np.arange(5000, dtype=np.uint16) % 250
        w = ShardWriter(d, np.uint16, 2000)
        w.add(ids)
        w.close({"vocab_size": 260, "tokenizer": "byte"})
        kind = rng.choice(
            ["meta_garbage", "meta_keys", "dtype", "vocab", "truncate", "missing", "big_id", "short", "ok"]
        )
        meta = json.loads((d / "meta.json").read_text())
        shard = d / "shard-00001.bin"
        if kind == "meta_garbage":
            (d / "meta.json").write_bytes(os.urandom(64))
        elif kind == "meta_keys":
            meta.pop(rng.choice(["dtype", "vocab_size", "shards"]))
            (d / "meta.json").write_text(json.dumps(meta))
        elif kind == "dtype":
            meta["dtype"] = rng.choice(["float128", "object", "x", 5])
            (d / "meta.json").write_text(json.dumps(meta))
        elif kind == "vocab":
            meta["vocab_size"] = rng.choice([-1, "x", None, 10**30])
            (d / "meta.json").write_text(json.dumps(meta))
        elif kind == "truncate":
            shard.write_bytes(shard.read_bytes()[:-3])
        elif kind == "missing":
            shard.unlink()
        elif kind == "big_id":
            arr = np.fromfile(shard, dtype=np.uint16)
            arr[rng.randrange(len(arr))] = 60000
            arr.tofile(shard)
        run_dir = root / "runs" / f"data{i}"
        seq = "training.seq_len=4000" if kind == "short" else "training.seq_len=16"
        cases.append(
            Case(
                [
                    "train",
                    "recipe=tiny_ddp",
                    "data=tokens",
                    f"data.path={d}",
                    "model.vocab_size=260",
                    seq,
                    f"run.dir={run_dir}",
                ],
                allowed=[run_dir],
            )
        )
    return cases


def checkpoint_cases(rng: random.Random, n: int, root: Path, base: Path) -> list[Case]:
    cases = []
    for i in range(n):
        run_dir = root / "ckpts" / f"c{i}"
        shutil.copytree(base, run_dir)
        steps = sorted((run_dir / "checkpoints").iterdir())
        step = rng.choice(steps)
        files = sorted(f for f in step.iterdir() if f.is_file())
        f = rng.choice(files)
        how = rng.choice(["flip", "truncate", "delete", "empty", "garbage_marker", "rmdir", "extra"])
        if how == "flip":
            data = bytearray(f.read_bytes())
            if data:
                data[rng.randrange(len(data))] ^= 0xFF
            f.write_bytes(bytes(data))
        elif how == "truncate":
            f.write_bytes(f.read_bytes()[: max(0, f.stat().st_size // 2)])
        elif how == "delete":
            f.unlink()
        elif how == "empty":
            f.write_bytes(b"")
        elif how == "garbage_marker":
            (step / "COMPLETE.json").write_text(rng.choice(["{", "[]", '{"files": 3}', "null", '{"files": {}}']))
        elif how == "rmdir":
            shutil.rmtree(step)
        else:
            (step / "junk.bin").write_bytes(b"x")
        out = root / "exports" / f"e{i}"
        target = rng.choice([str(run_dir), str(step)])
        command = rng.choice(
            [
                ["ckpt", "ls", str(run_dir)],
                ["ckpt", "verify", target],
                ["ckpt", "inspect", target],
                ["ckpt", "export", target, "--format", "torch", "--out", str(out)],
            ]
        )
        cases.append(Case(command, allowed=[out]))
    return cases


def path_cases(rng: random.Random, n: int, root: Path, base: Path) -> list[Case]:
    text = root / "in.txt"
    text.write_text("hello world, some text to tokenize\n" * 20)
    a_file = root / "a_file"
    a_file.write_text("keep me\n")
    hostile = [
        str(a_file),
        str(a_file / "sub"),
        str(root / ("x" * 300)),
        str(root / ("y" * 200) / ("z" * 200) / ("w" * 200)),
        "/dev/null",
        "/dev/null/x",
        str(root / "new out"),
        str(root / "q'uote\"d"),
        str(root / f"$(touch {MARKER})"),
        str(root / "line\nbreak"),
        "",
        str(root / "runs"),
    ]
    cases = []
    for _ in range(n):
        out = rng.choice(hostile)
        if rng.random() < 0.5:
            argv = ["data", "prepare", str(text), "--out", out]
        else:
            argv = ["ckpt", "export", str(base), "--format", rng.choice(["torch", "hf", "xyz"]), "--out", out]
        cases.append(Case(argv, allowed=[Path(out)] if out and not out.startswith("/dev") else []))
    return cases


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            snap[p] = (st.st_size, st.st_mtime_ns) if name in filenames else (-1, 0)
    return snap


def _inside(path: str, allowed: list[Path]) -> bool:
    return any(path == str(a) or path.startswith(str(a) + os.sep) for a in allowed)


_run = run_cli


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with two small checkpoints (written in-process by the real CheckpointManager)."""
    import torch
    from omegaconf import OmegaConf

    from dtlaunch.job.compose import compose
    from dtlaunch.models.dense.model import build_model
    from dtlaunch.train.checkpoint.manager import CheckpointManager
    from dtlaunch.train.optim import build_optimizer, build_scheduler
    from dtlaunch.train.parallel.init_weights import materialize_and_init

    run_dir = tmp_path_factory.mktemp("fuzzbase") / "run"
    cfg = compose(["model=tiny", "model.n_layers=1", "hardware=cpu", "training.seq_len=8", "strategy.dp_shard=1"]).cfg
    model = build_model(cfg.model, rope_len=8, device="cpu")
    materialize_and_init(model, torch.device("cpu"), seed=0)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    mgr = CheckpointManager(cfg, run_dir, [model], [opt], [build_scheduler(opt, cfg)], None, rank=0)
    with contextlib.redirect_stdout(io.StringIO()):
        mgr.save(1)
        mgr.save(2)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return run_dir


@pytest.mark.slow_reason(
    "a few hundred generated hostile inputs through the CLI in-process, each checked for files touched"
)
def test_fuzz_hostile_inputs(
    base_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dtlaunch.launch.local as local

    # `train` cases stop where the workers would start: everything before the launch is what is fuzzed.
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: None)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    repo_listing = sorted(os.listdir(Path(__file__).resolve().parents[2]))
    rng = random.Random(SEED)
    cases = (
        override_cases(rng, 100, tmp_path)
        + recipe_cases(rng, 80, tmp_path)
        + data_cases(rng, 12, tmp_path)
        + checkpoint_cases(rng, 40, tmp_path, base_run)
        + path_cases(rng, 24, tmp_path, base_run)
    )
    failures = []
    codes: dict[int, int] = {}
    before = _snapshot(tmp_path)
    for case in cases:
        code, err = _run(case.argv)
        codes[code] = codes.get(code, 0) + 1
        lines = [ln for ln in err.splitlines() if ln.strip()]
        problems = []
        if code not in (0, 2, 3):
            problems.append(f"exit {code}")
        if "Traceback" in err:
            problems.append("traceback")
        if len(lines) > 1 or any(len(ln) > 700 for ln in lines):
            problems.append(f"{len(lines)} lines")
        after = _snapshot(tmp_path)
        for p in after:
            created_ok = _inside(p, case.allowed) or any(_inside(str(a), [Path(p)]) for a in case.allowed)
            if p not in before and not created_ok and not p.startswith(str(tmp_path / "runs")):
                problems.append(f"created {p}")
                break
        for p, stat in before.items():
            if not _inside(p, case.allowed) and after.get(p) != stat and stat[0] >= 0:
                problems.append(f"changed {p}")
                break
        if (tmp_path / MARKER).exists() or (work / MARKER).exists():
            problems.append("ran an injected command")
        if problems:
            failures.append(f"{case.argv}: {problems}: {err.strip()[:300]}")
        before = after
    assert sorted(os.listdir(Path(__file__).resolve().parents[2])) == repo_listing
    print(f"fuzz: {len(cases)} cases, exit codes {dict(sorted(codes.items()))}, {len(failures)} failures")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:30])
