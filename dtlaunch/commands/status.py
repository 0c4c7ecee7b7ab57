"""`status`: where a run stands, read from its directory (no torch, nothing written).

A Slurm run (RUN/slurm.json) asks Slurm; a local run is read from RUN/state.json (the launcher's
state, pid and host), metrics.jsonl (step and loss), config.yaml (total steps) and the checkpoints.
Without an argument: the most recent runs under run.root, as a table.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Optional

from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import CONFIG_NAME, METRICS_NAME, STATE_NAME

RECENT = 20


def _last_metrics(run_dir: Path) -> dict:
    """The last complete line of metrics.jsonl, read from the end of the file (it can be large)."""
    path = run_dir / METRICS_NAME
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return dict(json.loads(line))
        except (ValueError, TypeError):
            continue
    return {}


def _total_steps(run_dir: Path, state: dict) -> Optional[int]:
    if isinstance(state.get("total_steps"), int):
        return state["total_steps"]
    import yaml

    try:
        return int(yaml.safe_load((run_dir / CONFIG_NAME).read_text())["training"]["steps"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def _checkpoint_root(run_dir: Path) -> Path:
    import yaml

    try:
        d = Path(str(yaml.safe_load((run_dir / CONFIG_NAME).read_text())["checkpoint"]["dir"]))
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        d = Path("checkpoints")
    return d if d.is_absolute() else run_dir / d


def local_status(run_dir: Path) -> dict[str, Any]:
    """state, step, total_steps, last_loss, newest_checkpoint, pid, host, error for one run directory."""
    from dtlaunch.launch.runstate import pid_alive, read_state
    from dtlaunch.run import preemption
    from dtlaunch.run.checkpoints import newest_complete

    if not (run_dir / CONFIG_NAME).is_file():
        raise InputError(f"'{run_dir}' is not a dtlaunch run directory (no config.yaml): give runs/<name>")
    state = read_state(run_dir)
    last = _last_metrics(run_dir)
    name = state.get("state")
    if name == "running":
        pid = state.get("pid")
        same_host = state.get("host") == socket.gethostname()
        if same_host and isinstance(pid, int) and not pid_alive(pid):
            # The launcher was killed without a chance to record it (SIGKILL, a reboot).
            name = "failed"
            state.setdefault("error", f"the launcher (pid {pid}) is gone without recording an end")
    elif name is None:
        # A run from before state.json existed: what its files say.
        if (run_dir / "summary.json").is_file():
            name = "finished"
        elif preemption.read_marker(run_dir) is not None:
            name = "preempted"
        else:
            name = "unknown"
    ckpt, _ = newest_complete(_checkpoint_root(run_dir))
    return {
        "run_dir": str(run_dir),
        "state": name,
        "step": last.get("step"),
        "total_steps": _total_steps(run_dir, state),
        "last_loss": last.get("loss"),
        "newest_checkpoint": str(ckpt.path) if ckpt is not None else None,
        "pid": state.get("pid"),
        "host": state.get("host"),
        "error": state.get("error") if name in ("failed", "preempted") else None,
    }


def _fmt_step(st: dict) -> str:
    step, total = st.get("step"), st.get("total_steps")
    return f"{step if step is not None else '-'}/{total if total is not None else '?'}"


def _fmt_loss(st: dict) -> str:
    return f"{st['last_loss']:.4f}" if isinstance(st.get("last_loss"), (int, float)) else "-"


def _last_activity(run_dir: Path) -> float:
    files = (run_dir / f for f in (STATE_NAME, METRICS_NAME, CONFIG_NAME))
    return max(f.stat().st_mtime for f in files if f.exists())


def resolve_run_dir(run: str, root: Optional[str]) -> Path:
    """A run given as a directory or as a name under `root` (run.root), made absolute."""
    from dtlaunch.config.schema import RunConfig

    root = root or RunConfig().root
    run_dir = Path(run)
    if not run_dir.is_dir() and (Path(root) / run).is_dir():
        run_dir = Path(root) / run
    if not run_dir.is_dir():
        raise InputError(f"run '{run}' not found: give a run directory (or a name under {root}/)")
    return run_dir.resolve()


def run_status_command(run: Optional[str], root: Optional[str], as_json: bool) -> int:
    from dtlaunch.commands.common import console
    from dtlaunch.commands.sweep import SWEEP_RECORD

    if run is None:
        return recent_runs_command(root, as_json)
    run_dir = resolve_run_dir(run, root)
    if (run_dir / SWEEP_RECORD).is_file() and not (run_dir / CONFIG_NAME).is_file():
        return recent_runs_command(str(run_dir), as_json)  # a sweep directory: its points
    if (run_dir / "kubernetes.json").is_file():
        from dtlaunch.commands.submit_remote import kubernetes_status_command

        return kubernetes_status_command(run_dir, as_json=as_json)
    if (run_dir / "skypilot.json").is_file():
        from dtlaunch.commands.submit_remote import skypilot_status_command

        return skypilot_status_command(run_dir, as_json=as_json)
    if (run_dir / "slurm.json").is_file():
        from dtlaunch.commands.submit import status_command

        return status_command(str(run_dir), as_json=as_json)
    st = local_status(run_dir)
    if as_json:
        print(json.dumps(st))
        return 0
    out = console()
    line = f"{run_dir}: {st['state']}, step {_fmt_step(st)}, last loss {_fmt_loss(st)}"
    if st["state"] == "running" and st["pid"]:
        line += f", pid {st['pid']}" + (f" on {st['host']}" if st["host"] else "")
    out.print(line, markup=False)
    out.print(f"newest checkpoint: {st['newest_checkpoint'] or 'none'}", markup=False)
    if st["error"]:
        out.print(f"error: {st['error']}", markup=False)
    return 0


def recent_runs_command(root: Optional[str], as_json: bool) -> int:
    from dtlaunch.commands.common import console
    from dtlaunch.report.tables import plain_table

    if root is None:
        from dtlaunch.config.schema import RunConfig

        root = RunConfig().root
    base = Path(root)
    if not base.is_dir():
        raise InputError(f"no runs under '{base}': give a run directory, or --root DIR (run.root of your runs)")
    runs = [p for p in base.iterdir() if (p / CONFIG_NAME).is_file()]
    runs.sort(key=_last_activity, reverse=True)
    statuses = [local_status(p.resolve()) for p in runs[:RECENT]]
    if as_json:
        print(json.dumps(statuses))
        return 0
    out = console()
    rows = [
        [
            Path(st["run_dir"]).name,
            st["state"],
            _fmt_step(st),
            _fmt_loss(st),
            Path(st["newest_checkpoint"]).name if st["newest_checkpoint"] else "-",
            str(st["pid"]) if st["state"] == "running" and st["pid"] else "-",
        ]
        for st in statuses
    ]
    t = plain_table(["run", "state", "step", "loss", "checkpoint", "pid"], rows, out.width, title=f"runs in {base}")
    t.columns[0].no_wrap = True
    out.print(t)
    if len(runs) > RECENT:
        out.print(f"({len(runs) - RECENT} older run(s) not shown)", markup=False)
    return 0
