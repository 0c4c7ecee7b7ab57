"""SkyPilot: a task YAML whose `run:` starts `dtlaunch train` on every node, launched with
`sky jobs launch` (a managed job, recovered after preemption) or `sky launch`.

Node rank and rendezvous come from SkyPilot's variables (`SKYPILOT_NODE_RANK`, the first line of
`SKYPILOT_NODE_IPS`); the resolved config travels inside the `run:` script (see remote.py); the run
directory and checkpoints live on a bucket mounted on every node. Exit 75 (stopped at a checkpoint) is in
`job_recovery.recover_on_exit_codes`, so a managed job restarts and resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dtlaunch.errors import EXIT_PREEMPTED, ConfigError, DtlaunchError
from dtlaunch.launch import hub_env, remote

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

TASK_NAME = "skypilot.yaml"
RECORD_NAME = "skypilot.json"
# Hardware profiles -> SkyPilot accelerator names (`sky show-gpus`).
ACCELERATORS = {
    "h100_80gb": "H100",
    "h200_141gb": "H200",
    "a100_40gb": "A100",
    "a100_80gb": "A100-80GB",
    "l40s_48gb": "L40S",
    "rtx4090_24gb": "RTX4090",
}


def accelerator(cfg: JobConfig) -> str:
    """`NAME:COUNT` per node, or "" on the CPU profile."""
    gpus = remote.gpus_per_node(cfg)
    if not gpus:
        return ""
    name = cfg.cluster.sky.accelerator or ACCELERATORS.get(cfg.hardware.name, "")
    if not name:
        raise ConfigError(
            f"hardware={cfg.hardware.name} has no SkyPilot accelerator name here: set cluster.sky.accelerator "
            f"(as `sky show-gpus` spells it)"
        )
    if any(c.isspace() or c == ":" for c in name):
        raise ConfigError(f"cluster.sky.accelerator={name!r} is not an accelerator name: write e.g. H100")
    return f"{name}:{gpus}"


def _check(cfg: JobConfig) -> None:
    s = cfg.cluster.sky
    if cfg.cluster.nodes < 1:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} must be >= 1")
    if not s.bucket:
        raise ConfigError(
            "cluster.sky.bucket is empty: name a bucket for the run directory "
            "(checkpoints on a node's own disk are lost with a preempted node)"
        )
    check_bucket_name("cluster.sky.bucket", s.bucket)
    remote.check_mount_path("cluster.sky.mount_path", s.mount_path)
    if s.cluster_name:
        remote.check_dns_label("cluster.sky.cluster_name", s.cluster_name)


# The rules S3 and GCS share for a bucket name (dots allowed, 3 to 63 characters).
_BUCKET = re.compile(r"[a-z0-9]([-.a-z0-9]{1,61}[a-z0-9])")


def check_bucket_name(key: str, value: str) -> str:
    if not _BUCKET.fullmatch(value) or ".." in value:
        raise ConfigError(
            f"{key}={value!r} is not a bucket name the clouds accept: use 3 to 63 lowercase letters, digits, "
            "'-' and '.', starting and ending with a letter or digit"
        )
    return value


def run_script(cfg: JobConfig, run_dir: str, config_text: str, file_name: str, nodes: int) -> str:
    """`run:`: write the shipped config, then `dtlaunch train` as node SKYPILOT_NODE_RANK, meeting at the
    first node's address."""
    port = int(cfg.cluster.sky.rdzv_port)
    return (
        "\n".join(
            [
                "set -eu",
                remote.nodes_check("SKYPILOT_NUM_NODES", nodes, "SkyPilot"),
                'head_ip=$(printf "%s\\n" "$SKYPILOT_NODE_IPS" | head -n 1)',
                "config_dir=$(mktemp -d)",
                f"cat > \"$config_dir\"/{shlex.quote(file_name)} <<'{remote.HEREDOC_END}'",
                config_text.rstrip("\n"),
                remote.HEREDOC_END,
                f"mkdir -p {shlex.quote(run_dir)}",
                remote.train_command(
                    f'"$config_dir"/{shlex.quote(file_name)}', "$SKYPILOT_NODE_RANK", f"$head_ip:{port}"
                ),
            ]
        )
        + "\n"
    )


