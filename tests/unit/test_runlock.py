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
    assert (run_dir / "launcher.lock").is_file()  # the failure came after the lock was taken
