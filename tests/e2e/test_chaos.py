"""Chaos: a job whose launcher's process group is SIGKILLed at random moments, restarted until it finishes.

A kill lands during the warm start, mid-step, mid-save or mid-async-save (a checkpoint's temporary
directory exists) of DDP, FSDP or LoRA runs, as the OOM killer, `kill -9` or a lost terminal would. After
each kill no worker of the run may be alive 2 s later; every restart (the same command) must be accepted
and resume; the finished run's losses must equal an uninterrupted run's bit for bit (fp32).

Seeded (DTLAUNCH_CHAOS_SEED, default 0): the same seed picks the same layouts, moments and delays.
CI profile: CI_KILLS kills of one job (one reference run). The long profile, for a night or a release:

    DTLAUNCH_CHAOS_KILLS=100 pytest -s tests/e2e/test_chaos.py

prints one line per kill and, with DTLAUNCH_CHAOS_REPORT=FILE, writes the tally there as JSON.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import pytest
from cli_server import run_dtlaunch
from processes import run_workers

STEPS = 8
COMMON = [
    f"training.steps={STEPS}",
    "training.seq_len=32",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",  # pruning runs all along: what orphans used to break
    "launch.threads_per_worker=1",
    "training.loss_plot=false",
    "logging.trackers=[]",  # TensorBoard's imports on every attempt: nothing here reads its files
]
LAYOUTS = {
    "ddp": ["recipe=tiny_ddp"],
    "fsdp": ["recipe=tiny_fsdp"],
    "lora": ["recipe=tiny_fsdp", "peft=lora"],
    "ddp_async": ["recipe=tiny_ddp", "checkpoint.async_save=true"],
    "lora_async": ["recipe=tiny_fsdp", "peft=lora", "checkpoint.async_save=true"],
}
# Saves last longer on rank 1 (no effect on numerics), so that "mid-save" is a moment a kill can find.
SLOW_SAVE = ["debug.slow_save_s=0.5", "debug.fail_rank=1"]
MOMENTS = ("warm_start", "step", "save")
CI_KILLS = 3
ORPHAN_GRACE_S = 2.0
ATTEMPT_TIMEOUT_S = 300.0


def _losses(run_dir: Path) -> dict[int, float]:
    """The last loss logged for each step; every line must be whole (a kill may not tear one)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, lines)}


class Attempt:
    """One `dtlaunch train` in a process group of its own (as a terminal starts it), output to files."""

    def __init__(self, run_dir: Path, args: list[str], n: int) -> None:
        self.out = run_dir.parent / f"{run_dir.name}.attempt{n}.out"
        self.started = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dtlaunch", "train", *args, f"run.dir={run_dir}"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return self.out.read_text()[-3000:]


def _wait_for(attempt: Attempt, ready: Callable[[], bool], timeout: float = ATTEMPT_TIMEOUT_S) -> bool:
    """Until `ready()` (True) or the attempt ended by itself (False)."""
    deadline = time.monotonic() + timeout
    while attempt.alive() and time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(0.02)
    return False


def _saving(run_dir: Path, since: float) -> bool:
    """A checkpoint is being written by this attempt: a temporary directory changed since it started
    (one a killed attempt left behind is not a save in progress)."""
    root = run_dir / "checkpoints"
    try:
        return any(p.name.startswith(".tmp-step-") and p.stat().st_mtime >= since for p in root.iterdir())
    except OSError:  # no directory yet, or one renamed while we looked
        return False


def _logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def _arm(moment: str, run_dir: Path, attempt: Attempt, rng: random.Random) -> bool:
    """Wait for the moment to kill at; False when the attempt finished first."""
    if moment == "warm_start":  # composing, planning, importing torch's agent, starting workers
        time.sleep(rng.uniform(0.05, 2.0))
        return attempt.alive()
    if moment == "step":
        target = _logged(run_dir) + rng.randint(1, 3)
        if not _wait_for(attempt, lambda: _logged(run_dir) >= target):
            return False
        time.sleep(rng.uniform(0.0, 0.3))
        return attempt.alive()
    if not _wait_for(attempt, lambda: _saving(run_dir, attempt.started)):  # save: sync or async, by the layout
        return False
    time.sleep(rng.uniform(0.0, 0.3))
    return attempt.alive()


