"""One instance restarted while the others serve (`epdctl restart NAME`): the request the
command leaves in the state dir, and what the supervisor does with it (stop the instance's
group, start it again at once: not a crash, so no backoff and no restart budget spent).

The command drains the instance in the proxy first and re-admits it once it is ready again
(drain.py); the supervisor looks for requests every tick.
"""

from __future__ import annotations

import time
from pathlib import Path

from epdctl.errors import RestartError
from epdctl.host.private import write_file
from epdctl.launch.state import Record, RunState, StateDir

REQUESTS = "restart-requests"


def request(sdir: StateDir, name: str) -> None:
    """Ask the run's supervisor to restart `name` (it takes the request within a tick)."""
    folder = sdir.path / REQUESTS
    folder.mkdir(mode=0o700, exist_ok=True)
    write_file(folder / name, b"")


def take(run_dir: Path) -> list[str]:
    """The supervisor's side: the names asked for since it last looked (each once). A
    request being written (write_file's `.NAME.*.tmp`, renamed into place) is not one yet:
    taking it unlinked the file under the writer, whose rename then failed."""
    folder = run_dir / REQUESTS
    try:
        names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return []
    for name in names:
        (folder / name).unlink(missing_ok=True)
    return names


def wait_restarted(sdir: StateDir, name: str, old: Record, timeout_s: float) -> Record:
    """Until `name` runs again, a new process, ready; RestartError past `timeout_s` or when
    the run stops meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = sdir.read()
        if state.phase not in ("starting", "running"):
            raise RestartError(f"`{state.name}` stopped while `{name}` restarted "
                               f"({state.phase}); see `epdctl logs {name}`")
        record = state.records.get(name)
        if record is not None and record.pid != old.pid and record.state == "ready":
            return record
        time.sleep(0.2)
    raise RestartError(f"`{name}` was not ready again within {timeout_s:g}s; see "
                       f"`epdctl logs {name}`")


def check_names(state: RunState, names: list[str]) -> None:
    """Only engines of a running topology: the proxy is every request's way in."""
    if state.phase != "running":
        raise RestartError(f"`{state.name}` is {state.phase}, not running")
    engines = [s.name for s in state.engines]
    for name in names:
        if name == state.proxy.name:
            raise RestartError(f"`{name}` is the proxy, the way in for every request: "
                               "`epdctl down` (it drains) and `epdctl up` restart it")
        if name not in engines:
            raise RestartError(f"no instance `{name}` in `{state.name}` (instances: "
                               f"{', '.join(engines)})")
