"""The run directory: `runs/<name>/` holding the resolved config that workers read, and logs/.

A run directory may already exist (a resume, possibly on another layout): its previous config is kept as
`config.prev-<n>.yaml` when the new one differs, so the history of layouts a run went through stays visible.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from dtlaunch.errors import InputError
from dtlaunch.run.run_dir import CONFIG_NAME, LOGS_DIR, METRICS_NAME

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig


def run_name(cfg: JobConfig, recipe: str) -> str:
    """run.name, else "<recipe>-<YYYYmmdd-HHMMSS>" (resolved once here, never in the workers)."""
    return cfg.run.name or f"{recipe or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_dir_for(cfg: JobConfig, recipe: str) -> Path:
    return Path(cfg.run.dir) if cfg.run.dir else Path(cfg.run.root) / run_name(cfg, recipe)


def pin_run_dir(cfg: JobConfig, recipe: str) -> Path:
    """The run directory, its name fixed in the config first: the default name holds the time, and the
    lock, the directory, the scripts and config.yaml must all name the same one (computed twice, two
    calls a second apart would give two directories)."""
    if not cfg.run.name and not cfg.run.dir:
        cfg.run.name = run_name(cfg, recipe)
    return run_dir_for(cfg, recipe).resolve()


@contextlib.contextmanager
def removed_if_failed(run_dir: Path) -> Iterator[None]:
    """A run directory this command creates is removed again if the command fails before its job starts (a
    failed preparation or submission leaves nothing behind), with any parent it created that stays empty.
    A directory that existed before is never touched: it may hold a user's checkpoints and logs."""
    created = [p for p in [run_dir, *run_dir.parents] if not p.exists()]
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in created[1:]:
                try:
                    parent.rmdir()  # only while empty: another command may have started a run there meanwhile
                except OSError:
                    break
        raise


def create_run_dir(cfg: JobConfig, recipe: str) -> Path:
    """Create the run directory and write the resolved config.yaml; return the absolute path."""
    from omegaconf import OmegaConf

    run_dir = run_dir_for(cfg, recipe).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"run directory '{run_dir}' exists and is not a directory: set run.dir to a directory")
    try:
        (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create run directory '{run_dir}': {exc.strerror}; set run.dir or run.root") from exc
    from dtlaunch.launch.local import follows_node_0

    if follows_node_0(cfg.launch):
        return run_dir  # node 0 writes the shared directory's config.yaml (this node's differs in node_rank)
    new_text = OmegaConf.to_yaml(cfg, resolve=True)
    path = run_dir / CONFIG_NAME
    if path.is_file():
        old_text = path.read_text()
        if old_text == new_text:
            return run_dir
        path.rename(_free_prev_name(run_dir))
    # Write then rename: a worker (or a crash) never sees half a config. The name is this process's own:
    # launchers sharing the directory (the nodes of a job whose rank is unknown) never rename each other's file.
    tmp = run_dir / f".{CONFIG_NAME}.{os.getpid()}.tmp"
    tmp.write_text(new_text)
    tmp.replace(path)
    return run_dir


def _free_prev_name(run_dir: Path) -> Path:
    n = 1
    while (run_dir / f"config.prev-{n}.yaml").exists():
        n += 1
    return run_dir / f"config.prev-{n}.yaml"


def move_checkpoints_aside(cfg: JobConfig, run_dir: Path) -> Path | None:
    """`--no-resume` on a run directory with checkpoints: rename its checkpoint directory to
    `<dir>.prev-<time>` (never delete: they may be the only copy of days of training) and its
    metrics.jsonl to `metrics.prev-<time>.jsonl` (the fresh run's step 1.. must not mix with the old
    lines). Returns the new checkpoint directory, or None when there was nothing to move."""
    from dtlaunch.run.checkpoints import checkpoint_root, scan_checkpoints

    root = checkpoint_root(cfg, run_dir)
    if not scan_checkpoints(root):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = root.with_name(f"{root.name}.prev-{stamp}")
    n = 1
    while target.exists():  # two fresh starts within a second
        target = root.with_name(f"{root.name}.prev-{stamp}-{n}")
        n += 1
    try:
        root.rename(target)
    except OSError as exc:
        raise InputError(f"cannot move the checkpoints '{root}' aside for --no-resume: {exc.strerror}") from exc
    metrics = run_dir / METRICS_NAME
    if metrics.is_file():
        metrics.rename(run_dir / f"metrics.prev-{target.name.split('.prev-', 1)[1]}.jsonl")
    return target