def _kill_group(attempt: Attempt, run_dir: Path) -> list[int]:
    """SIGKILL the launcher's process group; the run's workers still alive 2 s after the launcher died."""
    os.killpg(attempt.proc.pid, signal.SIGKILL)
    attempt.proc.wait(timeout=60)
    died = time.monotonic()
    while run_workers(run_dir) and time.monotonic() - died < ORPHAN_GRACE_S:
        time.sleep(0.05)
    orphans = run_workers(run_dir)
    for pid in orphans:  # not left to spoil the rest of the session
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return orphans


def chaos(
    kills: int,
    seed: int,
    workdir: Path,
    reference: Callable[[str], dict[int, float]],
    per_job: tuple[int, int] = (1, 3),
    say: Callable[[str], None] = print,
) -> dict:
    """Jobs of random layouts, each killed `per_job` (at least, at most) times at random moments and then
    run to its end, until `kills` kills were made. Fails at the first orphan, refused restart or loss
    mismatch."""
    rng = random.Random(seed)
    tally: dict = {"seed": seed, "kills": 0, "jobs": 0, "moments": Counter(), "mid_save": 0, "layouts": Counter()}
    while tally["kills"] < kills:
        layout = rng.choice(sorted(LAYOUTS))
        args = [*LAYOUTS[layout], *COMMON, *SLOW_SAVE]
        run_dir = (workdir / f"job{tally['jobs']}-{layout}").resolve()
        tally["jobs"] += 1
        tally["layouts"][layout] += 1
        planned = min(rng.randint(*per_job), kills - tally["kills"])
        n = 0
        while True:
            attempt = Attempt(run_dir, args, n)
            n += 1
            moment: Optional[str] = rng.choice(MOMENTS) if planned > 0 else None
            if moment is not None and _arm(moment, run_dir, attempt, rng):
                mid_save = _saving(run_dir, attempt.started)
                orphans = _kill_group(attempt, run_dir)
                planned -= 1
                tally["kills"] += 1
                tally["moments"][moment] += 1
                tally["mid_save"] += int(mid_save)
                say(
                    f"kill {tally['kills']}/{kills}: {layout} attempt {n} at {moment}"
                    f"{' (a checkpoint was being written)' if mid_save else ''}, last logged step "
                    f"{max(_losses(run_dir), default=0) if (run_dir / 'metrics.jsonl').exists() else 0}"
                )
                assert not orphans, f"{layout}: workers {orphans} outlived their launcher by {ORPHAN_GRACE_S} s"
                continue
            try:
                rc = attempt.proc.wait(timeout=ATTEMPT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(attempt.proc.pid, signal.SIGKILL)
                pytest.fail(f"{layout} attempt {n} did not end in {ATTEMPT_TIMEOUT_S} s:\n{attempt.tail()}")
            # Every restart is accepted: no refusal of the run directory, no unreadable checkpoint.
            assert rc == 0, f"{layout} attempt {n} after {tally['kills']} kills exited {rc}:\n{attempt.tail()}"
            break
        assert _losses(run_dir) == reference(layout), f"{layout}: losses differ from the uninterrupted run"
        assert (run_dir / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE.json").is_file()
    return tally


@pytest.mark.slow
@pytest.mark.slow_reason("CI_KILLS kills of one job, each followed by a real restart, plus the uninterrupted reference")
def test_sigkilled_launchers_restart_to_identical_losses(tmp_path: Path) -> None:
    kills = int(os.environ.get("DTLAUNCH_CHAOS_KILLS", CI_KILLS))
    seed = int(os.environ.get("DTLAUNCH_CHAOS_SEED", "0"))
    references: dict[str, dict[int, float]] = {}

    def reference(layout: str) -> dict[int, float]:
        if layout not in references:
            run_dir = tmp_path / f"reference-{layout}"
            env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
            args = ["train", *LAYOUTS[layout], *COMMON, f"run.dir={run_dir}"]
            proc = run_dtlaunch(args, env=env, timeout=ATTEMPT_TIMEOUT_S)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            references[layout] = _losses(run_dir)
            assert sorted(references[layout]) == list(range(1, STEPS + 1))
        return references[layout]

    began = time.monotonic()
    per_job = (1, 3) if kills > CI_KILLS else (kills, kills)  # CI: one job, so one uninterrupted reference
    tally = chaos(kills, seed, tmp_path, reference, per_job, say=lambda line: print(line, flush=True))
    tally["seconds"] = round(time.monotonic() - began)
    print(f"chaos: {json.dumps(tally)}", flush=True)
    if os.environ.get("DTLAUNCH_CHAOS_REPORT"):
        Path(os.environ["DTLAUNCH_CHAOS_REPORT"]).write_text(json.dumps(tally, indent=2) + "\n")
    assert tally["kills"] == kills
