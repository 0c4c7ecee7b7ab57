"""Can lm-eval's tasks read their datasets here? Checked before the model loads.

lm-eval's built-in tasks read hub datasets through `datasets.load_dataset`, which offline reads only its
own cache (HF_DATASETS_CACHE, filled by an earlier online run); the hub cache that `dtlaunch download`
fills is no substitute. Without this check an offline evaluation loads the model and then dies on a
ConnectionError deep inside lm-eval.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator, Optional

from dtlaunch.errors import InputError

# A task's dataset: (task name, dataset_path, dataset_name or None).
TaskDataset = tuple[str, str, Optional[str]]


def hub_datasets(manager: Any, names: list[str]) -> Iterator[TaskDataset]:
    """The hub datasets the named tasks (and, for groups and tags, their subtasks) read."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen or name not in manager.task_index:
            continue
        seen.add(name)
        entry = manager.task_index[name]
        cfg = entry.cfg or {}
        kind = entry.kind.name
        if kind == "GROUP":
            todo += [t if isinstance(t, str) else str(t.get("task", "")) for t in cfg.get("task", [])]
        elif kind == "TAG":
            todo += [n for n, e in manager.task_index.items() if name in (e.tags or ())]
        path = cfg.get("dataset_path")
        if kind in ("TASK", "PY_TASK") and isinstance(path, str) and _is_hub_name(path, _PACKAGED_DATASETS_MODULES):
            yield name, path, cfg.get("dataset_name")


def _is_hub_name(path: str, packaged: Any) -> bool:
    return path not in packaged and not os.path.exists(os.path.expanduser(path)) and path.count("/") <= 1


def in_datasets_cache(path: str) -> bool:
    """`datasets` prepared this dataset before (where its offline fallback looks: CachedDatasetModuleFactory)."""
    from datasets import config

    root = os.path.join(os.path.expanduser(str(config.HF_DATASETS_CACHE)), path.replace("/", "___"))
    return any(os.path.isdir(p) for p in glob.glob(os.path.join(glob.escape(root), "*", "*", "*")))


def check_datasets_reachable(manager: Any, names: list[str], key: str, include_key: str) -> None:
    """Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), every hub dataset the tasks read must be in the datasets
    cache: refused otherwise, naming the task, the dataset and the fix. Online the hub is asked as usual."""
    from datasets import config

    if not config.HF_HUB_OFFLINE:
        return
    for task, path, subset in hub_datasets(manager, names):
        if not in_datasets_cache(path):
            raise InputError(missing_dataset_message(task, path, subset, key, include_key, "HF_HUB_OFFLINE=1"))


def missing_dataset_message(task: str, path: str, subset: Optional[str], key: str, include_key: str, why: str) -> str:
    from datasets import config

    what = f"{path} ({subset})" if subset else path
    return (
        f"{key}: task '{task}' reads the hub dataset {what}, which is not in the datasets cache "
        f"({config.HF_DATASETS_CACHE}) and {why}: evaluate once where the hub is reachable (datasets caches it), "
        f"or give {include_key} a directory of task YAML files over local data"
    )


def unreachable_dataset_error(exc: ConnectionError, manager: Any, names: list[str]) -> InputError:
    """lm-eval failed to reach the hub for a dataset (online mode, no network): the same one line. Either
    command may be evaluating (`eval`, or training.eval_tasks), so both keys are named."""
    said, key, include_key = str(exc), "--tasks (training.eval_tasks)", "--include (training.eval_include)"
    for task, path, subset in hub_datasets(manager, names):
        if f"'{path}'" in said:
            return InputError(missing_dataset_message(task, path, subset, key, include_key, "the hub is unreachable"))
    return InputError(f"{key}: a task's dataset could not be fetched ({said}): check the network, or use {include_key}")
