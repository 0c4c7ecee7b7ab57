"""`ckpt ls | inspect | export`: what a run's checkpoints are, what one holds, and converting one."""

from __future__ import annotations

import time
from pathlib import Path

from dtlaunch.commands.common import console
from dtlaunch.errors import InputError


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _compact(layout: dict) -> str:
    if not layout:
        return "?"
    dims = "x".join(str(layout.get(k)) for k in ("dp_replicate", "dp_shard", "tp", "pp"))
    return f"{layout.get('world')}={dims}, z{layout.get('zero_stage')}"


def _checkpoints_dir(run: Path) -> Path:
    """A run directory (its config's checkpoint.dir) or a checkpoints directory itself."""
    from dtlaunch.train.checkpoint import checkpoint_root

    if (run / "config.yaml").is_file():
        from dtlaunch.config.compose import load_resolved

        return checkpoint_root(load_resolved(run / "config.yaml"), run)
    return run / "checkpoints" if (run / "checkpoints").is_dir() else run


def ls_command(run: str) -> int:
    from rich.table import Table

    from dtlaunch.train.checkpoint import dir_size, scan_checkpoints

    path = Path(run)
    if not path.is_dir():
        raise InputError(f"run directory '{run}' does not exist: give a run directory (runs/<name>)")
    root = _checkpoints_dir(path)
    infos = scan_checkpoints(root)
    out = console()
    if not infos:
        out.print(f"no checkpoints in {root}", markup=False)
        return 0
    t = Table(title=str(root), title_justify="left")
    for col in ("name", "step", "status", "time", "size", "layout"):
        t.add_column(col, no_wrap=True)
    for i in infos:
        when = i.marker.get("time") or time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(i.path.stat().st_mtime))
        status = "complete" if i.complete else "INCOMPLETE"
        size = _human_bytes(dir_size(i.path))
        t.add_row(i.name, str(i.step), status, when.replace("T", " ")[:16], size, _compact(i.marker.get("layout", {})))
    out.print(t)
    out.print("layout: world=dp_replicate x dp_shard x tp x pp, zero stage", markup=False)
    for i in infos:
        if not i.complete:
            out.print(f"{i.name}: incomplete ({i.reason}); never loaded", markup=False)
    return 0


def inspect_command(checkpoint: str) -> int:
    import torch.distributed.checkpoint as dcp
    from rich.table import Table
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlaunch.train.checkpoint import STATE_FILE, layout_str, resolve_load_path

    info, _ = resolve_load_path(Path(checkpoint))
    meta = dcp.FileSystemReader(str(info.path)).read_metadata()
    out = console()
    mk = info.marker
    out.print(f"checkpoint {info.path}", markup=False)
    out.print(f"  step {mk.get('step')}, written {mk.get('time')} by {layout_str(mk.get('layout', {}))}", markup=False)
    out.print(
        f"  model {mk.get('model', {}).get('name')} (model hash {mk.get('model_hash')}, config hash "
        f"{mk.get('config_hash')}); consumed {mk.get('consumed_samples')} samples / "
        f"{mk.get('consumed_tokens')} tokens; {_human_bytes(mk.get('bytes', 0))}",
        markup=False,
    )
    t = Table(show_header=True)
    for col in ("tensor", "shape", "dtype", "chunks"):
        t.add_column(col)
    n_opt = 0
    for key, md in sorted(meta.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            continue
        if key.startswith("optim."):
            n_opt += 1
            continue
        dtype = str(md.properties.dtype).replace("torch.", "")
        t.add_row(key, "x".join(str(s) for s in md.size) or "()", dtype, str(len(md.chunks)))
    out.print(t)
    out.print(f"  + {n_opt} optimizer state tensors; trainer state in {STATE_FILE}", markup=False)
    return 0


def export_command(src: str, fmt: str, out_dir: str, max_shard_size: str) -> int:
    from dtlaunch.convert.hf import export_checkpoint

    files = export_checkpoint(Path(src), fmt, Path(out_dir), _parse_size(max_shard_size))
    out = console()
    for f in files:
        out.print(f"wrote {f} ({_human_bytes(f.stat().st_size)})", markup=False)
    return 0


def _parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = text.strip().upper()
    num = s.rstrip("KMGIB")
    unit = s[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError) as exc:
        raise InputError(f"--max-shard-size {text!r} is not a size: use e.g. 5GB, 500MB or 1000000") from exc
    if value <= 0:
        raise InputError(f"--max-shard-size {text!r} must be positive")
    return int(value)
