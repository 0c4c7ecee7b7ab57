"""lm-eval's task names from a cache file per install (dtlaunch.infer.task_names): indexed once, read after,
indexed again when the file is torn or belongs to another install; an include directory's names always
read fresh. lm-eval's TaskManager is replaced by a counting stand-in (the real index takes ~8 s); the real
one is what tests/unit/test_every_input_checked.py's `training.eval_tasks` row meets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")


class _Manager:
    built = 0

    def __init__(self, include_path=None, include_defaults=True):
        type(self).built += include_defaults
        self.all_tasks = (
            ["arc_easy", "hellaswag"] if include_defaults else sorted(p.stem for p in Path(include_path).glob("*.yaml"))
        )


@pytest.fixture
def names(monkeypatch, tmp_path):
    import lm_eval.tasks

    from dtlaunch.infer import task_names

    monkeypatch.setenv(task_names.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", _Manager)
    _Manager.built = 0
    return task_names


def test_indexed_once_then_read_from_the_file(names):
    assert names.default_task_names() == ["arc_easy", "hellaswag"]
    assert names.default_task_names() == ["arc_easy", "hellaswag"]
    assert _Manager.built == 1
    (cached,) = Path(names._cache_file(names.require_lm_eval_installed())).parent.glob("task-names-*.json")
    assert json.loads(cached.read_text()) == {"names": ["arc_easy", "hellaswag"]}


@pytest.mark.parametrize("torn", ["", "{", '{"names": 3}', '{"other": []}'])
def test_a_torn_file_is_indexed_again(names, torn):
    path = names._cache_file(names.require_lm_eval_installed())
    path.parent.mkdir(parents=True)
    path.write_text(torn)
    assert names.default_task_names() == ["arc_easy", "hellaswag"] and _Manager.built == 1
    assert json.loads(path.read_text())["names"] == ["arc_easy", "hellaswag"]


def test_another_install_has_another_file(names, monkeypatch):
    first = names._cache_file(names.require_lm_eval_installed())
    monkeypatch.setattr(names.importlib.metadata, "version", lambda _: "9.9.9")
    assert names._cache_file(names.require_lm_eval_installed()) != first


def test_include_names_are_read_fresh_and_a_typo_names_its_neighbours(names, tmp_path):
    include = tmp_path / "tasks"
    include.mkdir()
    (include / "my_task.yaml").write_text("task: my_task\n")
    assert names.known_task_names(str(include)) == {"arc_easy", "hellaswag", "my_task"}
    (include / "my_other.yaml").write_text("task: my_other\n")
    assert "my_other" in names.known_task_names(str(include), with_defaults=False)
    err = names.unknown_task_error(["arc_easy", "my_tsk"], names.known_task_names(str(include)), "training.eval_tasks")
    assert str(err) == "training.eval_tasks: unknown task 'my_tsk': did you mean my_task?"
    assert names.unknown_task_error(["arc_easy", "my_task"], {"arc_easy", "my_task"}, "k") is None


def test_without_lm_eval_one_line(names, monkeypatch):
    from dtlaunch.errors import ConfigError

    monkeypatch.setattr(names.importlib.util, "find_spec", lambda _: None)
    with pytest.raises(ConfigError, match=r"^evaluation needs lm-evaluation-harness: pip install 'dtlaunch\[eval\]'$"):
        names.default_task_names()
