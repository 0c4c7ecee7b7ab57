"""Hub names through the CLI as a user types them, against a local hub (tests/e2e/hub_server.py):
`plan` fetches config.json only, `train` the weights (once) and the hub dataset, a second run offline
fetches nothing, `download` fills the cache ahead of time, a full disk leaves nothing half-written."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_server import run_dtlaunch
from hub_server import Hub, Repo

pytestmark = pytest.mark.slow
pytest.importorskip("huggingface_hub")
pytest.importorskip("datasets")

MODEL = "acme/tiny-llama"
DATASET = "acme/tiny-docs"
README = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/*.jsonl
- config_name: short
  data_files:
  - split: train
    path: short/*.jsonl
---
"""
# No tracker (TensorBoard's imports): nothing here reads its files.
SHORT = ["training.steps=2", "training.seq_len=32", "checkpoint.enabled=false", "training.loss_plot=false"]
SHORT += ["logging.trackers=[]"]
ONE = ["recipe=tiny_fsdp", "launch.nproc_per_node=1", "launch.threads_per_worker=1"]


@pytest.fixture(scope="module")
def hub(tiny_hf_dirs, tmp_path_factory):
    import json

    words = [f"w{i}" for i in range(250)]
    data = tmp_path_factory.mktemp("tiny_docs")
    for subset, n in (("en", 300), ("short", 2)):
        (data / subset).mkdir()
        docs = [" ".join(words[(i * 7 + j) % 250] for j in range(40)) for i in range(n)]
        (data / subset / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (data / "README.md").write_text(README)
    with Hub(lifetime=500) as h:
        h.repos[("models", MODEL)] = Repo.from_dir(tiny_hf_dirs["llama_tied"])
        h.repos[("datasets", DATASET)] = Repo.from_dir(data)
        yield h


def dtlaunch(hub: Hub, home: Path, *args: str, offline: bool = False, limit: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", HF_ENDPOINT=hub.url, HF_HOME=str(home))
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_TOKEN", None)
    env["HF_HUB_OFFLINE"] = "1" if offline else "0"

    if not limit:  # a fork of the test server (huggingface_hub, which reads HF_* at import, is not preloaded)
        return run_dtlaunch(list(args), env=env, timeout=300)

    def fsize() -> None:  # a disk that fills: writes past `limit` bytes fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "dtlaunch", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=fsize,
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_plan_fetches_config_json_only_then_train_fetches_the_rest_once(hub: Hub, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    ok(dtlaunch(hub, home, "plan", *ONE, f"model.init_from=hf:{MODEL}", "data=synthetic"))
    assert hub.gets(f"/{MODEL}/resolve/main/config.json") == 1 and hub.content_gets() == 1, hub.requests

    run = tmp_path / "run"
    data = ["data.kind=hf", f"data.path={DATASET}", "data.subset=en", f"data.cache_dir={tmp_path / 'tok'}"]
    ok(dtlaunch(hub, home, "train", *ONE, *SHORT, f"model.init_from=hf:{MODEL}", *data, f"run.dir={run}"))
    assert hub.gets("/model.safetensors") == 1 and hub.gets("/tokenizer.json") == 1
    assert hub.gets("/en/train.jsonl") == 1
    from dtlaunch.job.compose import load_resolved

    cfg = load_resolved(run / "config.yaml")
    sha = hub.repos[("models", MODEL)].sha
    assert cfg.model.init_from == f"hf:{MODEL}@{sha}" and cfg.data.revision == hub.repos[("datasets", DATASET)].sha

    # A second run, offline: every file from the cache, not one request.
    before = sum(hub.requests.values())
    ok(
        dtlaunch(
            hub, home, "train", *ONE, *SHORT, f"model.init_from=hf:{MODEL}", *data, f"run.dir={run}2", offline=True
        )
    )
    assert sum(hub.requests.values()) == before


def test_download_ahead_then_a_full_disk_leaves_nothing_half_written(hub: Hub, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    weights = len(hub.repos[("models", MODEL)].files["model.safetensors"])
    proc = dtlaunch(hub, home, "download", f"hf:{MODEL}", limit=weights // 2)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # One line (after huggingface_hub's progress bars) naming the cause and the fix.
    assert "the disk filled while downloading" in proc.stderr.strip().splitlines()[-1], proc.stderr
    cache = home / "hub" / f"models--{MODEL.replace('/', '--')}"
    assert not list(cache.rglob("*.incomplete")) and not list(cache.rglob("model.safetensors"))

    out = ok(dtlaunch(hub, home, "download", f"hf:{MODEL}", f"dataset:{DATASET}")).stdout
    sha = hub.repos[("models", MODEL)].sha
    assert f"hf:{MODEL}@{sha} -> " in out and f"dataset:{DATASET}@" in out
    assert (cache / "snapshots" / sha / "model.safetensors").is_file()
    assert (cache / "snapshots" / sha / "tokenizer.json").is_file()


def test_two_nodes_from_a_hub_name_download_the_weights_once(hub: Hub, tmp_path: Path, monkeypatch) -> None:
    """The Kubernetes TrainJob's command on two local "pods" sharing a cache: `submit` pinned the commit
    (config.json only), then one node downloads the weights while the other waits for them."""
    from hub_server import point_hub_lib_at

    from dtlaunch.commands.common import load_job
    from dtlaunch.launch import kubernetes

    home, pvc = tmp_path / "hf", tmp_path / "pvc"
    point_hub_lib_at(monkeypatch, hub.url, str(home / "hub"))
    before = hub.gets("/model.safetensors")
    overrides = ["recipe=tiny_ddp", "cluster=kubernetes", "cluster.nodes=2", "launch.nproc_per_node=1"]
    overrides += ["cluster.k8s.image=img", "cluster.k8s.pvc=runs", f"cluster.k8s.mount_path={pvc}", "data=synthetic"]
    job = load_job([*overrides, *SHORT, "launch.threads_per_worker=1", f"model.init_from=hf:{MODEL}"])
    assert job.cfg.model.init_from == f"hf:{MODEL}@{hub.repos[('models', MODEL)].sha}"
    assert hub.gets("/model.safetensors") == before  # composing and rendering the job read config.json only
    cm, trainjob = kubernetes.render(job.cfg, "hub-nodes")
    (tmp_path / "cm").mkdir()
    for name, text in cm["data"].items():
        (tmp_path / "cm" / name).write_text(text)
    command = [*trainjob["spec"]["trainer"]["command"]]
    command[-1] = command[-1].replace(kubernetes.CONFIG_MOUNT + "/", f"{tmp_path / 'cm'}/")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    envs = [
        {
            **os.environ,
            "PATH": path,
            "OMP_NUM_THREADS": "1",
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "0",
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
        }  # fmt: skip
        for rank in range(2)
    ]
    procs = [
        subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"node {rank}:\n{out[-3000:]}"
    assert hub.gets("/model.safetensors") == before + 1
    assert (pvc / "hub-nodes" / "metrics.jsonl").is_file()


PROMPTS = "acme/tiny-prompts"


def test_grpo_reads_its_prompts_from_a_hub_dataset(hub: Hub, tmp_path: Path) -> None:
    """data.format=prompt with data.kind=hf data.path=ORG/NAME: the launcher pins the snapshot, reads the
    data.subset's records whole (every column reaches the rewards) and a GRPO step trains on them."""
    import json

    from grpo_toy import toy_args, write_tokenizer

    repo = tmp_path / "repo"
    for subset, prompts in (
        ("easy", [f"{a} {b}" for a in ("the", "a", "is", "copy") for b in ("the", "a")]),
        ("hard", ["copy 3", "copy 4"]),
    ):
        (repo / subset).mkdir(parents=True)
        lines = [json.dumps({"question": p, "answer": "7", "source": subset}) for p in prompts]
        (repo / subset / "train.jsonl").write_text("\n".join(lines) + "\n")
    (repo / "README.md").write_text(
        README.replace("config_name: en", "config_name: easy")
        .replace("path: en/", "path: easy/")
        .replace("config_name: short", "config_name: hard")
        .replace("path: short/", "path: hard/")
    )
    hub.repos[("datasets", PROMPTS)] = Repo.from_dir(repo)
    run = tmp_path / "run"
    data = ["data.kind=hf", f"data.path={PROMPTS}", "data.subset=easy", "data.prompt_field=question"]
    data.append(f"data.tokenizer={write_tokenizer(tmp_path / 'tokenizer.json')}")
    args = toy_args(
        data,
        "launch.threads_per_worker=1",
        "training.steps=1",
        "checkpoint.enabled=false",
        "training.loss_plot=false",
        "logging.trackers=[]",
    )
    ok(dtlaunch(hub, tmp_path / "hf", "train", *args, f"run.dir={run}"))
    records = [json.loads(x) for x in (run / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["columns"]["source"] for r in records} == {"easy"}
    assert records[0]["prompt"] == "the the" and records[0]["columns"]["answer"] == "7"
    from dtlaunch.job.compose import load_resolved

    assert load_resolved(run / "config.yaml").data.revision == hub.repos[("datasets", PROMPTS)].sha
    assert (run / "metrics.jsonl").read_text().strip()
