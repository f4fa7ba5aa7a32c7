"""Free TCP ports for the servers a test starts (each xdist worker from a range of its own)."""

from __future__ import annotations

import os
import random
import socket

# Below Linux's ephemeral range (32768-60999 by default), where no outgoing connection can
# take a port between the test choosing it and a server binding it.
PORT_RANGE = (20000, 32000)


def _worker_port_range() -> tuple[int, int]:
    """This pytest-xdist worker's share of PORT_RANGE (all of it without workers): a port
    one worker chose and has not bound yet is never another worker's choice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count <= 1:
        return PORT_RANGE
    size = (PORT_RANGE[1] - PORT_RANGE[0]) // count
    start = PORT_RANGE[0] + int(worker[2:]) % count * size
    return start, start + size


def is_port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports after it (plan() counts upwards)."""
    for _ in range(200):
        low, high = _worker_port_range()
        base = random.randrange(low, high - count)
        if all(is_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports found")


def free_port() -> int:
    """A TCP port that was free a moment ago (outside the ephemeral range)."""
    return free_ports(1)
