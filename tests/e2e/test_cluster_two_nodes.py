"""The command a Kubernetes pod runs, and the `run:` of a SkyPilot task, executed here for two nodes:
two local processes stand in for the pods / VMs, with the variables Kubeflow Trainer or SkyPilot sets
for node 0 and node 1 of 2, the shared storage a directory. They must train together and checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.launch import kubernetes, skypilot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from ports import listen_port  # noqa: E402
from test_skypilot_task import parse_with_skypilot  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slow_reason(
        "two launchers as two nodes of one job (rendezvous, training, resume, evaluation): nothing shorter shows it"
    ),
]

STEPS = 4
TINY = [
    "recipe=tiny_ddp",
    "cluster.nodes=2",
    "launch.nproc_per_node=1",
    f"training.steps={STEPS}",
    "training.seq_len=32",
    "checkpoint.every_steps=2",
    "training.loss_plot=false",
    "launch.threads_per_worker=1",
    "logging.trackers=[]",
]


def _node_env(extra: dict[str, str]) -> dict[str, str]:
    # `dtlaunch` as the image has it: the console script next to this interpreter.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", **extra}


def _run_nodes(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[str]:
    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=240)[0])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                outputs.append(p.communicate()[0] + "\n[test] killed after 240 s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    # A failure shows both nodes: the one that failed first is often not node 0.
    said = "\n".join(
        f"--- node {rank} (rc {p.returncode}):\n{out[-2500:]}"
        for rank, (p, out) in enumerate(zip(procs, outputs, strict=True))
    )
    assert all(p.returncode == 0 for p in procs), said
    return outputs


def _check_trained(run_dir: Path) -> None:
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["world"] == 2
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step"))
    assert saved and saved[-1].endswith(str(STEPS)), saved


def _trainjob_nodes(tmp_path: Path, pvc: Path, *overrides: str) -> tuple[list[list[str]], list[dict[str, str]]]:
    """The TrainJob's command and the environment of its two pods, with the ConfigMap written to a
    directory of this test (mounted at /etc/dtlaunch in a pod)."""
    job = load_job([*TINY, "cluster=kubernetes", "cluster.k8s.image=img", "cluster.k8s.pvc=runs",
                    f"cluster.k8s.mount_path={pvc}", *overrides])  # fmt: skip
    cm, trainjob = kubernetes.render(job.cfg, "two-nodes")
    config_dir = tmp_path / f"configmap-{len(list(tmp_path.glob('configmap-*')))}"
    config_dir.mkdir()
    for name, text in cm["data"].items():
        (config_dir / name).write_text(text)
    command = list(trainjob["spec"]["trainer"]["command"])
    assert command[-1].count(kubernetes.CONFIG_MOUNT + "/") == 1
    command[-1] = command[-1].replace(kubernetes.CONFIG_MOUNT + "/", f"{config_dir}/")
    port = str(listen_port())
    envs = [
        _node_env(
            {
                "PET_NNODES": str(trainjob["spec"]["trainer"]["numNodes"]),
                "PET_NPROC_PER_NODE": str(trainjob["spec"]["trainer"]["numProcPerNode"]),
                "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": port,
            }
        )
        for rank in range(2)
    ]
    return [command, command], envs


def test_trainjob_command_trains_on_two_nodes_and_resumes(tmp_path: Path) -> None:
    pvc = tmp_path / "pvc"
    _run_nodes(*_trainjob_nodes(tmp_path, pvc, f"training.steps={STEPS // 2}"), tmp_path)
    assert (pvc / "two-nodes" / "checkpoints" / f"step-{STEPS // 2:08d}").is_dir()
    # Submitted again for more steps, onto the same PVC: it resumes from that checkpoint (metrics.jsonl
    # would hold steps 1.. twice after a fresh start).
    _run_nodes(*_trainjob_nodes(tmp_path, pvc), tmp_path)
    _check_trained(pvc / "two-nodes")


def _skypilot_nodes(tmp_path: Path, bucket: Path, *overrides: str) -> tuple[list[list[str]], list[dict[str, str]]]:
    """The task's `run:` (parsed by SkyPilot) and the environment of its two nodes."""
    overrides = (*TINY, "cluster=skypilot", "cluster.sky.bucket=runs", f"cluster.sky.mount_path={bucket}", *overrides)
    job = load_job([*overrides, f"cluster.sky.rdzv_port={listen_port()}"])
    task_file = tmp_path / "task.yaml"
    task_file.write_text(skypilot.to_yaml(skypilot.render(job.cfg, "two-nodes")))
    task = parse_with_skypilot(task_file)
    assert task["num_nodes"] == 2
    envs = [
        _node_env(
            {
                "SKYPILOT_NODE_RANK": str(rank),
                "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
                "SKYPILOT_NUM_NODES": "2",
                "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            }
        )
        for rank in range(2)
    ]
    return [["bash", "-c", task["run"]]] * 2, envs


def test_skypilot_run_trains_on_two_nodes(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    _run_nodes(*_skypilot_nodes(tmp_path, bucket), tmp_path)
    _check_trained(bucket / "two-nodes")


def test_submitted_job_evaluates_once_on_node_0_after_training(tmp_path: Path, tiny_eval_inputs) -> None:
    """training.eval_tasks: node 0's `dtlaunch train` evaluates the final checkpoint once its workers have
    exited (as a local run does); node 1 does not."""
    pytest.importorskip("lm_eval")
    overrides, _ = tiny_eval_inputs
    bucket = tmp_path / "bucket"
    commands, envs = _skypilot_nodes(tmp_path, bucket, *overrides, "training.eval_tasks=[tiny_mc]")
    envs = [{**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} for env in envs]
    node0, node1 = _run_nodes(commands, envs, tmp_path)
    (path,) = (bucket / "two-nodes" / "eval").glob("*.json")
    saved = json.loads(path.read_text())
    assert saved["step"] == STEPS and saved["request"]["tasks"] == ["tiny_mc"]
    assert node0.count("eval results:") == 1 and "eval results:" not in node1, node0[-2000:]
