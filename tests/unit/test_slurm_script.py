"""The sbatch script: options from the cluster section, one torchrun per node, and quoting of every
value (hostile values stay single arguments). No Slurm needed."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dtlaunch.commands.common import load_job
from dtlaunch.errors import ConfigError, DtlaunchError, InputError
from dtlaunch.launch import slurm

HOSTILE = "x; rm -rf / #$(touch /tmp/dtlaunch-pwned) `id` 'q' \"dq\""


def script_for(tmp_path: Path, *overrides: str, run_dir: Path | None = None) -> str:
    job = load_job(["recipe=tiny_ddp", "cluster=slurm", *overrides])
    return slurm.render_script(job.cfg, run_dir or tmp_path / "run", job.cfg.run.name)


def sbatch_options(script: str) -> list[str]:
    """Each `#SBATCH` line parsed as sbatch does (quotes and backslashes): one argument per line."""
    opts = []
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            words = shlex.split(line[len("#SBATCH ") :], comments=False)
            assert len(words) == 1, line
            opts.append(words[0])
    return opts


def bash_syntax_ok(script: str) -> None:
    res = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_options_from_the_cluster_section(tmp_path: Path) -> None:
    script = script_for(
        tmp_path,
        "cluster.nodes=2",
        "cluster.partition=gpu",
        "cluster.account=proj",
        "cluster.qos=high",
        "cluster.time=02:30:00",
        "cluster.cpus_per_task=16",
        "cluster.mem=0",
        "cluster.signal_before_s=300",
        "cluster.sbatch_args=['--exclusive','--constraint=h100']",
    )
    opts = sbatch_options(script)
    run = tmp_path / "run"
    for expected in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--time=02:30:00",
        "--cpus-per-task=16",
        "--mem=0",
        "--requeue",
        "--signal=B:USR1@300",
        "--exclusive",
        "--constraint=h100",
        f"--output={run}/logs/slurm-%j.out",
        f"--error={run}/logs/slurm-%j.err",
        "--open-mode=append",
    ):
        assert expected in opts, (expected, opts)
    assert not any(o.startswith("--gpus-per-node") for o in opts)  # tiny_ddp targets the cpu profile
    bash_syntax_ok(script)
    assert script.startswith("#!/bin/bash\n")
    assert f"export DTLAUNCH_RUN_DIR={run}" in script
    body = " ".join(line.rstrip("\\") for line in script.splitlines() if not line.startswith("#"))
    for arg in (
        "-m torch.distributed.run",
        '--nnodes="$SLURM_NNODES"',
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$head_node:$rdzv_port"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "--max-restarts=0",
        "-m dtlaunch.train.main",
        "scontrol requeue",
        "trap on_usr1 USR1",
    ):
        assert arg in body, arg
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert "srun " in body and "--ntasks-per-node=1" in body


def test_gpus_per_node_only_with_gpu_hardware(tmp_path: Path) -> None:
    opts = sbatch_options(
        script_for(
            tmp_path, "hardware=h100_80gb", "cluster.gpus_per_node=8", "launch.nproc_per_node=0", "strategy.dp_shard=-1"
        )
    )
    assert "--gpus-per-node=8" in opts
    script = script_for(
        tmp_path, "hardware=h100_80gb", "cluster.gpus_per_node=8", "launch.nproc_per_node=0", "strategy.dp_shard=-1"
    )
    assert "--nproc-per-node=8" in script


def test_explicit_rendezvous_and_restarts_are_used(tmp_path: Path) -> None:
    script = script_for(
        tmp_path,
        "launch.rdzv_endpoint=node001:29400",
        "launch.rdzv_id=myrun",
        "launch.max_restarts=3",
        "launch.threads_per_worker=4",
    )
    assert "--rdzv-endpoint=node001:29400" in script and "--rdzv-id=myrun" in script
    assert "--max-restarts=3" in script and "export OMP_NUM_THREADS=4" in script
    assert "head_node=" not in script


def test_hostile_values_stay_quoted(tmp_path: Path) -> None:
    # Hydra's own grammar needs the value quoted on the command line; escape its quotes for it.
    hydra_value = "'" + HOSTILE.replace("\\", "\\\\").replace("'", "\\'") + "'"
    run_dir = tmp_path / "run dir 'with' $(quotes)"
    script = script_for(
        tmp_path,
        f"cluster.partition={hydra_value}",
        f"run.name={hydra_value}",
        f"cluster.account={hydra_value}",
        f"cluster.sbatch_args=[{hydra_value.replace(chr(39) + 'x', chr(39) + '--x', 1)}]",
        f"launch.rdzv_id={hydra_value}",
        run_dir=run_dir,
    )
    bash_syntax_ok(script)
    opts = sbatch_options(script)
    assert f"--partition={HOSTILE}" in opts and f"--account={HOSTILE}" in opts and f"--job-name={HOSTILE}" in opts
    assert f"--{HOSTILE}" in opts
    assert f"--output={run_dir}/logs/slurm-%j.out" in opts
    # In the bash part the value only ever appears as one quoted word.
    quoted = shlex.quote(HOSTILE)
    for line in script.splitlines():
        if line.startswith("#"):
            continue
        if "rm -rf" in line:
            assert quoted in line, line
            assert line.replace(quoted, "''").count("rm -rf") == 0, line
    words = shlex.split(" ".join(line.rstrip("\\") for line in script.splitlines() if not line.startswith("#")))
    assert f"--rdzv-id={HOSTILE}" in words
    assert f"DTLAUNCH_RUN_DIR={run_dir}" in words
    # Running the script's preamble defines the run dir exactly, and runs nothing hostile.
    preamble = script.split("requeue=0")[0].replace("head_node=$(", "head_node=$(true ")
    res = subprocess.run(
        ["bash", "-c", preamble + '\nprintf %s "$DTLAUNCH_RUN_DIR"'],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1"},
    )
    assert res.stdout == str(run_dir), res.stderr
    assert not Path("/tmp/dtlaunch-pwned").exists()


def test_bad_values_are_one_line_errors(tmp_path: Path) -> None:
    job = load_job(["recipe=tiny_ddp", "cluster=slurm"])
    # A line break would end the `#SBATCH` comment and start a command: refused, not quoted.
    job.cfg.cluster.partition = "a\nrm -rf /"
    with pytest.raises(ConfigError, match=r"^cluster.partition=.*line break"):
        slurm.render_script(job.cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^cluster.sbatch_args\[0\]='exclusive' is not an option"):
        script_for(tmp_path, "cluster.sbatch_args=[exclusive]")
    with pytest.raises(ConfigError, match=r"^cluster.nodes=0"):
        load_job(["recipe=tiny_ddp", "cluster=slurm", "cluster.nodes=0"])


def test_percent_in_the_run_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'%'"):
        script_for(tmp_path, run_dir=tmp_path / "100%")


def test_missing_sbatch_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no Slurm client here
    job = load_job(["recipe=tiny_ddp", "cluster=slurm"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(DtlaunchError, match="`sbatch` not found"):
        slurm.submit(job, run_dir)
    assert (run_dir / slurm.SCRIPT_NAME).is_file()  # the script is there to submit by hand
    assert not (run_dir / slurm.RECORD_NAME).exists()


def test_status_without_a_submission(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="slurm.json"):
        slurm.status(tmp_path)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dtlaunch", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_cli_submit_needs_cluster_slurm(tmp_path: Path) -> None:
    res = cli("submit", "recipe=tiny_ddp", "--dry-run", cwd=tmp_path)
    assert res.returncode == 2 and "cluster=slurm" in res.stderr and "Traceback" not in res.stderr


def test_cli_dry_run_prints_only_the_script(tmp_path: Path) -> None:
    res = cli("submit", "recipe=tiny_ddp", "cluster=slurm", f"run.dir={tmp_path / 'r'}", "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("#!/bin/bash\n")
    bash_syntax_ok(res.stdout)
    assert not (tmp_path / "r").exists()


def test_cli_status_of_unknown_run(tmp_path: Path) -> None:
    res = cli("status", "nope", cwd=tmp_path)
    assert res.returncode == 2 and "run 'nope' not found" in res.stderr


def test_eval_tasks_run_once_after_the_step_only_when_set(tmp_path: Path) -> None:
    assert slurm.EVAL_MODULE not in script_for(tmp_path)
    script = script_for(tmp_path, "training.eval_tasks=[arc_easy]", run_dir=tmp_path / "my run")
    bash_syntax_ok(script)
    lines = script.splitlines()
    (at,) = [i for i, ln in enumerate(lines) if f"-m {slurm.EVAL_MODULE} " in ln]
    # After the step has ended and the requeue branch has exited; only on success; its exit is the job's.
    assert lines.index("rc=$?") < lines.index('  scontrol requeue "$SLURM_JOB_ID"') < at
    assert lines[at - 1] == 'if [ "$rc" -eq 0 ]; then' and lines[at + 1] == "  rc=$?"
    assert lines[-1] == 'exit "$rc"'
    assert shlex.split(lines[at])[-1] == str(tmp_path / "my run")
