"""`submit` and `status` for cluster=kubernetes and cluster=skypilot (after the same validation and plan
gate as Slurm, in submit.py).

A dry run prints the manifests / the task and creates nothing. A submission renders first (bad values are
exit 2 before anything exists), then creates the local run directory (the resolved config, what was sent,
and the record `status` reads) and hands the job to the cluster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlaunch.commands.common import Job, console, summary_table

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def _fix_run_name(job: Job) -> str:
    """Resolve run.name once (it holds a timestamp by default, and the local record and the nodes' run
    directory must agree on it); the name the nodes use for their run directory on the shared storage."""
    from dtlaunch.launch.rundir import run_dir_for, run_name

    if not job.cfg.run.name and not job.cfg.run.dir:
        job.cfg.run.name = run_name(job.cfg, job.recipe)
    return str(job.cfg.run.name or run_dir_for(job.cfg, job.recipe).name)


def _render(job: Job, name: str) -> tuple[Any, str]:
    if job.cfg.cluster.kind == "kubernetes":
        from dtlaunch.launch import kubernetes

        manifests = kubernetes.render(job.cfg, name)
        return manifests, kubernetes.to_yaml(manifests)
    from dtlaunch.launch import skypilot

    task = skypilot.render(job.cfg, name)
    return task, skypilot.to_yaml(task)


def submit_remote(job: Job, dry_run: bool) -> int:
    name = _fix_run_name(job)
    rendered, text = _render(job, name)
    if dry_run:
        print(text, end="")  # alone on stdout: `dtlaunch submit ... --dry-run | kubectl apply -f -`
        return 0
    from dtlaunch.launch.rundir import create_run_dir, removed_if_failed, run_dir_for

    out = console()
    out.print(summary_table(job))
    if job.cfg.cluster.kind == "kubernetes":
        from dtlaunch.launch import kubernetes

        client = kubernetes.api_client(job.cfg.cluster.k8s.context)
        with removed_if_failed(run_dir_for(job.cfg, job.recipe).resolve()):  # a refused job leaves no record
            run_dir = create_run_dir(job.cfg, job.recipe)
            job_name = kubernetes.apply(rendered, client)
        kubernetes.record(run_dir, rendered, job.cfg.cluster.k8s.context)
        out.print(f"submitted {rendered[1]['kind']} {job_name} to namespace {job.cfg.cluster.k8s.namespace}")
    else:
        from dtlaunch.launch import skypilot

        skypilot.require_cli()
        with removed_if_failed(run_dir_for(job.cfg, job.recipe).resolve()):
            run_dir = create_run_dir(job.cfg, job.recipe)
            job_name = skypilot.submit(job.cfg, run_dir, rendered)
        out.print(f"submitted SkyPilot task {job_name}", markup=False)
    out.print(f"run directory on the cluster: {_node_run_dir(job.cfg, name)}", markup=False)
    out.print(f"record: {run_dir}; follow it with: dtlaunch status {run_dir}", markup=False)
    return 0


def _node_run_dir(cfg: JobConfig, name: str) -> str:
    from dtlaunch.launch.remote import node_run_dir

    section = cfg.cluster.k8s if cfg.cluster.kind == "kubernetes" else cfg.cluster.sky
    return node_run_dir(section.mount_path, name)


def kubernetes_status_command(run_dir: Path, as_json: bool) -> int:
    from dtlaunch.launch import kubernetes

    rec = kubernetes.read_record(run_dir)
    st = kubernetes.query_status(rec, kubernetes.api_client(rec.get("context", "")))
    if as_json:
        print(json.dumps({**st, "run_dir": str(run_dir)}))
        return 0
    line = f"{st['kind']} {st['job']}: {st['state']}" + (f" ({st['reason']})" if st["reason"] else "")
    print(line)
    return 0


def skypilot_status_command(run_dir: Path, as_json: bool) -> int:
    """What was launched and where SkyPilot reports on it (its state lives in SkyPilot's own API server)."""
    from dtlaunch.launch import skypilot

    rec = json.loads((run_dir / skypilot.RECORD_NAME).read_text())
    follow = "sky jobs queue" if "jobs" in rec.get("command", []) else "sky status"
    if as_json:
        print(json.dumps({**rec, "run_dir": str(run_dir), "follow": follow}))
        return 0
    print(f"SkyPilot task {rec['name']} (launched {rec.get('submitted_at', '?')}): see `{follow}`")
    return 0
