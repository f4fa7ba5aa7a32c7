"""Restarts that forgive (issue #45): a budget per `restart.window`, a capped backoff, and an
instance out of restarts that stays down while its role has another.

The budget is tested as a pure function of fake times. The supervisor runs in this (main)
thread, as `up` runs it, over tests/fake_server.py engines; a driver thread crashes them
(SIGKILL to the group) on observed states, moves the supervisor's restart clock past the
window instead of waiting, and stops the supervisor as a signal would.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from epdctl.errors import InstanceDiedError
from epdctl.launch import restart_one
from epdctl.launch.restarts import Budget
from epdctl.launch.run import prepare
from epdctl.launch.state import Record, RunState, StateDir
from epdctl.launch.supervisor import Supervisor
from tests.conftest import is_running
from tests.reliability.helpers import edit_topology
from tests.waits import WAIT_S, until_sync

pytestmark = pytest.mark.timeout(120)
WINDOW_S = 600.0
RESTART = "restart: {policy: on-failure, max_restarts: 1, backoff: 0.05}\n"
EJECTED_S = 30.0  # the proxy ejects after 3 failed probes 2 s apart, on a loaded machine


@pytest.fixture
def fake_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import FAKE_PROXY

    monkeypatch.setenv("EPDCTL_PROXY_COMMAND", FAKE_PROXY)


def test_window_and_max_backoff_are_durations_that_reach_the_supervisor(fake_topology) -> None:
    from epdctl.launch.run import settings_of
    from epdctl.topology.model import load_topology
    from epdctl.topology.sections import Restart

    assert (Restart().window, Restart().max_backoff) == (600.0, 60.0)
    extra = "restart: {policy: on-failure, window: 2h, backoff: 1s, max_backoff: 5m}\n"
    budget = Budget.of(settings_of(load_topology(fake_topology(extra=extra))))
    assert budget == Budget(max_restarts=3, window_s=7200.0, backoff_s=1.0, max_backoff_s=300.0)


def test_backoff_doubles_up_to_the_cap() -> None:
    budget = Budget(max_restarts=100, window_s=WINDOW_S, backoff_s=2.0, max_backoff_s=60.0)
    assert [budget.delay_s(n) for n in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert budget.delay_s(5000) == 60.0  # no float overflow for a huge max_restarts


def test_restarts_older_than_the_window_are_forgiven() -> None:
    budget = Budget(max_restarts=2, window_s=WINDOW_S, backoff_s=1.0, max_backoff_s=60.0)
    assert budget.next_delay_s([], 0.0) == 1.0
    assert budget.next_delay_s([0.0], 10.0) == 2.0
    assert budget.next_delay_s([0.0, 10.0], 20.0) is None  # two within the window: spent
    assert budget.next_delay_s([0.0, 10.0], 605.0) == 2.0  # the first is forgiven
    assert budget.next_delay_s([0.0, 10.0], 610.0) == 1.0  # both: a clean count
    assert budget.recent([0.0, 10.0, 400.0], 610.0) == [400.0]


def test_ready_for_a_whole_window_starts_with_a_clean_count() -> None:
    """Restarted twice, then ready from t=20 for a window: the next crash waits the first
    delay again, whatever the earlier restarts were."""
    budget = Budget(max_restarts=3, window_s=WINDOW_S, backoff_s=2.0, max_backoff_s=60.0)
    restarts, ready_at = [0.0, 10.0], 20.0
    assert budget.next_delay_s(restarts, ready_at) == 8.0
    assert budget.next_delay_s(restarts, ready_at + WINDOW_S) == 2.0


def test_an_older_state_json_reads_with_no_recent_restarts(tmp_path: Path) -> None:
    """A record written before restart_times existed: its lifetime count stays, no window."""
    old = {"name": "pd-0", "pid": 1, "pgid": 1, "create_time": 1.0, "started_at": 1.0,
           "state": "ready", "restarts": 2}
    record = Record.model_validate_json(json.dumps(old))
    assert (record.restarts, record.restart_times, record.error) == (2, [], None)


class FakeClock:
    """The supervisor's wall clock for restart times, moved on by the test."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset_s


