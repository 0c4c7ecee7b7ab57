"""A local Hugging Face Hub for tests: the endpoints huggingface_hub really calls, on 127.0.0.1 only.

- HEAD/GET /{repo}/resolve/{rev}/{file} and /datasets/{repo}/resolve/{rev}/{file}: X-Repo-Commit,
  ETag, Content-Length (what hf_hub_download / get_hf_file_metadata read).
- GET /api/{models,datasets}/{repo}/revision/{rev}: id, sha, siblings (repo_info, snapshot_download).
- GET /api/{models,datasets}/{repo}/tree/{rev}: the file listing snapshot_download pages through.
- Failures as the hub reports them: X-Error-Code RepoNotFound (with an X-Error-Message naming close
  matches), RevisionNotFound, EntryNotFound, GatedRepo (401 without a token), 401/403 for a private
  repository without / with a wrong token.

Every request is counted per (method, path), so tests assert what was fetched. The server stops when
the fixture ends, or by itself after `lifetime` seconds.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

GOOD_TOKEN = "hf_test_good_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str
    gated: bool = False  # GatedRepo without a token (as the hub answers before terms are accepted)
    private: bool = False  # 401 without a token, 403 with a wrong one
    branches: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def from_dir(path: Path, **kw) -> Repo:
        files = {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(b"".join(k.encode() + v for k, v in files.items())).hexdigest()
        return Repo(files=files, sha=sha, branches={"main": sha}, **kw)


class Hub:
    def __init__(self, lifetime: float = 600.0) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}  # (models|datasets, ORG/NAME) -> repo
        self.requests: Counter = Counter()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True

    def __enter__(self) -> Hub:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, suffix: str) -> int:
        """GET requests whose path ends with `suffix` (file contents actually sent)."""
        return sum(n for (m, p), n in self.requests.items() if m == "GET" and p.endswith(suffix))

    def content_gets(self) -> int:
        return sum(n for (m, p), n in self.requests.items() if m == "GET" and "/resolve/" in p)

    # -- request handling ---------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests[(h.command, path)] += 1
        parts = path.strip("/").split("/")
        try:
            if parts[0] == "api" and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                kind, repo_id, what, rev = parts[1], "/".join(parts[2:4]), parts[4], parts[5]
                repo, sha = self._repo(h, kind, repo_id, rev)
                if what == "revision":
                    info = {"id": repo_id, "sha": sha, "private": repo.private, "gated": repo.gated}
                    info["siblings"] = [{"rfilename": f} for f in repo.files]
                    return self._json(h, info, body)
                tree = [
                    {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in repo.files.items()
                ]
                return self._json(h, tree, body)
            kind = "datasets" if parts[0] == "datasets" else "models"
            parts = parts[1:] if kind == "datasets" else parts
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, sha = self._repo(h, kind, "/".join(parts[:2]), parts[3])
                name = "/".join(parts[4:])
                if name not in repo.files:
                    raise _Fail(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, "Entry not found")
                data = repo.files[name]
                h.send_response(200)
                h.send_header("X-Repo-Commit", sha)
                h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                h.send_header("Content-Length", str(len(data)))
                h.end_headers()
                if body:
                    h.wfile.write(data)
                return
            raise _Fail(404, {}, "Not found")
        except _Fail as fail:
            h.send_response(fail.status)
            for k, v in fail.headers.items():
                h.send_header(k, v)
            h.send_header("X-Error-Message", fail.message)
            h.send_header("Content-Length", "0")
            h.end_headers()

    def _repo(self, h: BaseHTTPRequestHandler, kind: str, repo_id: str, rev: str) -> tuple[Repo, str]:
        repo = self.repos.get((kind, repo_id))
        if repo is None:
            names = [r for k, r in self.repos if k == kind]
            close = difflib.get_close_matches(repo_id, names, n=2)
            said = "Repository not found" + (f". Did you mean {' or '.join(close)}?" if close else "")
            raise _Fail(404, {"X-Error-Code": "RepoNotFound"}, said)
        token = (h.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if repo.gated and token != GOOD_TOKEN:
            raise _Fail(401, {"X-Error-Code": "GatedRepo"}, "Access to this model is restricted")
        if repo.private and not token:
            raise _Fail(401, {}, "Authentication required")
        if repo.private and token != GOOD_TOKEN:
            raise _Fail(403, {}, "Your token has no access to this repository")
        sha = repo.branches.get(rev) or (rev if rev == repo.sha else None)
        if sha is None:
            raise _Fail(404, {"X-Error-Code": "RevisionNotFound"}, f"Invalid rev id: {rev}")
        return repo, sha

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def point_hub_lib_at(monkeypatch, url: str, cache: str) -> None:
    """For in-process use: HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE=0 as huggingface_hub reads them at
    import time (the endpoint, its download-URL template, the cache), for the test's duration."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("dtlaunch.hub.resolve._RESOLVED", {})


class _Fail(Exception):
    def __init__(self, status: int, headers: dict[str, str], message: str) -> None:
        super().__init__(message)
        self.status, self.headers, self.message = status, headers, message
