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
from dtlaunch.launch import slurm, slurm_script

HOSTILE = "x; rm -rf / #$(touch /tmp/dtlaunch-pwned) `id` 'q' \"dq\""


def script_for(tmp_path: Path, *overrides: str, run_dir: Path | None = None) -> str:
    job = load_job(["recipe=tiny_ddp", "cluster=slurm", *overrides])
    return slurm_script.render_script(job.cfg, run_dir or tmp_path / "run", job.cfg.run.name)


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
        slurm_script.render_script(job.cfg, tmp_path / "run")
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
    assert (run_dir / slurm_script.SCRIPT_NAME).is_file()  # the script is there to submit by hand
    assert not (run_dir / slurm.RECORD_NAME).exists()


def test_status_without_a_submission(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="slurm.json"):
        slurm.status(tmp_path)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m dtlaunch ARGS` as a fresh process would run it, forked from a server that imported torch."""
    from cli_server import run_dtlaunch

    return run_dtlaunch(list(args), cwd=cwd, timeout=120)


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


def eval_script_for(tmp_path: Path, *overrides: str, run_dir: Path | None = None) -> str:
    job = load_job(["recipe=tiny_ddp", "cluster=slurm", "training.eval_tasks=[arc_easy]", *overrides])
    return slurm_script.render_eval_script(job.cfg, run_dir or tmp_path / "run", job.cfg.run.name)


def test_training_job_keeps_its_whole_time_and_never_evaluates(tmp_path: Path) -> None:
    """training.eval_tasks is a job of its own: the training script is the same with or without it."""
    plain = script_for(tmp_path, "cluster.time=04:00:00")
    with_eval = script_for(
        tmp_path, "cluster.time=04:00:00", "cluster.eval_time=00:30:00", "training.eval_tasks=[arc_easy]"
    )
    assert with_eval == plain
    assert slurm_script.EVAL_MODULE not in with_eval and "--time=04:00:00" in sbatch_options(with_eval)
    assert with_eval.splitlines()[-1] == 'exit "$rc"'


def test_eval_job_script(tmp_path: Path) -> None:
    run = tmp_path / "my run"
    script = eval_script_for(
        tmp_path,
        "cluster.nodes=4",
        "cluster.time=04:00:00",
        "cluster.eval_time=1-02:00:00",
        "cluster.partition=gpu",
        "cluster.account=proj",
        "cluster.qos=high",
        "cluster.mem=64G",
        "cluster.cpus_per_task=16",
        "cluster.sbatch_args=['--constraint=h100']",
        "cluster.setup=['module load cuda']",
        "run.name=exp",
        run_dir=run,
    )
    bash_syntax_ok(script)
    opts = sbatch_options(script)
    for expected in (
        "--job-name=exp-eval",
        "--nodes=1",
        "--ntasks=1",
        "--time=1-02:00:00",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--mem=64G",
        "--cpus-per-task=16",
        "--constraint=h100",
        "--requeue",
        "--kill-on-invalid-dep=yes",
        f"--output={run}/logs/slurm-%j.out",
        f"--error={run}/logs/slurm-%j.err",
    ):
        assert expected in opts, (expected, opts)
    # Not the training job's shape, limit or signal; no GPU on the cpu hardware profile.
    assert not any(o.startswith(("--nodes=4", "--time=04", "--signal", "--gpus")) for o in opts), opts
    lines = script.splitlines()
    assert lines.index("module load cuda") < len(lines) - 1
    words = shlex.split(lines[-1])
    assert words[0] == "OMP_NUM_THREADS=${SLURM_CPUS_ON_NODE:-1}"  # one process: all of the job's CPUs
    assert words[1:] == ["exec", sys.executable, "-m", slurm_script.EVAL_MODULE, str(run)]
    gpu = sbatch_options(
        eval_script_for(
            tmp_path, "hardware=h100_80gb", "cluster.gpus_per_node=8", "launch.nproc_per_node=0", "strategy.dp_shard=-1"
        )
    )
    assert "--gpus-per-node=1" in gpu  # the evaluation loads the model on one device
    no_limit = sbatch_options(eval_script_for(tmp_path, "cluster.eval_time=''"))
    assert not any(o.startswith("--time") for o in no_limit)  # the partition's default limit


def test_eval_job_values_stay_quoted(tmp_path: Path) -> None:
    hydra_value = "'" + HOSTILE.replace("\\", "\\\\").replace("'", "\\'") + "'"
    run_dir = tmp_path / "run dir 'with' $(quotes)"
    script = eval_script_for(tmp_path, f"cluster.partition={hydra_value}", f"run.name={hydra_value}", run_dir=run_dir)
    bash_syntax_ok(script)
    opts = sbatch_options(script)
    assert f"--partition={HOSTILE}" in opts and f"--job-name={HOSTILE}-eval" in opts
    assert shlex.split(script.splitlines()[-1])[-1] == str(run_dir)
    job = load_job(["recipe=tiny_ddp", "cluster=slurm", "training.eval_tasks=[arc_easy]"])
    job.cfg.cluster.eval_time = "1:00\nrm -rf /"
    with pytest.raises(ConfigError, match=r"^cluster.eval_time=.*line break"):
        slurm_script.render_eval_script(job.cfg, tmp_path / "run")


@pytest.mark.parametrize("value", ["90", "30:00", "02:00:00", "2-00", "1-12:00", "1-12:00:00", "UNLIMITED", ""])
def test_slurm_time_formats_accepted(value: str) -> None:
    load_job(["recipe=tiny_ddp", "cluster=slurm", f"cluster.eval_time='{value}'", f"cluster.time='{value}'"])


@pytest.mark.parametrize("key", ["time", "eval_time"])
@pytest.mark.parametrize("value", ["2h", "01:00:00:00", "1-", "-1", "1:2:3:4", "one hour", "1 -02:00"])
def test_bad_slurm_time_is_one_line(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^cluster.{key}='{value}' is not a Slurm time limit: .*cluster.{key}="):
        load_job(["recipe=tiny_ddp", "cluster=slurm", f"cluster.{key}='{value}'"])
    load_job(["recipe=tiny_ddp", "cluster=local", f"cluster.{key}='{value}'"])  # only Slurm reads it


FAKE_SBATCH = """#!/bin/bash
# Records its arguments; prints the next job id. FAIL_DEPENDENT=1: refuses a job with a dependency.
echo "sbatch $*" >> "$FAKE_LOG"
if [ "${FAIL_DEPENDENT:-0}" = 1 ] && [[ "$*" == *--dependency=* ]]; then
  echo "sbatch: error: Requested time limit is invalid (missing or exceeds some limit)" >&2
  exit 1
fi
n=$(( $(cat "$FAKE_IDS" 2>/dev/null || echo 100) + 1 )); echo $n > "$FAKE_IDS"; echo "$n;cluster"
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch and scancel on PATH that record their calls in the returned log file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "scancel").write_text('#!/bin/bash\necho "scancel $*" >> "$FAKE_LOG"\n')
    for tool in ("sbatch", "scancel"):
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_IDS", str(tmp_path / "ids"))
    return log


def test_submit_sends_the_eval_job_after_training(tmp_path: Path, fake_slurm: Path) -> None:
    job = load_job(["recipe=tiny_ddp", "cluster=slurm", "training.eval_tasks=[arc_easy]"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sub = slurm.submit(job, run_dir)
    assert (sub.job_id, sub.eval_job_id) == ("101", "102")
    train_script, eval_script = run_dir / slurm_script.SCRIPT_NAME, run_dir / slurm_script.EVAL_SCRIPT_NAME
    assert fake_slurm.read_text().splitlines() == [
        f"sbatch --parsable {train_script}",
        f"sbatch --parsable --dependency=afterok:101 {eval_script}",
    ]
    assert eval_script.read_text() == slurm_script.render_eval_script(job.cfg, run_dir, run_dir.name)
    record = slurm.read_record(run_dir)
    assert record["job_id"] == "101" and record["eval_job_id"] == "102"
    assert record["jobs"][-1]["eval_job_id"] == "102"
    # Resubmitted without evaluation: the stale script goes, and the record no longer names an eval job.
    job.cfg.training.eval_tasks = []
    sub = slurm.submit(job, run_dir)
    assert (sub.job_id, sub.eval_job_id) == ("103", "")
    assert not eval_script.exists()
    assert slurm.read_record(run_dir)["eval_job_id"] == "" and slurm.eval_status(run_dir) is None
    assert fake_slurm.read_text().splitlines()[-1] == f"sbatch --parsable {train_script}"


def test_refused_eval_job_cancels_training(tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_DEPENDENT", "1")
    job = load_job(["recipe=tiny_ddp", "cluster=slurm", "training.eval_tasks=[arc_easy]"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(DtlaunchError, match=r"^sbatch failed .*Requested time limit.*training job 101 cancelled$"):
        slurm.submit(job, run_dir)
    assert fake_slurm.read_text().splitlines()[-1] == "scancel 101"
    assert not (run_dir / slurm.RECORD_NAME).exists()


def test_refused_submission_leaves_no_run_directory(
    tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sbatch refuses the job: the run directory `submit` created goes again (an unnamed one: its name is
    fixed once, so the script and the directory agree), and an existing one keeps its files."""
    from dtlaunch.commands.submit import submit_command

    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text('#!/bin/bash\necho "sbatch: error: invalid partition specified: gpu" >&2\nexit 1\n')
    root = tmp_path / "runs"
    with pytest.raises(DtlaunchError, match="invalid partition"):
        submit_command(["recipe=tiny_ddp", "cluster=slurm", f"run.root={root}"], [], dry_run=False, force=False)
    assert not root.exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's")
    with pytest.raises(DtlaunchError, match="invalid partition"):
        submit_command(["recipe=tiny_ddp", "cluster=slurm", f"run.dir={existing}"], [], dry_run=False, force=False)
    assert (existing / "notes.txt").read_text() == "the user's"


def test_sweep_points_get_their_eval_jobs(tmp_path: Path, fake_slurm: Path) -> None:
    """A job array: point i's evaluation waits for array task i alone."""
    cfgs = [
        load_job(["recipe=tiny_ddp", "cluster=slurm", *extra]).cfg for extra in ([], ["training.eval_tasks=[arc_easy]"])
    ]
    run_dirs = [tmp_path / "sw" / str(i) for i in range(2)]
    for cfg, run_dir in zip(cfgs, run_dirs, strict=True):
        run_dir.mkdir(parents=True)
        slurm_script.write_script(cfg, run_dir)
    script = slurm_script.render_array_script(cfgs, run_dirs, tmp_path / "sw")
    assert slurm.submit_array(script, tmp_path / "sw", run_dirs) == "101"
    calls = fake_slurm.read_text().splitlines()
    eval_script = run_dirs[1] / slurm_script.EVAL_SCRIPT_NAME
    assert calls[1:] == [f"sbatch --parsable --dependency=afterok:101_1 {eval_script}"]
    assert slurm.read_record(run_dirs[0])["eval_job_id"] == ""
    assert slurm.read_record(run_dirs[1]) | {"jobs": []} == {"jobs": [], "job_id": "101_1", "eval_job_id": "102"}


def test_cli_dry_run_shows_the_eval_job_on_stderr(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    base = ["submit", "recipe=tiny_ddp", "cluster=slurm", f"run.dir={tmp_path / 'r'}", "--dry-run"]
    plain = cli(*base, cwd=tmp_path)
    res = cli(*base, "training.eval_tasks=[arc_easy]", "cluster.eval_time=00:20:00", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == plain.stdout  # stdout: the training script alone, usable as a file
    shown = res.stderr[res.stderr.index("#!/bin/bash\n") :]
    bash_syntax_ok(shown)
    assert {"--time=00:20:00", "--kill-on-invalid-dep=yes", "--nodes=1"} <= set(sbatch_options(shown))
    assert "--dependency=afterok:<training job id>" in res.stderr
    assert not (tmp_path / "r").exists()