def render(cfg: JobConfig, run_name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The task as a dict (what `sky launch TASK.yaml` reads); `environ`: the launcher's environment
    (default os.environ), read for the hub variables the nodes get."""
    _check(cfg)
    s = cfg.cluster.sky
    nodes = int(cfg.cluster.nodes)
    nproc = remote.workers_per_node(cfg)
    name = remote.job_name(run_name)
    run_dir = remote.node_run_dir(s.mount_path, run_name)
    file_name = remote.recipe_file_name(str(cfg.recipe or ""))
    config_text = remote.shipped_config(cfg, run_dir, name, nodes, nproc)
    resources: dict[str, Any] = {}
    acc = accelerator(cfg)
    if acc:
        resources["accelerators"] = acc
    if s.cloud:
        resources["cloud"] = str(s.cloud)
    if s.use_spot:
        resources["use_spot"] = True
    if s.image_id:
        resources["image_id"] = str(s.image_id)
    if s.managed:
        resources["job_recovery"] = {
            "max_restarts_on_errors": int(s.max_restarts_on_errors),
            "recover_on_exit_codes": [EXIT_PREEMPTED],
        }
    storage: dict[str, Any] = {"name": s.bucket, "mode": "MOUNT"}
    if s.store:
        storage["store"] = str(s.store)
    task: dict[str, Any] = {"name": name, "num_nodes": nodes, "resources": resources}
    environ = os.environ if environ is None else environ
    explicit = {str(a): str(b) for a, b in s.env.items()}
    task["envs"] = {"PYTHONUNBUFFERED": "1", **hub_env.forwarded_env(cfg, explicit, environ), **explicit}
    if hub_env.token_to_forward(cfg, explicit, environ):
        # A reference with no value: `sky ... --secret HF_TOKEN` (launch_command) gives it the value of the
        # submitting environment's HF_TOKEN, which SkyPilot redacts; it never enters the task file.
        task["secrets"] = {hub_env.TOKEN_VAR: None}
    task["file_mounts"] = {remote.check_mount_path("cluster.sky.mount_path", s.mount_path): storage}
    if cfg.cluster.setup:
        task["setup"] = "\n".join(str(line) for line in cfg.cluster.setup) + "\n"
    task["run"] = run_script(cfg, run_dir, config_text, file_name, nodes)
    return task


def to_yaml(task: dict[str, Any]) -> str:
    return remote.to_yaml([task])


def launch_command(cfg: JobConfig, task_file: Path, name: str, secrets: Sequence[str] = ()) -> list[str]:
    """`secrets`: names whose values `sky` takes from its own environment (`--secret NAME`, no value)."""
    given = [w for n in secrets for w in ("--secret", str(n))]
    if cfg.cluster.sky.managed:
        return ["sky", "jobs", "launch", "--yes", *given, "--name", name, str(task_file)]
    return ["sky", "launch", "--yes", *given, "--cluster", cfg.cluster.sky.cluster_name or name, str(task_file)]


def require_cli() -> None:
    if shutil.which("sky") is None:
        raise DtlaunchError(
            "`sky` not found on PATH: install SkyPilot (pipx install skypilot), or print the task with --dry-run "
            "and launch it with `sky jobs launch`"
        )


def submit(cfg: JobConfig, run_dir: Path, task: dict[str, Any]) -> str:
    """Write the task into the run directory and launch it with SkyPilot's CLI; the job's name."""
    require_cli()
    path = Path(run_dir) / TASK_NAME
    path.write_text(to_yaml(task))
    cmd = launch_command(cfg, path, task["name"], list(task.get("secrets") or {}))
    # Streams SkyPilot's own progress (provisioning takes minutes); --yes skips its confirmation prompt.
    res = subprocess.run(cmd)
    if res.returncode != 0:
        raise DtlaunchError(f"`{shlex.join(cmd)}` failed (exit {res.returncode}): see SkyPilot's messages above")
    record = {"name": task["name"], "command": cmd, "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (Path(run_dir) / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return str(task["name"])
