"""`submit` to Kubernetes / SkyPilot of a job that names a hub model, against a local hub
(tests/e2e/hub_server.py): the pods / nodes get the launcher's HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE, and
the token only by reference (a Kubernetes Secret, a SkyPilot secret given by `--secret HF_TOKEN`), never its
value; a pod whose environment is the manifest's alone trains offline from the cache `download` filled."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hub_server import Hub, Repo

pytestmark = pytest.mark.slow
pytest.importorskip("huggingface_hub")

MODEL = "acme/tiny-llama"
TOKEN = "hf_do_not_write_me_0123456789"
JOB = ["recipe=tiny_ddp", "cluster.nodes=1", "launch.nproc_per_node=1", "launch.threads_per_worker=1", "data=synthetic"]
JOB += ["training.steps=2", "training.seq_len=32", "checkpoint.enabled=false", "training.loss_plot=false"]
JOB += ["logging.trackers=[]"]  # TensorBoard's imports: nothing here reads its files
K8S = ["cluster=kubernetes", "cluster.k8s.image=img", "cluster.k8s.pvc=runs", "run.name=hub-pod"]
SKY = ["cluster=skypilot", "cluster.sky.bucket=runs", "run.name=hub-node"]


@pytest.fixture(scope="module")
def hub(tiny_hf_dirs):
    with Hub(lifetime=400) as h:
        h.repos[("models", MODEL)] = Repo.from_dir(tiny_hf_dirs["llama_tied"])
        yield h


def launcher_env(**hf: str) -> dict[str, str]:
    """This environment without any HF_* variable, plus `hf`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "OMP_NUM_THREADS": "1", **hf}


def dtlaunch(env: dict[str, str], cwd: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dtlaunch", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def home(hub: Hub, tmp_path_factory) -> Path:
    """An HF_HOME the weights were downloaded into ahead of `submit`, as on a login node."""
    home = tmp_path_factory.mktemp("hf")
    dtlaunch(launcher_env(HF_HOME=str(home), HF_ENDPOINT=hub.url), home, "download", f"hf:{MODEL}")
    return home


def test_pod_gets_the_cache_and_the_token_by_reference_and_trains_offline(hub: Hub, home: Path, tmp_path) -> None:
    env = launcher_env(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_TOKEN=TOKEN)
    pvc = tmp_path / "pvc"
    args = [*JOB, *K8S, f"cluster.k8s.mount_path={pvc}", f"model.init_from=hf:{MODEL}"]
    text = dtlaunch(env, tmp_path, "submit", *args, "cluster.k8s.hf_token_secret=hf-creds", "--dry-run")
    assert TOKEN not in text
    cm, trainjob = list(yaml.safe_load_all(text))
    pod_env = trainjob["spec"]["trainer"]["env"]
    by_name = {e["name"]: e for e in pod_env}
    assert by_name["HF_HOME"]["value"] == str(home) and by_name["HF_HUB_OFFLINE"]["value"] == "1"
    assert by_name["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-creds", "key": "HF_TOKEN"}},
    }
    # Without a Secret named, the pods get no token at all (and still not its value).
    plain = dtlaunch(env, tmp_path, "submit", *args, "--dry-run")
    assert TOKEN not in plain and "HF_TOKEN" not in plain and f"value: {home}" in plain

    # The pod: the ConfigMap mounted, and no HF_* variable but the manifest's (a Secret is not resolvable here).
    (tmp_path / "cm").mkdir()
    for name, content in cm["data"].items():
        (tmp_path / "cm" / name).write_text(content)
    from dtlaunch.launch import kubernetes

    command = [*trainjob["spec"]["trainer"]["command"]]
    command[-1] = command[-1].replace(kubernetes.CONFIG_MOUNT + "/", f"{tmp_path / 'cm'}/")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    node = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1"}
    pod = {**launcher_env(), "PATH": path, **node, "PET_MASTER_PORT": port}
    pod.update({e["name"]: e["value"] for e in pod_env if "value" in e})
    before = sum(hub.requests.values())
    proc = subprocess.run(command, env=pod, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (pvc / "hub-pod" / "metrics.jsonl").is_file()
    assert sum(hub.requests.values()) == before  # every file from the forwarded cache, offline


def test_skypilot_node_gets_the_cache_and_the_token_as_a_secret(hub: Hub, home: Path, tmp_path: Path) -> None:
    env = launcher_env(HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"), HF_HUB_OFFLINE="1", HF_TOKEN=TOKEN)
    args = [*JOB, *SKY, f"model.init_from=hf:{MODEL}", "+cluster.sky.env.HF_HUB_OFFLINE=0"]
    text = dtlaunch(env, tmp_path, "submit", *args, "--dry-run")
    assert TOKEN not in text
    task = yaml.safe_load(text)
    assert task["envs"]["HF_HOME"] == str(home) and task["envs"]["HF_HUB_CACHE"] == str(home / "hub")
    assert task["envs"]["HF_HUB_OFFLINE"] == "0"  # cluster.sky.env wins over the launcher's
    assert task["secrets"] == {"HF_TOKEN": None}
    if os.environ.get("DTLAUNCH_SKY_PYTHON"):  # SkyPilot's own parser takes the task
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
        from test_skypilot_task import parse_with_skypilot

        task_file = tmp_path / "task.yaml"
        task_file.write_text(text)
        assert parse_with_skypilot(task_file)["envs"]["HF_HOME"] == str(home)
    from dtlaunch.launch import skypilot

    cmd = skypilot.launch_command(_sky_cfg(), tmp_path / "task.yaml", "hub-node", list(task["secrets"]))
    assert cmd[cmd.index("--secret") + 1] == "HF_TOKEN" and TOKEN not in " ".join(cmd)


def _sky_cfg():
    from dtlaunch.commands.common import load_job

    return load_job([*JOB, *SKY]).cfg


def test_local_jobs_forward_nothing(tmp_path: Path) -> None:
    """A job that names no hub model or dataset: the manifests do not change with the submitting shell."""
    from dtlaunch.commands.common import load_job
    from dtlaunch.launch import kubernetes, skypilot

    environ = {"HF_HOME": "/somewhere", "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    k8s = load_job([*JOB, *K8S]).cfg
    assert kubernetes.render(k8s, "x", environ) == kubernetes.render(k8s, "x", {})
    sky = _sky_cfg()
    assert skypilot.render(sky, "x", environ) == skypilot.render(sky, "x", {})
    assert "secrets" not in skypilot.render(sky, "x", environ)
