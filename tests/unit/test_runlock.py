"""The run directory's lock: taken once, refused to a second holder with its pid and host, free again
when its descriptor closes (as when its process dies)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dtlaunch.errors import InputError
from dtlaunch.launch.runlock import lock_run_dir


def test_one_holder_at_a_time(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "a"
    fd = lock_run_dir(run_dir)  # creates the directory
    with pytest.raises(InputError, match=f"in use by another `dtlaunch train` \\(pid {os.getpid()} on host "):
        lock_run_dir(run_dir)
    os.close(fd)
    again = lock_run_dir(run_dir)  # a stale file does not block: only a held lock does
    assert socket.gethostname() in (run_dir / "launcher.lock").read_text()
    os.close(again)


def test_a_file_where_the_directory_belongs_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(InputError, match="cannot create run directory"):
        lock_run_dir(tmp_path / "f" / "run")


def test_a_failed_preparation_frees_the_run_directory(tmp_path: Path) -> None:
    """In-process callers (a sweep, a notebook) go on after a bad input: the lock must not stay behind."""
    from dtlaunch.commands.train import prepare_launch

    run_dir, shards = tmp_path / "run", tmp_path / "shards"
    shards.mkdir()  # exists (composing accepts it), holds no shards (found in the run directory's checks)
    args = ["recipe=tiny_ddp", "data=tokens", f"data.path={shards}", f"run.dir={run_dir}"]
    for _ in range(2):  # the second time the same error, not "in use"
        with pytest.raises(InputError, match="data.path: no meta.json in"):
            prepare_launch(args, [], force=False, no_resume=False)
    assert not run_dir.exists()  # created by the failed preparation, so removed again


def test_a_failed_preparation_keeps_what_existed(tmp_path: Path) -> None:
    """Nothing new stays behind (a new run.root included), and a directory that existed keeps its files."""
    from dtlaunch.commands.train import prepare_launch

    shards = tmp_path / "shards"
    shards.mkdir()
    bad_data = ["recipe=tiny_ddp", "data=tokens", f"data.path={shards}"]
    with pytest.raises(InputError, match="data.path: no meta.json in"):
        prepare_launch([*bad_data, f"run.root={tmp_path / 'new' / 'runs'}"], [], force=False, no_resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's")
    with pytest.raises(InputError, match="data.path: no meta.json in"):
        prepare_launch([*bad_data, f"run.dir={existing}"], [], force=False, no_resume=False)
    assert (existing / "notes.txt").read_text() == "the user's"


def test_an_unnamed_run_locks_the_directory_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default name holds the time: a preparation spanning a second boundary still makes one directory,
    and the lock held is that directory's. The clock here ticks a second per reading, every time."""
    import fcntl
    import time

    from dtlaunch.commands.train import prepare_launch

    real_strftime, ticks = time.strftime, iter(range(1, 1000))
    monkeypatch.setattr(time, "strftime", lambda fmt, *_: real_strftime(fmt, time.gmtime(1e9 + next(ticks))))
    prepared = prepare_launch(["recipe=tiny_ddp", f"run.root={tmp_path}"], [], force=False, no_resume=False)
    try:
        assert [p.name for p in tmp_path.iterdir()] == [Path(prepared.run_dir).name]
        assert (Path(prepared.run_dir) / "config.yaml").is_file()
        fd = os.open(Path(prepared.run_dir) / "launcher.lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held by the preparation's descriptor
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        os.close(prepared.lock_fd)