def supervise(sup: Supervisor, script: Callable[[Supervisor], None]) -> int:
    """sup.run() here while `script(sup)` drives it from a thread; when the script ends (or
    fails) the supervisor is told to stop as SIGTERM's handler would tell it."""
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            script(sup)
        except BaseException as exc:
            errors.append(exc)
        finally:
            sup.signals.append(signal.SIGTERM)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        code = sup.run()
    finally:
        driver.join(3 * WAIT_S)
    if errors:
        raise errors[0]
    return code


def supervisor(state_root: Path, topo: Path, clock: FakeClock) -> Supervisor:
    run = prepare(topo, state_root)
    state = run.initial_state()
    sdir = StateDir(run.plan.state_dir)
    sdir.write(state)
    return Supervisor(sdir, state, stop_timeout_s=2.0, clock=clock)


def record(sup: Supervisor, name: str) -> Record | None:
    return sup.state.records.get(name)


def wait_ready(sup: Supervisor, name: str, restarts: int) -> Record:
    """Until `name`'s run number `restarts` is ready (and the topology running)."""

    def ready() -> bool:
        r = record(sup, name)
        return sup.state.phase == "running" and r is not None and r.state == "ready" and (
            r.restarts == restarts)

    until_sync(ready, f"`{name}` ready after {restarts} restart(s)", poll_s=0.02)
    r = record(sup, name)
    assert r is not None
    return r


def crash(sup: Supervisor, name: str, restarts: int) -> int:
    """SIGKILL `name`'s group once its run number `restarts` is ready; its pid."""
    r = wait_ready(sup, name, restarts)
    os.killpg(r.pgid, signal.SIGKILL)
    return r.pid


def all_pids(sup: Supervisor) -> list[int]:
    return [r.pid for r in sup.sdir.read().records.values()]


def test_crashes_spaced_beyond_the_window_never_exhaust_the_budget(
    state_root: Path, fake_topology, fake_proxy
) -> None:
    """max_restarts 1, and pd-0 crashes three times, each a window after the last restart:
    every crash is restarted; the lifetime count goes on, the window's holds one."""
    clock = FakeClock()
    sup = supervisor(state_root, fake_topology(extra=RESTART), clock)

    def script(sup: Supervisor) -> None:
        for n in range(3):
            wait_ready(sup, "pd-0", n)
            clock.offset_s += WINDOW_S + 1
            crash(sup, "pd-0", n)
        wait_ready(sup, "pd-0", 3)

    assert supervise(sup, script) == 143
    state = sup.sdir.read()
    assert state.phase == "stopped" and state.error is None
    pd = state.records["pd-0"]
    assert (pd.restarts, len(pd.restart_times)) == (3, 1)
    assert not any(is_running(p) for p in all_pids(sup))


def two_pds(state_root: Path, fake_topology) -> Path:
    def change(data: dict) -> None:
        data["roles"]["prefill_decode"]["replicas"] = 2

    return edit_topology(fake_topology(extra=RESTART), change)


