"""Two "hosts" on one machine: two network namespaces joined by a bridge, each running `dtlaunch train`
with launch.nnodes=2 against a c10d rendezvous on the first. The losses must match one node's 2-process run.

Only private addresses, inside namespaces this test creates; the host's own interfaces are untouched
(the bridge carries no address). Everything is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.system

STEPS = 5
COMMON = ["recipe=tiny_ddp", "checkpoint=none", f"training.steps={STEPS}", "training.loss_plot=false"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} -> {res.returncode}: {res.stderr.strip()}")
    return res


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if _ip("netns", "list", check=False).returncode != 0:
        return "`ip netns` is not available on this kernel"
    return ""


@pytest.fixture
def two_hosts() -> Iterator[tuple[list[str], list[str]]]:
    """Two namespaces with one interface each, `eth0` at 10.213.N.1 and .2, joined by a bridge.
    Yields (namespace names, their addresses)."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 10000
    subnet = f"10.213.{tag % 250}"
    bridge = f"dtlbr{tag}"
    names = [f"dtlns{tag}a", f"dtlns{tag}b"]
    made_links: list[str] = []
    made_ns: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        _ip("link", "set", bridge, "up")
        for i, ns in enumerate(names):
            _ip("netns", "add", ns)
            made_ns.append(ns)
            host_end, ns_end = f"dtlv{tag}{'ab'[i]}", f"dtlv{tag}{'ab'[i]}p"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            made_links.append(host_end)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("link", "set", ns_end, "netns", ns)
            _ip("-n", ns, "link", "set", ns_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names, [f"{subnet}.1", f"{subnet}.2"]
    finally:
        for ns in made_ns:
            _ip("netns", "del", ns, check=False)
        for link in made_links:  # deleting a namespace removes its veth end; the host end may linger
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)


def _losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["loss"]) for r in recs}


def _train(args: list[str], cwd: Path, env: dict, netns: str = "") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dtlaunch", "train", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    # A session of its own, so that cleanup can end the launcher and its workers by process group.
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def test_two_namespaces_match_one_node(two_hosts, tmp_path: Path) -> None:
    names, addrs = two_hosts
    head = addrs[0]
    port = 29000 + os.getpid() % 1000
    # Inside a namespace the machine's hostname resolves to 127.0.0.1: name the interface gloo uses and
    # the address torchrun advertises (PET_LOCAL_ADDR = torchrun --local-addr), as on a real multi-homed host.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    shared = tmp_path / "multinode"
    nodes = [
        _train(
            [
                *COMMON,
                "launch.nnodes=2",
                "launch.nproc_per_node=1",
                f"launch.rdzv_endpoint={head}:{port}",
                "launch.rdzv_id=netns-test",
                f"run.dir={shared}",
            ],
            tmp_path,
            {**env, "NODE_RANK": str(rank), "PET_LOCAL_ADDR": addr},
            ns,
        )
        for rank, (ns, addr) in enumerate(zip(names, addrs, strict=True))
    ]
    # The reference runs at the same time: one node, two workers, the same global batch.
    ref_dir = tmp_path / "single"
    ref_env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    ref = _train([*COMMON, "launch.nproc_per_node=2", f"run.dir={ref_dir}"], tmp_path, ref_env)
    outputs = []
    try:
        for p in [*nodes, ref]:
            out, _ = p.communicate(timeout=240)
            outputs.append(out)
    finally:
        for p in [*nodes, ref]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, out in zip([*nodes, ref], outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    multi, single = _losses(shared), _losses(ref_dir)
    assert sorted(multi) == list(range(1, STEPS + 1))
    assert multi == pytest.approx(single, rel=1e-6, abs=1e-7)
    # Both namespaces really took part: world 2 made of one worker per "host".
    summary = json.loads((shared / "summary.json").read_text())
    assert summary["world"] == 2
