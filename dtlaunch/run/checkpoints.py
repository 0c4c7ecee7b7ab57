"""The checkpoint catalog: names, listing and validation of a run's checkpoints, without torch.

`dtlaunch ckpt`, `status`, the launcher's preflight and the workers' manager
(dtlaunch.train.checkpoint.manager) all read checkpoints through these. A checkpoint is complete when it
has its final name, a readable marker `COMPLETE.json`, DCP's `.metadata` and the trainer state, and
every file at its recorded size; `verify` also checks every file's checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dtlaunch.errors import ConfigError
from dtlaunch.run.env import VERIFIED_ENV

if TYPE_CHECKING:
    from dtlaunch.config.schema import JobConfig

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
MARKER = "COMPLETE.json"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    d = Path(cfg.checkpoint.dir)
    return d if d.is_absolute() else Path(run_dir) / d


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    complete: bool
    reason: str = ""  # why it is not complete
    marker: dict = field(default_factory=dict)
    verified: bool = False  # contents checked against the marker's checksums

    @property
    def name(self) -> str:
        return self.path.name


def _parse_step(name: str) -> Optional[int]:
    for prefix in (STEP_PREFIX, TMP_PREFIX):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return int(name[len(prefix) :])
    return None


def check_checkpoint(path: Path, verify: bool = False) -> CheckpointInfo:
    """Complete = final name, a readable marker, `.metadata`, and every file at its recorded size;
    with `verify`, also every file's content against its recorded checksum (reads every byte)."""
    path = Path(path)
    step = _parse_step(path.name)
    info = CheckpointInfo(path=path, step=-1 if step is None else step, complete=False)
    if path.name.startswith(TMP_PREFIX):
        info.reason = "interrupted save (never marked complete)"
        return info
    marker_file = path / MARKER
    if not marker_file.is_file():
        info.reason = f"no completion marker {MARKER}"
        return info
    try:
        marker = json.loads(marker_file.read_text())
        files = dict(marker["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        info.reason = f"unreadable marker ({type(exc).__name__})"
        return info
    info.marker = marker
    if ".metadata" not in files or STATE_FILE not in files:
        info.reason = "marker lists no .metadata or trainer state"
        return info
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            info.reason = f"missing file {rel}"
            return info
        if f.stat().st_size != size:
            info.reason = f"file {rel} has {f.stat().st_size} bytes, marker says {size}"
            return info
    info.complete = True
    if verify:
        verify_info(info)
    return info


def verify_info(info: CheckpointInfo) -> CheckpointInfo:
    """Check a complete checkpoint's contents against the marker's checksums (markers written before
    checksums existed are checked by size only); a mismatch makes it incomplete, naming the file."""
    from dtlaunch.run.checksums import verify_files

    checksums = info.marker.get("checksums")
    if info.complete and not info.verified and verified_by_launcher(info.path):
        info.verified = True
    if info.complete and not info.verified and isinstance(checksums, dict):
        reason = verify_files(info.path, checksums)
        if reason:
            info.complete, info.reason = False, reason
        else:
            info.verified = True
    return info


def scan_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Every checkpoint directory (complete or not) under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [check_checkpoint(p) for p in root.iterdir() if p.is_dir() and _parse_step(p.name) is not None]
    # A temporary and a final directory of the same step: the final one sorts last (preferred).
    return sorted(found, key=lambda i: (i.step, not i.path.name.startswith(TMP_PREFIX)))


def verified_stamp(path: Path) -> str:
    return f"{Path(path).resolve()}\n{(Path(path) / MARKER).stat().st_mtime_ns}"


def verified_by_launcher(path: Path) -> bool:
    try:
        return os.environ.get(VERIFIED_ENV) == verified_stamp(path)
    except OSError:
        return False


def newest_complete(root: Path, verify: bool = False) -> tuple[Optional[CheckpointInfo], list[CheckpointInfo]]:
    """The newest complete checkpoint and the newer ones skipped because they are incomplete or corrupt
    (with `verify`, contents are checked too, newest first, until one is intact)."""
    skipped: list[CheckpointInfo] = []
    for info in reversed(scan_checkpoints(root)):
        if info.complete and verify:
            verify_info(info)
        if info.complete:
            return info, skipped
        skipped.append(info)
    return None, skipped


def resolve_load_path(path: Path, verify: bool = False) -> tuple[CheckpointInfo, list[CheckpointInfo]]:
    """A checkpoint directory, a checkpoints directory or a run directory -> the checkpoint to load."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint '{path}' does not exist: give a step-XXXXXXXX directory or a run directory")
    if _parse_step(path.name) is not None:
        info = check_checkpoint(path, verify=verify)
        if not info.complete:
            raise ConfigError(f"checkpoint '{path}' is incomplete or corrupt ({info.reason}): pick another one")
        return info, []
    for candidate in (path, path / "checkpoints"):
        info, skipped = newest_complete(candidate, verify=verify)
        if info is not None:
            return info, skipped
        if skipped:
            reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:3])
            raise ConfigError(f"no intact checkpoint in '{candidate}' ({reasons}): start a new run.dir")
    raise ConfigError(f"no complete checkpoint in '{path}': see `dtlaunch ckpt ls {path}`")


def refuse_if_checkpoints(cfg: JobConfig, run_dir: Path) -> None:
    """`--no-resume`: a run directory that already holds checkpoints is an error (exit 2)."""
    found = scan_checkpoints(checkpoint_root(cfg, run_dir))
    if found:
        raise ConfigError(
            f"run directory '{run_dir}' already has checkpoints (newest {found[-1].name}) and --no-resume was given: "
            f"use a new run.dir or drop --no-resume"
        )


def config_hash(cfg: JobConfig, section: Optional[str] = None) -> str:
    """Stable short hash of the resolved config (or one section, e.g. 'model')."""
    from dtlaunch.config.schema import to_dict

    d = to_dict(cfg)
    if section is not None:
        d = dict(d[section])
        d.pop("init_from", None)  # where weights came from does not change their shapes
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def layout_description(cfg: JobConfig, world: int) -> dict:
    from dtlaunch.config.layout import Layout

    lay = Layout.resolve(cfg.strategy, world)
    return {
        "world": world,
        "dp_replicate": lay.dp_replicate,
        "dp_shard": lay.dp_shard,
        "tp": lay.tp,
        "pp": lay.pp,
        "ep": lay.ep,
        "cp": lay.cp,
        "zero_stage": int(cfg.strategy.zero_stage),
    }


def layout_str(layout: dict) -> str:
    """'world 4 = rep 1 x shard 2 x tp 2 x pp 1, zero 3' (the layout a checkpoint was written by)."""
    if not layout:
        return "?"
    cp = f"x cp {layout['cp']} " if layout.get("cp", 1) > 1 else ""
    return (
        f"world {layout.get('world')} = rep {layout.get('dp_replicate')} x shard {layout.get('dp_shard')} {cp}"
        f"x tp {layout.get('tp')} x pp {layout.get('pp')}"
        + (f" (ep {layout['ep']})" if layout.get("ep", 1) > 1 else "")
        + f", zero {layout.get('zero_stage')}"
    )


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