def test_an_instance_out_of_restarts_stays_down_while_its_role_has_another(
    state_root: Path, fake_topology
) -> None:
    """pd-1 crashes twice within the window (max_restarts 1): it stays down, `failed` in
    state.json, `status --json` and `top`, with its log's last lines; pd-0, the encoder and
    the real proxy keep serving, and the proxy ejects pd-1. `epdctl restart` brings it back."""
    sup = supervisor(state_root, two_pds(state_root, fake_topology), FakeClock())

    def script(sup: Supervisor) -> None:
        wait_ready(sup, "pd-0", 0)
        crash(sup, "pd-1", 0)
        crash(sup, "pd-1", 1)
        until_sync(lambda: (r := record(sup, "pd-1")) is not None and r.state == "failed",
                   "pd-1 failed", poll_s=0.02)
        state = sup.sdir.read()
        assert state.phase == "running" and state.error is None
        pd1 = state.records["pd-1"]
        assert pd1.restarts == 1 and pd1.error is not None
        assert pd1.error.startswith("`pd-1` was killed by SIGKILL while serving (after 1 "
                                    "restart(s)); out of restarts (1 within 600s); last lines")
        assert "  fake: serving fake-model on 127.0.0.1:" in pd1.error
        assert {n: r.state for n, r in state.records.items()} == {
            "encode-0": "ready", "pd-0": "ready", "pd-1": "failed", "proxy": "ready"}
        check_status_and_top(sup.sdir, state)
        check_proxy_routes_around(state)
        # `epdctl restart pd-1` brings it back (an asked restart: no budget spent).
        restart_one.request(sup.sdir, "pd-1")
        back = wait_ready(sup, "pd-1", 1)
        assert back.pid != pd1.pid and back.error is None

    assert supervise(sup, script) == 143
    assert not any(is_running(p) for p in all_pids(sup))


def check_status_and_top(sdir: StateDir, state: RunState) -> None:
    """pd-1 is `failed` in `status --json` (with its error) and in `top`'s UP column."""
    from epdctl.cli.status import collect
    from epdctl.top import sample, summary, view

    doc = collect(sdir, state)
    rows = {i["name"]: i for i in doc["instances"]}
    assert (rows["pd-1"]["state"], rows["pd-1"]["error"]) == ("failed",
                                                              state.records["pd-1"].error)
    assert rows["pd-0"]["state"] == "ready" and not doc["ready"]
    top = summary.summarize(state, [sample.take(state)])
    assert [r["is_failed"] for r in top["instances"]] == [False, False, True]
    lines = _text(view.render(top)).splitlines()
    assert next(ln for ln in lines if ln.startswith("pd-1")).split()[:3] == [
        "pd-1", "PD", "failed"]


def check_proxy_routes_around(state: RunState) -> None:
    """Requests through the real proxy still answer, and its health loop ejects pd-1."""
    key = state.internal_key
    with httpx.Client(base_url=state.proxy.url, timeout=30) as client:
        for _ in range(4):
            reply = client.post("/v1/chat/completions", json={
                "model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200, reply.text

        def health() -> dict:
            return dict(client.get("/health", headers={"authorization": f"Bearer {key}"}).json())

        until_sync(lambda: health()["roles"]["prefill_decode"]["out"], "pd-1 ejected",
                   EJECTED_S, poll_s=0.2)
        assert health()["roles"]["prefill_decode"] == {
            "in": [state.specs[1].url], "out": [state.specs[2].url]}


def _text(renderable: object) -> str:
    from rich.console import Console

    console = Console(width=200, file=io.StringIO())
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_last_instance_of_a_role_out_of_restarts_fails_the_topology(
    state_root: Path, fake_topology, fake_proxy
) -> None:
    """pd-0, the only PD, crashes twice within the window: everything stops, and the error
    names the role and its instances, then the instance's exit and log."""
    sup = supervisor(state_root, fake_topology(extra=RESTART), FakeClock())

    def script(sup: Supervisor) -> None:
        crash(sup, "pd-0", 0)
        crash(sup, "pd-0", 1)
        until_sync(lambda: sup.state.phase != "running", "the topology failed", poll_s=0.02)

    with pytest.raises(InstanceDiedError) as info:
        supervise(sup, script)
    text = str(info.value)
    assert text.startswith("role `prefill_decode` has no instance left (`pd-0` out of "
                           "restarts); `pd-0` was killed by SIGKILL while serving (after 1 "
                           "restart(s)); out of restarts (1 within 600s); last lines of ")
    state = sup.sdir.read()
    assert state.phase == "exited" and state.error == text
    assert state.records["pd-0"].state == "failed"
    assert not any(is_running(p) for p in all_pids(sup))
