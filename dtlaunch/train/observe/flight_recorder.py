"""torch's collective flight recorder, the workers' side: every live rank dumps its record when a collective
times out (the launcher turns the recorder on: dtlaunch.run.flight_recorder).

NCCL dumps the record itself on a timeout (into files named TORCH_FR_DUMP_TEMP_FILE + rank). gloo has no
dump-on-timeout, so the rank whose collective timed out (dtlaunch.train.observe.guards) dumps its own record through torch's on-demand API and asks the others, through the
rendezvous store, to do the same: their step-watch threads poll for the request, so a rank stuck in
Python (or waiting in another collective) still writes its record.

torch 2.13's gloo record leaves its process-group table empty (one group named '' without ranks), and
the analyser (`torchfrtrace DIR`) then fails to match any collective. The table is rebuilt here from
torch.distributed's own registry of groups before the record is written.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any, Optional

from dtlaunch.run.flight_recorder import FILE_PREFIX, analyse_command, dump_dir

__all__ = ["PeerDumps", "analyse_command", "dump", "dump_dir", "last_collective", "record"]

_REQUEST = "dtlaunch/fr/request"
_DUMPED = "dtlaunch/fr/dumped/"


def _group_table() -> dict[str, dict[str, str]]:
    """name -> {name, desc, ranks} for every process group this rank knows, as NCCL records it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    table = {}
    for group, name in list(_world.pg_names.items()):
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # a group being torn down
            continue
        table[name] = {"name": name, "desc": getattr(group, "group_desc", ""), "ranks": str(sorted(ranks))}
    return table


def record() -> Optional[dict[str, Any]]:
    """This rank's flight record (None when the recorder is off or torch has no on-demand dump)."""
    if dump_dir() is None:
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        data = pickle.loads(_dump_fr_trace())
    except (ImportError, RuntimeError, pickle.UnpicklingError):
        return None
    table = data.get("pg_config") or {}
    if not table or "" in table:  # gloo: see the module docstring
        data["pg_config"] = _group_table()
    return data


def dump(rank: int) -> Optional[Path]:
    """Write this rank's record to the run's dump directory; its path, or None when there is none."""
    directory = dump_dir()
    data = record()
    if directory is None or data is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{FILE_PREFIX}{rank}"
    tmp = directory / f".{FILE_PREFIX}{rank}.tmp"  # not matched by the analyser's file pattern
    tmp.write_bytes(pickle.dumps(data))
    os.replace(tmp, path)
    return path


def last_collective(data: Optional[dict[str, Any]]) -> str:
    """The newest collective in a record, as "all_reduce #6 of group default_pg" ('' if none)."""
    entries = [e for e in (data or {}).get("entries", []) if not e.get("is_p2p")]
    if not entries:
        return ""
    e = entries[-1]
    op = str(e.get("profiling_name", "")).split(":")[-1]  # "gloo:all_reduce" -> "all_reduce"
    group = e.get("process_group") or ("?", "")
    return f"{op} #{e.get('collective_seq_id')} of group {group[1] or group[0]}"


class PeerDumps:
    """The store side: a rank that saw a timeout asks every rank to dump; each rank answers once."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self._answered = False

    def poll(self) -> None:
        """From the step-watch thread: dump when asked (cheap when not: one key check)."""
        if self._answered or self.store is None or dump_dir() is None:
            return
        if self.store.check([_REQUEST]):
            self.answer()

    def answer(self) -> None:
        self._answered = True
        if dump(self.rank) is not None:
            self.store.set(f"{_DUMPED}{self.rank}", "1")

    def collect(self, wait_s: float) -> int:
        """Ask every rank, dump this one, wait (at most `wait_s`) for the others; the ranks that dumped."""
        if self.store is None or dump_dir() is None:
            return 0
        try:
            self.store.set(_REQUEST, "1")
            if not self._answered:
                self.answer()
            keys = [f"{_DUMPED}{r}" for r in range(self.world)]
            deadline = time.monotonic() + wait_s
            while True:
                done = sum(self.store.check([k]) for k in keys)
                if done == self.world or time.monotonic() > deadline:
                    return done
                time.sleep(0.1)
        except (RuntimeError, ValueError, OSError):  # the store went away: report what was written here
            return int(self._answered)
