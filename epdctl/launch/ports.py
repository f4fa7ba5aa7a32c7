"""Ports: the free ones a plan takes (from a base, skipping taken ones), and the check before
launch that every port in the plan can be bound right now."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable, Sequence

from epdctl.errors import PlanError
from epdctl.launch.spec import HOST, Plan


def _bind_error(port: int, host: str) -> OSError | None:
    """Bind (no listen) as the server would; the error, or None when the port is free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return exc
    with socket.socket(family, kind, proto) as sock:
        if os.name == "posix":
            # uvicorn and vLLM set SO_REUSEADDR: a port whose last connections linger in
            # TIME_WAIT (just after `down`) is free for them, and must be free for us.
            # A listening socket still makes bind fail with EADDRINUSE.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc
    return None


def taken_ports(ports: Iterable[int], host: str = HOST) -> list[int]:
    """The ports another socket already holds on host, in the order given."""
    taken = []
    for port in ports:
        error = _bind_error(port, host)
        if error is not None and error.errno == errno.EADDRINUSE:
            taken.append(port)
    return taken


def _problem(port: int, what: str, host: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} for {what} is already in use"
    if error.errno == errno.EACCES and port < 1024:
        return f"port {port} for {what} needs root (ports below 1024 are privileged)"
    reason = error.strerror or str(error)
    return f"port {port} for {what} cannot be bound on {host}: {reason}"


def check_plan_ports(plan: Plan) -> None:
    """Raise PlanError naming each planned port that cannot be bound now."""
    wanted: list[tuple[int, str, str]] = []
    for spec in plan.instances:
        wanted.append((spec.port, f"`{spec.name}`", HOST))
        if spec.side_channel_port is not None:
            wanted.append((spec.side_channel_port, f"`{spec.name}` (NIXL side channel)", HOST))
        wanted += [(port, f"`{spec.name}` (EC connector)", HOST) for port in spec.ec_ports]
    wanted.append((plan.proxy.port, f"`{plan.proxy.name}`", plan.proxy.host))
    problems = []
    for port, what, host in wanted:
        error = _bind_error(port, host)
        if error is not None:
            problems.append(_problem(port, what, host, error))
    if problems:
        raise PlanError("\n".join(problems))


def free_ports(start: int, count: int, taken: set[int], what: str) -> list[int]:
    """count ports from start, skipping taken ones."""
    ports: list[int] = []
    port = start
    while len(ports) < count:
        if port > 65535:
            raise PlanError(f"{what}: {count} port(s) from {start} do not fit below 65536")
        if port not in taken:
            ports.append(port)
        port += 1
    return ports


def port_blocks(start: int, sizes: Sequence[int], taken: set[int], what: str
                 ) -> list[tuple[int, ...]]:
    """Per size, that many consecutive ports from start on (none for 0), skipping taken ones."""
    blocks: list[tuple[int, ...]] = []
    port = start
    for size in sizes:
        while size and any(p in taken for p in range(port, port + size)):
            port += 1
        if port + size - 1 > 65535:
            raise PlanError(f"{what}: {sum(sizes)} port(s) from {start} do not fit below 65536")
        blocks.append(tuple(range(port, port + size)))
        port += size
    return blocks
