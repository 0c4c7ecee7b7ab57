"""`dtlaunch ...` for tests, as `subprocess.run([python, "-m", "dtlaunch", ...])` but started in ~10 ms: a fork
of a server process that imported torch, torch's agent, the worker's modules and Hydra once per pytest
process, instead of a fresh Python importing them for every command (2-4 s each, hundreds of commands).

The server is a fresh interpreter that only imports (it never runs a kernel: a fork of a process that has an
OpenMP pool deadlocks in its first parallel kernel), started on the first call. For each command it forks a
child that takes the caller's standard streams, working directory, environment and arguments, runs the
CLI's entry point (`dtlaunch.cli.console_main`, what `python -m dtlaunch` runs) and exits with its status. The
child is then what a launched `dtlaunch` is: `dtlaunch train` forks its workers from it
(dtlaunch.launch.forked_workers). Where the server cannot start (no fork, no Unix sockets),
`run` is `subprocess.run`.

    run_dtlaunch(["train", ...], env=..., timeout=600) -> subprocess.CompletedProcess (text)
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# What every `dtlaunch` command that trains, exports, generates or plans with --trace imports. Nothing here
# may read the environment at import in a way a command depends on (huggingface_hub does: not preloaded).
PRELOAD = ("torch", "torch.distributed.run", "torch._dynamo", "dtlaunch.train.main", "hydra", "omegaconf")
_HEADER = 8  # bytes of a message's length


def _send(sock: socket.socket, payload: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(payload).encode()
    socket.send_fds(sock, [len(data).to_bytes(_HEADER, "big")], list(fds))
    sock.sendall(data)


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _HEADER, max_fds)
    if len(head) < _HEADER:
        raise ConnectionError("the dtlaunch test server closed the connection")
    size, data = int.from_bytes(head, "big"), b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the dtlaunch test server closed the connection")
        data += chunk
    return json.loads(data), fds


# --- the server ----------------------------------------------------------------------------------------------


def _child(request: dict, fds: list[int], listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: become `python -m dtlaunch ARGS` with the caller's streams, cwd and environment."""
    code = 1
    try:
        listener.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # `python -m`'s path: the working directory, then $PYTHONPATH, then the interpreter's own entries.
        user = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *user, *_BASE_PATH]
        sys.argv = [sys.executable, *request["args"]]
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        for name, fd in (("stdout", 1), ("stderr", 2)):
            raw = io.FileIO(fd, "w", closefd=False)
            stream = io.TextIOWrapper(
                raw if unbuffered else io.BufferedWriter(raw),
                encoding="utf-8",
                errors="backslashreplace" if name == "stderr" else "strict",
                write_through=unbuffered,
                line_buffering=name == "stderr",
            )
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # read by OpenMP when the server loaded torch, not now
            import torch

            torch.set_num_threads(int(threads))
        from dtlaunch.cli import console_main

        console_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code & 0xFF)


# The server's sys.path without its script's directory and its own $PYTHONPATH: what every Python has.
_BASE_PATH: list[str] = []


def serve(path: str) -> None:
    """Import, then fork a child per request and report its pid, then its exit status."""
    import importlib

    own = {str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path[1:] if str(Path(p).resolve()) not in own]

    from dtlaunch.run.parent_death import die_with_parent

    die_with_parent(os.getppid())  # the pytest process that started it
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            request, fds = _recv(conn, max_fds=3)
        except (ConnectionError, OSError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            _child(request, fds, listener, conn)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            _send(conn, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
        conn.close()


# --- the client ----------------------------------------------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.path = ""
        self.failed = False

    def address(self) -> Optional[str]:
        """The server's socket, started on first use; None where it cannot run."""
        if self.failed:
            return None
        if self.proc is not None and self.proc.poll() is None:
            return self.path
        if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
            self.failed = True
            return None
        self.path = tempfile.mktemp(prefix="dtlaunch-cli-", suffix=".sock")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), self.path],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ),
            text=True,
        )
        atexit.register(self.stop)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.stop()
            self.failed = True
            return None
        return self.path

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_SERVER = _Server()


def run_dtlaunch(
    args: list[str], env: Optional[dict[str, str]] = None, cwd: Any = None, timeout: Optional[float] = 600
) -> subprocess.CompletedProcess:
    """`dtlaunch ARGS` with `env` (default: this process's), captured as text; raises TimeoutExpired."""
    env = dict(os.environ if env is None else env)
    cwd = str(Path(cwd) if cwd is not None else Path.cwd())
    command = [sys.executable, "-m", "dtlaunch", *args]
    address = _SERVER.address()
    if address is None:
        return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with (
        open(os.devnull, "rb") as stdin,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
    ):
        sock.connect(address)
        _send(sock, {"args": list(args), "env": env, "cwd": cwd}, (stdin.fileno(), out.fileno(), err.fileno()))
        pid = _recv(sock)[0]["pid"]
        sock.settimeout(timeout)
        began = time.monotonic()
        try:
            returncode = _recv(sock)[0]["returncode"]
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)  # its workers die with it (dtlaunch.run.parent_death)
            raise subprocess.TimeoutExpired(command, time.monotonic() - began) from None
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


if __name__ == "__main__":
    serve(sys.argv[1])
