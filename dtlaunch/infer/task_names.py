"""The task names lm-eval knows (its tasks, groups and tags, and those of an include directory), for the
check every command that reads a job with training.eval_tasks runs (validate, plan, train --dry-run, submit,
train) and `dtlaunch eval`.

Indexing lm-eval's own ~15k task YAMLs costs ~8 s of CPU; their names change only with the lm-eval install,
so they are kept in a small JSON file per install (~/.cache/dtlaunch/lm-eval/), keyed by lm-eval's version
and its tasks folder's path and modification time. An include directory is indexed each time (milliseconds).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

from dtlaunch.errors import ConfigError

CACHE_ENV = "DTLAUNCH_LM_EVAL_CACHE"  # the folder of the names files (default ~/.cache/dtlaunch/lm-eval)


def require_lm_eval_installed() -> Path:
    """lm-eval's package folder; a one-line refusal when it is not installed (no import: checks stay fast)."""
    try:
        spec = importlib.util.find_spec("lm_eval")
    except (ImportError, ValueError):  # a finder that refuses it, a half-removed install
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("evaluation needs lm-evaluation-harness: pip install 'dtlaunch[eval]'")
    return Path(next(iter(spec.submodule_search_locations)))


def unknown_task_error(names: Sequence[str], known: set[str], key: str) -> ConfigError | None:
    """The first name lm-eval does not know, with its closest known names; None when all are known."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}?" if close else "see `lm-eval ls tasks`"
            return ConfigError(f"{key}: unknown task '{name}': {hint}")
    return None


def known_task_names(include: str = "", with_defaults: bool = True) -> set[str]:
    """lm-eval's own names (from the cache file when it matches this install) and `include`'s."""
    names = set(default_task_names()) if with_defaults else set()
    if include:
        from lm_eval.tasks import TaskManager

        names |= set(TaskManager(include_path=include, include_defaults=False).all_tasks)
    return names


def default_task_names() -> list[str]:
    package = require_lm_eval_installed()
    path = _cache_file(package)
    try:
        names = json.loads(path.read_text())["names"]
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return names
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, from another install, or torn: index again
    from lm_eval.tasks import TaskManager

    names = list(TaskManager().all_tasks)
    _write_atomically(path, json.dumps({"names": names}))
    return names


def _cache_file(package: Path) -> Path:
    """One file per lm-eval install: a new version, another venv or an edited tasks folder is another key."""
    tasks = package / "tasks"
    try:
        stamp = tasks.stat().st_mtime_ns
    except OSError:
        stamp = 0
    version = importlib.metadata.version("lm_eval")
    key = hashlib.sha256(f"{version}\0{tasks.resolve()}\0{stamp}".encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dtlaunch" / "lm-eval").expanduser()
    return root / f"task-names-{version}-{key}.json"


def _write_atomically(path: Path, text: str) -> None:
    """Best effort: a read-only home only costs the next command the index again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".names-")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        pass
