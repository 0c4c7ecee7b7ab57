"""What every benchmark shares: the machine description, repetition statistics, timed subprocesses,
and Markdown tables. Standard library only at import time (the harness must not pay for torch twice).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers narrow), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def git_revision() -> str:
    """HEAD's short hash, '+dirty' when the working tree has changes; '' outside a checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on: CPU, cores, memory, torch, GPU (if any), load, date."""
    import torch  # here, not at import: the harness's own start-up is part of nothing measured

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 0.0
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "memory_gib": round(mem_gib, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": gpus,
        "git": git_revision(),
        # Benchmarks are only as quiet as the machine: the load when the suite started says how quiet.
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def describe_machine(info: dict[str, Any]) -> str:
    """One line for a results file header."""
    gpu = ", ".join(info.get("gpus") or []) or "no GPU"
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, {info['os']}, Python {info['python']}, "
        f"torch {info['torch']}, {gpu}; git {info.get('git') or '?'}; load {info.get('loadavg_1m')} at start"
    )


def stats(values: Iterable[float]) -> dict[str, Any]:
    """min / median / max / n of a list of repetitions (None everywhere when it is empty)."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": v[0], "median": statistics.median(v), "max": v[-1], "n": len(v)}


def command_line(cmd: Sequence[str], env: Optional[dict[str, str]] = None) -> str:
    """A copy-pasteable shell command, with the environment variables that differ from ours in front;
    paths inside the checkout are written relative to it and the venv's programs by name, so a results
    file reads the same on every machine."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join([*prefix, *(shlex.quote(_portable(str(c))) for c in cmd)])


def _portable(arg: str) -> str:
    for venv in (ROOT / ".venv" / "bin", Path(sys.executable).parent):
        if arg.startswith(f"{venv}/"):
            return Path(arg).name
    return arg[len(f"{ROOT}/") :] if arg.startswith(f"{ROOT}/") else arg


def this_command() -> str:
    """How this process was started (for the results file's 'command' field)."""
    return command_line([Path(sys.executable).name if "venv" not in sys.executable else "python", *sys.argv])


def time_process(cmd: Sequence[str], env: Optional[dict[str, str]] = None, timeout: float = 120) -> float:
    """Wall seconds of one whole process, start to exit; raises CalledProcessError on failure."""
    t0 = time.perf_counter()
    done = subprocess.run(
        list(cmd), env=_env(env), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return wall


def time_process_cpu(cmd: Sequence[str], timeout: float = 120) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one whole process. The CPU figure is what the command
    costs whatever else loads the machine; the wall figure is what a user waits on this machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time_process(cmd, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _env(extra: Optional[dict[str, str]]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    return env


def venv_bin(name: str) -> str:
    """A console script next to this interpreter (dtlaunch, torchrun), else the name on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def fmt(value: Any, digits: int = 2) -> str:
    """Numbers for tables: thousands separators for big ones, fixed decimals for small ones."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells go through `fmt` (pipes in text are escaped)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        cells = [fmt(c).replace("|", "\\|") for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def min_med_max(s: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    """'median (min-max)' of a stats() dict, e.g. '0.21 (0.19-0.25)'."""
    if not s.get("n"):
        return "-"
    return f"{fmt(s['median'] * scale, digits)} ({fmt(s['min'] * scale, digits)}–{fmt(s['max'] * scale, digits)})"


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
