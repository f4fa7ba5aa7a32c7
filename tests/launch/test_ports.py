"""Port checks: a socket the test binds itself is reported, by port and instance name."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdctl.errors import PlanError
from epdctl.launch.plan import Plan, plan
from epdctl.launch.ports import check_plan_ports, taken_ports
from epdctl.topology.model import parse_topology


@pytest.fixture
def held() -> Iterator[int]:
    """A port this test holds, listening on 127.0.0.1, as a running server would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _free_block(count: int) -> int:
    """A first port of count consecutive free ports (best effort, for the plan's ranges)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            start = sock.getsockname()[1]
        if start + count < 65535 and not taken_ports(range(start, start + count)):
            return start
    raise RuntimeError("no free port block")


def test_taken_ports(held: int) -> None:
    free = _free_block(1)
    assert taken_ports([held, free]) == [held]
    assert taken_ports([held], host="0.0.0.0") == [held]  # a wildcard bind collides too


def test_a_closed_port_is_free_again() -> None:
    # A port whose connection sits in TIME_WAIT is free for a SO_REUSEADDR server (uvicorn,
    # vLLM): the check must not call it taken.
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = server.accept()
            conn.close()  # the server side closes first: its end goes to TIME_WAIT
    assert taken_ports([port]) == []


def _plan(proxy_port: int, base: int, side: int) -> Plan:
    topology = parse_topology({
        "name": "demo", "model": "m", "device": "cpu",
        "proxy": {"port": proxy_port}, "ports": {"base": base, "side_channel_base": side},
        "roles": {"encode": {}, "prefill": {}, "decode": {}},
    })
    return plan(topology, Path("/state"), cpu_count=4)


def _with_port(result: Plan, name: str, **change: int) -> Plan:
    """The plan with one spec's port (or side-channel port) replaced."""
    if name == "proxy":
        return dataclasses.replace(result, proxy=dataclasses.replace(result.proxy, **change))
    specs = tuple(dataclasses.replace(s, **change) if s.name == name else s
                  for s in result.instances)
    return dataclasses.replace(result, instances=specs)


def test_check_plan_ports_names_instance_and_port(held: int) -> None:
    start = _free_block(8)
    result = _plan(start, start + 1, start + 4)
    check_plan_ports(result)  # all free: no error
    with pytest.raises(PlanError) as info:
        check_plan_ports(_with_port(result, "proxy", port=held))
    assert str(info.value) == f"port {held} for `proxy` is already in use"
    with pytest.raises(PlanError) as info:
        check_plan_ports(_with_port(result, "encode-0", port=held))
    assert str(info.value) == f"port {held} for `encode-0` is already in use"
    with pytest.raises(PlanError) as info:
        check_plan_ports(_with_port(result, "prefill-0", side_channel_port=held))
    assert str(info.value) == f"port {held} for `prefill-0` (NIXL side channel) is already in use"


def test_every_problem_is_listed(held: int) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        second = other.getsockname()[1]
        start = _free_block(8)
        result = _plan(start, start + 1, start + 4)
        result = _with_port(_with_port(result, "proxy", port=held), "encode-0", port=second)
        with pytest.raises(PlanError) as info:
            check_plan_ports(result)
    assert str(info.value) == (
        f"port {second} for `encode-0` is already in use\n"
        f"port {held} for `proxy` is already in use"
    )


def test_unbindable_host() -> None:
    topology = parse_topology({"name": "demo", "model": "m", "device": "cpu",
                               "proxy": {"host": "192.0.2.1", "port": _free_block(1)},
                               "ports": {"base": _free_block(2)},
                               "roles": {"prefill_decode": {}}})
    with pytest.raises(PlanError, match=r"cannot be bound on 192\.0\.2\.1: "):
        check_plan_ports(plan(topology, Path("/state")))
