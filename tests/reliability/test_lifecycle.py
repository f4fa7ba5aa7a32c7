"""epdctl itself under faults: killed mid-`up` or mid-serving, ports taken, state.json damaged.

Fake engines (tests/fake_server.py) stand in for vLLM: what is tested is epdctl's bookkeeping,
so every check is "which marked process is still alive", not what an engine answers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reliability.helpers import (
    cli_env,
    epdctl,
    finish,
    marked_pids,
    spawn_epdctl,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)


def records(run_dir: Path) -> dict[str, object]:
    """state.json's records plus the supervisor's, by name (empty while there is none)."""
    try:
        doc = json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    found = dict(doc["records"])
    if doc.get("supervisor"):
        found["supervisor"] = doc["supervisor"]
    return found


def grandchild(run_dir: Path) -> int | None:
    """The pid pd-0 printed for its grandchild (--spawn-grandchild), once it has."""
    try:
        log = (run_dir / "logs" / "pd-0.log").read_text()
    except OSError:
        return None
    found = re.search(r"grandchild pid (\d+)", log)
    return int(found[1]) if found else None


def starting_topology(fake_topology: Callable[..., Path]) -> Path:
    """pd-0 needs a minute to become ready and leaves a grandchild: `up` is mid-start."""
    return fake_topology(pd_args=("--ready-after", "60", "--spawn-grandchild"))


def wait_mid_start(run_dir: Path, *names: str) -> None:
    """Both engines spawned and recorded (and pd-0's grandchild too), pd-0 not ready."""
    assert wait_for(lambda: set(records(run_dir)) >= {"encode-0", "pd-0", *names}, 60), \
        records(run_dir)
    assert wait_for(lambda: grandchild(run_dir), 30)
    doc = json.loads((run_dir / "state.json").read_text())
    assert doc["phase"] == "starting" and "proxy" not in doc["records"]


def check_down_stops_everything(env: dict[str, str], run_dir: Path) -> set[str]:
    """`down` exits 0 and no process of the run (grandchild included) survives it.

    Returns the names `down` reported as stopped (the grandchild ignores SIGTERM, so its
    instance is stopped with SIGKILL after the deadline).
    """
    alive = marked_pids(run_dir)
    assert len(alive) >= 3, alive  # encode-0, pd-0 and its grandchild: a check that can fail
    down = epdctl(env, "down", "--timeout", "3")
    assert down.returncode == 0, down.stderr
    assert marked_pids(run_dir) == set()
    assert not (run_dir / "state.json").exists()
    first = down.stderr.splitlines()[0]
    assert first.startswith("Stopped fake: ") and first.endswith("."), down.stderr
    return set(first.removeprefix("Stopped fake: ").removesuffix(".").split(", "))


@pytest.fixture
def env(state_root: Path) -> Iterator[dict[str, str]]:
    yield cli_env(state_root)


def test_foreground_up_killed_while_starting(env, fake_topology, state_root) -> None:
    """SIGKILL of a foreground `up` mid-start: a second `up` is refused, `down` stops all."""
    topo = starting_topology(fake_topology)
    run_dir = state_root / "fake"
    up = spawn_epdctl(env, "up", str(topo), "--timeout", "120")
    try:
        wait_mid_start(run_dir)
        up.send_signal(signal.SIGKILL)
        assert up.wait(timeout=10) == -signal.SIGKILL
    finally:
        up.kill()
        finish(up)
    # Its lock died with it, but the recorded instances still run: not a free slot.
    again = epdctl(env, "up", str(topo), "-d", "--timeout", "20")
    assert again.returncode == 1
    assert "`fake` is already running (encode-0, pd-0 alive)" in again.stderr
    assert check_down_stops_everything(env, run_dir) == {"encode-0", "pd-0"}


@pytest.mark.parametrize("victim", ["client", "supervisor", "both"])
def test_detached_up_killed_while_starting(env, fake_topology, state_root, victim) -> None:
    """SIGKILL of `up -d`, of its supervisor, or of both, mid-start: nothing is left behind."""
    topo = starting_topology(fake_topology)
    run_dir = state_root / "fake"
    up = spawn_epdctl(env, "up", str(topo), "-d", "--timeout", "120")
    try:
        wait_mid_start(run_dir, "supervisor")
        supervisor = int(records(run_dir)["supervisor"]["pid"])  # type: ignore[index]
        if victim in ("client", "both"):
            up.send_signal(signal.SIGKILL)
            assert up.wait(timeout=10) == -signal.SIGKILL
        if victim in ("supervisor", "both"):
            os.kill(supervisor, signal.SIGKILL)
        if victim == "supervisor":
            # The waiting client sees its supervisor die: it stops what was started.
            code, _, err = finish(up, 60)
            assert code == 3, err
            assert "`supervisor` was killed by SIGKILL" in err
            assert marked_pids(run_dir) == set()
            assert not (run_dir / "state.json").exists()
            return
    finally:
        up.kill()
        finish(up)
    stopped = check_down_stops_everything(env, run_dir)
    assert stopped >= {"encode-0", "pd-0"}
    assert ("supervisor" in stopped) == (victim == "client")


def test_foreground_up_killed_while_serving(env, fake_topology, state_root) -> None:
    topo = fake_topology(pd_args=("--spawn-grandchild",))
    run_dir = state_root / "fake"
    up = spawn_epdctl(env, "up", str(topo), "--timeout", "60")
    try:
        assert up.stdout is not None
        assert wait_for(lambda: records(run_dir).get("proxy"), 60)
        while not up.stdout.readline().startswith("  curl "):
            assert up.poll() is None, finish(up)
        assert json.loads((run_dir / "state.json").read_text())["phase"] == "running"
        up.send_signal(signal.SIGKILL)
        assert up.wait(timeout=10) == -signal.SIGKILL
    finally:
        up.kill()
        finish(up)
    assert check_down_stops_everything(env, run_dir) == {"proxy", "encode-0", "pd-0"}


@pytest.mark.parametrize("holder", ["proxy", "pd-0"])
def test_a_taken_port_is_refused_before_anything_starts(env, fake_topology, state_root,
                                                        holder) -> None:
    topo = fake_topology()
    from epdctl.launch.run import prepare

    plan = prepare(topo, state_root).plan
    port = {s.name: s.port for s in plan.specs}[holder]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        result = epdctl(env, "up", str(topo), "-d", "--timeout", "20")
    assert result.returncode == 1
    assert result.stderr == f"Error: port {port} for `{holder}` is already in use\n"
    run_dir = state_root / "fake"
    assert not (run_dir / "state.json").exists() and not (run_dir / "logs").exists()
    assert marked_pids(run_dir) == set()


def _garbage(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00garbage from a bad disk\x80")


def _unreadable(path: Path) -> None:
    # A directory where the file should be: unreadable for root too (chmod is not).
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("damage", [_garbage, _unreadable], ids=["binary", "unreadable"])
def test_damaged_state_names_the_way_out(env, fake_topology, state_root, damage) -> None:
    """status/down/up name `down --force`, which finds the processes by their env markers."""
    topo = fake_topology(pd_args=("--spawn-grandchild",))
    up = epdctl(env, "up", str(topo), "-d", "--timeout", "60")
    assert up.returncode == 0, up.stderr
    run_dir = state_root / "fake"
    assert wait_for(lambda: grandchild(run_dir), 30)
    before = marked_pids(run_dir)
    damage(run_dir / "state.json")
    way_out = "run `epdctl down --force --name fake` to stop whatever it started\n"
    for args in (("status",), ("down",)):
        result = epdctl(env, *args)
        assert result.returncode == 1, (args, result.stderr)
        assert result.stderr.startswith("Error: ") and result.stderr.endswith(way_out)
        assert str(run_dir / "state.json") in result.stderr
    again = epdctl(env, "up", str(topo), "-d")  # the live supervisor's lock refuses it
    assert again.returncode == 1 and "`fake` is already running" in again.stderr
    assert marked_pids(run_dir) == before  # refusing touched nothing
    forced = epdctl(env, "down", "--force", "--name", "fake", "--timeout", "3")
    assert forced.returncode == 0, forced.stderr
    assert marked_pids(run_dir) == set()
    assert len(before) == 5  # supervisor, encode-0, pd-0, its grandchild, proxy


def test_state_json_gone_force_still_finds_everything(env, fake_topology, state_root) -> None:
    up = epdctl(env, "up", str(fake_topology()), "-d", "--timeout", "60")
    assert up.returncode == 0, up.stderr
    run_dir = state_root / "fake"
    assert len(marked_pids(run_dir)) == 4
    (run_dir / "state.json").unlink()
    plain = epdctl(env, "down")
    assert plain.returncode == 1 and "nothing is running" in plain.stderr
    forced = epdctl(env, "down", "--force", "--name", "fake", "--timeout", "3")
    assert forced.returncode == 0, forced.stderr
    assert forced.stderr.startswith("Stopped fake: ")
    assert marked_pids(run_dir) == set()


@pytest.mark.parametrize("problem", ["too-small", "not-a-dir"])
def test_a_store_that_cannot_hold_the_budget_is_refused(env, fake_topology, state_root,
                                                        tmp_path, problem) -> None:
    """`/dev/shm` too small for cache.capacity, or the store dir under a file: refused before
    anything starts, naming the store."""
    if problem == "too-small":
        topo = fake_topology(cache=f"capacity: {1 << 60}")
        needle = "lower cache.capacity or enlarge the filesystem"
    else:
        (tmp_path / "a-file").write_text("not a directory")
        topo = fake_topology()
        text = topo.read_text().replace(str(tmp_path / "shm"), str(tmp_path / "a-file" / "shm"))
        topo.write_text(text)
        needle = "is not writable"
    result = epdctl(env, "up", str(topo), "-d", "--timeout", "20")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("Error: the EC store `") and needle in result.stderr
    run_dir = state_root / "fake"
    assert not (run_dir / "state.json").exists() and not (run_dir / "logs").exists()
    assert marked_pids(run_dir) == set()
