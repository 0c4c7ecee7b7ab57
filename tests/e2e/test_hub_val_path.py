"""`data.val_path=ORG/NAME` with data.kind=hf: a hub dataset for validation, as data.path reads one, against
a local hub (tests/e2e/hub_server.py): fetched by the launcher, pinned in data.val_revision, its
`data.val_split` read; the validation losses equal those of the same files given as a local directory;
a second run offline fetches nothing."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_server import run_dtlaunch
from hub_server import Hub, Repo

pytestmark = pytest.mark.slow
pytest.importorskip("huggingface_hub")
pytest.importorskip("datasets")

MODEL = "acme/tiny-llama"
DATASET = "acme/tiny-splits"
RUN = ["recipe=tiny_fsdp", "launch.nproc_per_node=1", "launch.threads_per_worker=1", "training.steps=2"]
RUN += ["training.seq_len=32", "checkpoint.enabled=false", "training.loss_plot=false", "training.eval_every=2"]
RUN += ["logging.trackers=[]"]  # TensorBoard's imports: nothing here reads its files
RUN += ["training.eval_batches=2", f"model.init_from=hf:{MODEL}", "data.kind=hf", f"data.path={DATASET}"]


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> Path:
    """A dataset with a train and a validation split (split names from the file names, as on the hub)."""
    words = [f"w{i}" for i in range(250)]
    d = tmp_path_factory.mktemp("tiny_splits")
    for split, n, step in (("train", 200, 7), ("validation", 60, 11)):
        docs = [" ".join(words[(i * step + j * 3) % 250] for j in range(40)) for i in range(n)]
        (d / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return d


@pytest.fixture(scope="module")
def hub(tiny_hf_dirs, splits: Path):
    with Hub(lifetime=500) as h:
        h.repos[("models", MODEL)] = Repo.from_dir(tiny_hf_dirs["llama_tied"])
        h.repos[("datasets", DATASET)] = Repo.from_dir(splits)
        yield h


def train(hub: Hub, home: Path, *args: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(OMP_NUM_THREADS="1", HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_OFFLINE="1" if offline else "0")
    return run_dtlaunch(["train", *RUN, *args], env=env, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def val_losses(run: Path) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["val_loss"] for r in recs if "val_loss" in r]


def test_hub_val_path_is_fetched_pinned_and_reads_its_split(hub: Hub, splits: Path, tmp_path: Path) -> None:
    home, cache = tmp_path / "hf", [f"data.cache_dir={tmp_path / 'tok'}"]
    val = [f"data.val_path={DATASET}", "data.val_split=validation"]
    ok(train(hub, home, *val, *cache, f"run.dir={tmp_path / 'hub'}"))
    from dtlaunch.job.compose import load_resolved

    cfg = load_resolved(tmp_path / "hub" / "config.yaml")
    sha = hub.repos[("datasets", DATASET)].sha
    assert cfg.data.val_path == DATASET and cfg.data.val_revision == sha and cfg.data.revision == sha
    assert hub.gets("/validation.jsonl") == 1  # one snapshot serves data.path and data.val_path
    # The validation file given locally (local data files are datasets' "train" split): the same
    # validation losses; the hub dataset's train split read for validation gives others.
    local = [f"data.val_path={splits / 'validation.jsonl'}", "data.val_split=train"]
    ok(train(hub, home, *local, *cache, f"run.dir={tmp_path / 'local'}"))
    hub_losses = val_losses(tmp_path / "hub")
    assert hub_losses and hub_losses == val_losses(tmp_path / "local")
    ok(train(hub, home, f"data.val_path={DATASET}", *cache, f"run.dir={tmp_path / 'train-split'}"))
    assert val_losses(tmp_path / "train-split") != hub_losses
    # Offline, pinned in the cache: not one request.
    before = sum(hub.requests.values())
    ok(train(hub, home, *val, *cache, f"run.dir={tmp_path / 'offline'}", offline=True))
    assert sum(hub.requests.values()) == before and val_losses(tmp_path / "offline") == hub_losses


def test_bad_hub_val_path_is_one_line(hub: Hub, tmp_path: Path) -> None:
    proc = train(hub, tmp_path / "hf", f"data.val_path={DATASET}@main", f"run.dir={tmp_path / 'r'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "data.val_path" in line and "data.val_revision=main" in line, line
    proc = train(hub, tmp_path / "hf", "data.val_path=acme/no-such-set", f"run.dir={tmp_path / 'r2'}")
    assert proc.returncode == 2 and "data.val_path" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
