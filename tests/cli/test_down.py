from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.conftest import is_running, run_pids

pytestmark = pytest.mark.timeout(90)


def up(epdctl, topo) -> None:
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr


def kill_supervisor(state_root) -> None:
    pid = run_pids(state_root)["supervisor"]
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while is_running(pid) and time.monotonic() < end:
        time.sleep(0.05)


def test_down_stops_everything_and_keeps_logs(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology(pd_args=("--spawn-grandchild",)))
    pids = run_pids(state_root)
    log = (state_root / "fake" / "logs" / "pd-0.log").read_text()
    grandchild = int(re.search(r"grandchild pid (\d+)", log)[1])
    result = epdctl("down", "--timeout", "2")  # the grandchild ignores SIGTERM
    assert result.exit_code == 0
    assert result.stderr == (
        "Stopped fake: supervisor, proxy, encode-0, pd-0.\n"
        "Killed with SIGKILL (still running after 2s): pd-0\n"
        f"Logs are kept in {state_root / 'fake' / 'logs'}\n"
    )
    assert not any(is_running(p) for p in [*pids.values(), grandchild])
    assert sorted(p.name for p in (state_root / "fake").iterdir()) == [
        "last-run.json", "lock", "logs", "namespaces.json"]


def test_down_twice_is_not_running(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology())
    assert epdctl("down", "--name", "fake").exit_code == 0
    again = epdctl("down", "--name", "fake")
    assert again.exit_code == 1
    assert again.stderr == f"Error: `fake` is not running (no {state_root}/fake/state.json)\n"
    assert epdctl("down").stderr == f"Error: nothing is running (no topology under {state_root})\n"


def test_down_after_the_supervisor_was_killed(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology())
    kill_supervisor(state_root)
    pids = run_pids(state_root)
    result = epdctl("down")
    assert result.exit_code == 0
    assert result.stderr.startswith("Stopped fake: proxy, pd-0, encode-0.\n")
    assert not any(is_running(p) for p in pids.values())


def test_stale_pid_is_not_signalled(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology())
    kill_supervisor(state_root)
    path = state_root / "fake" / "state.json"
    data = json.loads(path.read_text())
    record = data["records"]["pd-0"]
    record["create_time"] -= 1000  # as if pd-0's pid now were someone else's
    record["start_ticks"] -= 100_000
    path.write_text(json.dumps(data))
    pd = data["records"]["pd-0"]["pid"]
    result = epdctl("down")
    assert result.exit_code == 0
    assert "Not signalled (the pid now belongs to another process): pd-0\n" in result.stderr
    assert is_running(pd)  # the state_root finalizer stops it through its env markers


def test_down_stops_its_processes_after_the_clock_was_set(epdctl, fake_topology,
                                                          state_root) -> None:
    """A clock set by minutes (NTP stepping a fresh VM's clock) moves every start psutil
    reads by as much; the processes are still the run's, and `down` stops every one."""
    up(epdctl, fake_topology())
    kill_supervisor(state_root)  # so that it writes state.json no more
    pids = run_pids(state_root)
    path = state_root / "fake" / "state.json"
    data = json.loads(path.read_text())
    for record in data["records"].values():
        record["create_time"] -= 600  # read before the clock went 10 minutes forward
    path.write_text(json.dumps(data))
    result = epdctl("down")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.startswith("Stopped fake: proxy, pd-0, encode-0.\n"), result.stderr
    assert not any(is_running(p) for p in pids.values())


def test_sigkill_after_the_deadline(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology(pd_args=("--ignore-sigterm",)))
    pids = run_pids(state_root)
    begin = time.monotonic()
    result = epdctl("down", "--timeout", "1")
    assert result.exit_code == 0
    assert "Killed with SIGKILL (still running after 1s): pd-0\n" in result.stderr
    assert time.monotonic() - begin < 10
    assert not any(is_running(p) for p in pids.values())


def test_corrupt_state_needs_force(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology())
    pids = run_pids(state_root)
    (state_root / "fake" / "state.json").write_text("{garbage")
    result = epdctl("down")
    assert result.exit_code == 1
    assert "run `epdctl down --force --name fake`" in result.stderr
    forced = epdctl("down", "--force", "--name", "fake")
    assert forced.exit_code == 0, forced.stderr
    assert not any(is_running(p) for p in pids.values())


def test_store_dir_removed_unless_kept(epdctl, fake_topology, state_root, tmp_path) -> None:
    topo = fake_topology()
    up(epdctl, topo)
    store = json.loads((state_root / "fake" / "state.json").read_text())["store_dir"]
    os.makedirs(store, exist_ok=True)
    result = epdctl("down", "--keep-cache")
    assert f"Kept the EC store {store}\n" in result.stderr
    assert os.path.isdir(store)
    other = os.path.join(os.path.dirname(store), "another-namespace")
    os.makedirs(other)
    up(epdctl, topo)
    assert epdctl("down").exit_code == 0
    assert not os.path.exists(store) and os.path.isdir(other)  # the root holds another one
    os.rmdir(other)
    up(epdctl, topo)
    os.makedirs(store, exist_ok=True)
    assert epdctl("down").exit_code == 0
    assert not os.path.exists(os.path.dirname(store))  # the last namespace: the root goes too


@pytest.mark.parametrize(("args", "seconds"), [
    ((), 30.0), (("--drain",), 30.0), (("--drain", "5"), 5.0), (("--no-drain",), None),
    (("--drain", "0"), None)])
def test_down_drains_for_the_seconds_asked(args: tuple[str, ...], seconds: float | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`--drain [SECONDS]` (30 without a value or the flag), `--no-drain`: what the drain
    step is asked for before the stop (nothing: no drain)."""
    import sys
    from unittest import mock

    from click.testing import CliRunner

    from epdctl.cli import cli

    module = sys.modules["epdctl.cli.down"]
    asked: list[float] = []
    monkeypatch.setattr(module, "_drain", lambda app, state, s: asked.append(s))
    with mock.patch("epdctl.launch.run.find"), mock.patch("epdctl.launch.run.stop"):
        result = CliRunner().invoke(cli, ["down", *args])
    assert asked == ([] if seconds is None else [seconds]), result.output
