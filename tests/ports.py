"""A TCP port for a test's server to listen on (a rendezvous, slurmctld), chosen below Linux's ephemeral
range (32768-60999). A port from bind(("", 0)) lies inside that range, so between the test choosing it and
the server binding it the kernel may hand it to an outgoing connection as its source port -- another
node's agent retrying its connect to that very address, say -- and the server cannot bind it. Below the
range only an explicit bind takes a port."""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32767


def listen_port() -> int:
    for port in random.sample(range(LOW, HIGH), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {LOW}-{HIGH}")
