"""`ckpt ls | inspect | export`: what a run's checkpoints are, what one holds, and converting one."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

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
    from dtlaunch.run.checkpoints import checkpoint_root
    from dtlaunch.run.run_dir import RunDir

    config = RunDir(run).config
    if config.is_file():
        from dtlaunch.job.compose import load_resolved

        return checkpoint_root(load_resolved(config), run)
    return run / "checkpoints" if (run / "checkpoints").is_dir() else run


def ls_command(run: str) -> int:
    from rich.table import Table

    from dtlaunch.run.checkpoints import dir_size, scan_checkpoints

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


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """DCP read on one process warns that no process group exists (the intent here): keep the output clean."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def resolve_verified(path: str) -> Any:
    """The checkpoint a command uses, contents verified; one line says which step and, when newer ones
    were skipped (interrupted, corrupt), which and why."""
    from dtlaunch.run.checkpoints import resolve_load_path

    info, skipped = resolve_load_path(Path(path), verify=True)
    note = f"using {info.name} (step {info.step}, contents verified)" if info.verified else f"using {info.name}"
    if skipped:
        note += "; newer " + "; ".join(f"{s.name} skipped: {s.reason}" for s in skipped)
    console().print(note, markup=False, soft_wrap=True)
    return info


def _module_of(key: str) -> str:
    """'model.layers.3.attention.wq.weight' -> 'layers'; 'model.tok_embeddings.weight' -> 'tok_embeddings'."""
    parts = key.split(".")[1:]
    return parts[0] if parts else key


def inspect_command(checkpoint: str, tensors: bool = False) -> int:
    import math

    import torch.distributed.checkpoint as dcp
    from rich.table import Table
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlaunch.run.checkpoints import STATE_FILE, layout_str

    info = resolve_verified(checkpoint)
    with _quiet_torch():
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
    rows = []
    for key, md in sorted(meta.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = math.prod(md.size)
            dtype = str(md.properties.dtype).replace("torch.", "")
            rows.append((key, md, numel, numel * md.properties.dtype.itemsize, dtype))
    model_rows = [r for r in rows if r[0].startswith("model.")]
    opt_rows = [r for r in rows if r[0].startswith("optim.")]
    if tensors:
        t = Table(show_header=True)
        for col in ("tensor", "shape", "dtype", "chunks"):
            t.add_column(col)
        for key, md, _, _, dtype in model_rows:
            t.add_row(key, "x".join(str(s) for s in md.size) or "()", dtype, str(len(md.chunks)))
        out.print(t)
    else:
        modules: dict[str, list] = {}
        for key, _, numel, nbytes, dtype in model_rows:
            m = modules.setdefault(_module_of(key), [0, 0, 0, set()])
            m[0], m[1], m[2] = m[0] + 1, m[1] + numel, m[2] + nbytes
            m[3].add(dtype)
        t = Table(show_header=True)
        for col in ("module", "tensors", "parameters", "bytes", "dtype"):
            t.add_column(col, justify="right" if col in ("tensors", "parameters", "bytes") else "left")
        for name, (n, numel, nbytes, dtypes) in modules.items():
            t.add_row(name, str(n), f"{numel:,}", _human_bytes(nbytes), ", ".join(sorted(dtypes)))
        total = sum(r[2] for r in model_rows)
        t.add_row("total", str(len(model_rows)), f"{total:,}", _human_bytes(sum(r[3] for r in model_rows)), "")
        out.print(t)
        out.print("  (--tensors lists every tensor)", markup=False)
    opt_bytes = _human_bytes(sum(r[3] for r in opt_rows))
    out.print(f"  + {len(opt_rows)} optimizer state tensors ({opt_bytes}); trainer state in {STATE_FILE}", markup=False)
    return 0


def export_command(src: str, fmt: str, out_dir: str, max_shard_size: str) -> int:
    from dtlaunch.convert.export import export_checkpoint

    limit = _parse_size(max_shard_size)
    if not out_dir.strip():
        raise InputError("--out is empty: give the directory to export into")
    info = resolve_verified(src)
    # Before loading any weights: a path that cannot be a directory fails here (exit 2 through cli.run).
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    started = time.time()
    with _quiet_torch():
        files = export_checkpoint(info.path, fmt, Path(out_dir), limit)
    # Exported weights are for sharing: every file this export wrote (weights, config, index) is readable by
    # others whatever the umask (safetensors and torch.save create files as the umask says, e.g. 0600).
    for f in Path(out_dir).iterdir():
        if f.is_file() and (f in files or f.stat().st_mtime >= started - 1):
            f.chmod(f.stat().st_mode | 0o644)
    out = console()
    for f in files:
        out.print(f"wrote {f} ({_human_bytes(f.stat().st_size)})", markup=False)
    return 0


def verify_command(run: str) -> int:
    """Every checkpoint's files against the checksums recorded when they were written."""
    from rich.table import Table

    from dtlaunch.run.checkpoints import TMP_PREFIX, scan_checkpoints, verify_info

    path = Path(run)
    if not path.is_dir():
        raise InputError(f"run directory '{run}' does not exist: give a run directory (runs/<name>)")
    root = path.parent if path.name.startswith(("step-", TMP_PREFIX)) else _checkpoints_dir(path)
    infos = [i for i in scan_checkpoints(root) if root != path.parent or i.path == path]
    out = console()
    if not infos:
        out.print(f"no checkpoints in {root}", markup=False)
        return 0
    t = Table(title=str(root), title_justify="left")
    for col in ("name", "step", "files", "status"):
        t.add_column(col, no_wrap=col != "status")
    corrupt = []
    for i in infos:
        verify_info(i)
        n_files = len(i.marker.get("files", {})) or sum(1 for f in i.path.iterdir() if f.is_file())
        if i.complete:
            status = "ok" if i.verified else "ok (sizes only: written before checksums)"
        elif i.path.name.startswith(TMP_PREFIX):
            status = f"incomplete: {i.reason}"
        else:
            status = f"CORRUPT: {i.reason}"
            corrupt.append(i)
        t.add_row(i.name, str(i.step), str(n_files), status)
    out.print(t)
    if corrupt:
        intact = [i for i in infos if i.complete]
        newest = f"; the newest intact one is {intact[-1].name}" if intact else "; none is intact"
        names = ", ".join(f"{i.name} ({i.reason})" for i in corrupt)
        raise InputError(f"{len(corrupt)} corrupt checkpoint(s) in {root}: {names}{newest}")
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
