"""A real single-node Slurm for the system tests: munged + slurmctld + slurmd started here, as root.

Everything lives in a private temp dir with its own ports, so it never touches a site Slurm or
another test session's. Every daemon is started in the foreground as our child and stopped by its PID
at the end; each setting below says why it is there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
from ports import listen_port

PACKAGES = ["munge", "slurmctld", "slurmd", "slurm-client"]
TOOLS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo"]


def _install_slurm() -> None:
    # Debian installs the daemons and mungekey into /usr/sbin, which a minimal PATH (CI, `env -i`) lacks.
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join(path + [d for d in ("/usr/sbin", "/sbin") if d not in path])
    if all(shutil.which(t) for t in TOOLS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = "apt-get update -qq && apt-get install -y -qq --no-install-recommends " + " ".join(PACKAGES)
    res = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"installing Slurm failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")


def _mem_mib() -> int:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return kib // 1024


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def wait_for(self, pred, timeout: float, what: str) -> None:
        """Poll `pred` until it holds (a test's own condition: a log line, a checkpoint, a queue state)."""
        _wait(pred, timeout, what)

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        res = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {res.returncode}: {res.stderr.strip()} {res.stdout.strip()}")
        return res

    def job_field(self, job_id: str, key: str) -> str:
        res = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        for token in res.stdout.split():
            k, _, v = token.partition("=")
            if k == key:
                return v
        return ""

    def wait_state(self, job_id: str, states: set[str], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(
            f"job {job_id} did not reach {states} in {timeout} s (last state {state!r})\n"
            + self.run("scontrol", "show", "job", job_id, check=False).stdout
        )

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            p = self.root / "log" / name
            if p.is_file():
                out.append(f"--- {name}\n" + "\n".join(p.read_text().splitlines()[-30:]))
        return "\n".join(out)


def _write_conf(root: Path, node: str, munge_socket: Path) -> Path:
    for d in ("state", "spool", "log", "run"):
        (root / d).mkdir(exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=dtlaunchtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={listen_port()}
SlurmdPort={listen_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MailProg=/bin/true
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
KillWait=20
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory={int(_mem_mib() * 0.9)} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _start_munge(root: Path) -> tuple[subprocess.Popen, Path]:
    mdir = root / "munge"
    mdir.mkdir()
    key, sock = mdir / "munge.key", mdir / "munge.socket.2"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    shutil.chown(mdir, "munge", "munge")
    shutil.chown(key, "munge", "munge")
    key.chmod(0o600)
    proc = subprocess.Popen(
        [
            "setpriv",
            "--reuid=munge",
            "--regid=munge",
            "--init-groups",
            "munged",
            "-F",
            f"--socket={sock}",
            f"--key-file={key}",
            f"--pid-file={mdir / 'munged.pid'}",
            f"--seed-file={mdir / 'munged.seed'}",
            f"--log-file={root / 'log' / 'munged.log'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait(lambda: sock.exists(), 10, "munged socket", proc)
    return proc, sock


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the daemon exited with {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running one-node Slurm; `cluster.env` has SLURM_CONF for every client command."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm fixture installs packages and starts daemons: needs root")
    _install_slurm()
    # A world-traversable private dir: munged runs as user munge and must reach its socket dir.
    root = Path(tempfile.mkdtemp(prefix="dtlaunch-slurm-"))
    root.chmod(0o755)
    node = socket.gethostname().split(".")[0]
    procs: dict[str, subprocess.Popen] = {}
    try:
        (root / "log").mkdir()
        shutil.chown(root / "log", "munge", "munge")
        procs["munged"], sock = _start_munge(root)
        (root / "log").chmod(0o777)
        conf = _write_conf(root, node, sock)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        devnull = subprocess.DEVNULL
        procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(conf)], env=env, stdout=devnull, stderr=devnull
        )
        procs["slurmd"] = subprocess.Popen(["slurmd", "-D", "-f", str(conf)], env=env, stdout=devnull, stderr=devnull)
        cluster = SlurmCluster(root=root, conf=conf, node=node, env=env, procs=procs)

        def node_idle() -> bool:
            res = cluster.run("sinfo", "-h", "-n", node, "-o", "%T", check=False, timeout=10)
            return res.returncode == 0 and res.stdout.strip().rstrip("*") == "idle"

        try:
            _wait(node_idle, 30, "the Slurm node to be idle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{cluster.logs()}") from None
        yield cluster
        # Our jobs only: this controller knows no others. Let them die before the daemons go.
        cluster.run("scancel", "--full", "--user=root", check=False)
        _wait(lambda: not cluster.run("squeue", "-h", check=False).stdout.strip(), 30, "the queue to drain")
    finally:
        for name in ("slurmd", "slurmctld", "munged"):
            if name in procs:
                _stop(procs[name])
        shutil.rmtree(root, ignore_errors=True)
