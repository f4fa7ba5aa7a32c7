"""A live change between the command that plans it (`epdctl scale`, `switch`, `apply`) and the
run's supervisor, which alone writes state.json: the request the command leaves in the state
dir, the supervisor's side (take it), the change log both write (changes.jsonl: every change
with its reason, and an added instance that never became ready), and the command's waits.

The proxy's pools are the command's to change (launch.drain's controls): it removes an
instance from them before asking the supervisor to stop it, and adds one once it is ready.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from epdctl.errors import ChangeError
from epdctl.host.private import open_append, open_file, write_file
from epdctl.launch.state import Record, SpecModel, StateDir

REQUESTS = "change-requests"
LOG = "changes.jsonl"
LOCK = "change.lock"
POLL_S = 0.2


class Request(BaseModel):
    """One change: instances to stop and forget, instances to start, the proxy's spec for
    the engines as they will be (what a restarted proxy is started with)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    reason: str
    at: float
    """When it was made: an instance of its is started after it."""
    remove: list[str] = []
    add: list[SpecModel] = []
    proxy: SpecModel | None = None
    topology_path: str | None = None
    """The file the run now follows (`apply FILE`), for later changes and `status`."""


def new_request(reason: str, **parts: Any) -> Request:
    return Request(id=uuid.uuid4().hex[:12], reason=reason, at=time.time(), **parts)


@contextmanager
def one_change_at_a_time(sdir: StateDir) -> Iterator[None]:
    """Held by a changing command throughout (another one fails at once, in one line)."""
    fd = open_file(sdir.path / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ChangeError(f"another change of `{sdir.path.name}` is under way (scale, "
                               "switch, apply or restart); try again once it is done") from None
        yield
    finally:
        os.close(fd)


def request(sdir: StateDir, change: Request) -> None:
    """Leave `change` for the run's supervisor (it takes it within a tick)."""
    folder = sdir.path / REQUESTS
    folder.mkdir(mode=0o700, exist_ok=True)
    write_file(folder / f"{time.time_ns()}-{change.id}.json",
               change.model_dump_json().encode())


def take(run_dir: Path) -> list[Request]:
    """The supervisor's side: the requests left since it last looked, oldest first (each
    once; one that is not a Request is dropped and logged)."""
    folder = run_dir / REQUESTS
    try:
        names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = folder / name
        try:
            found.append(Request.model_validate_json(path.read_bytes()))
        except (OSError, ValidationError) as exc:
            log(run_dir, {"request": name, "error": f"unreadable: {exc}"})
        path.unlink(missing_ok=True)
    return found


def log(run_dir: Path, entry: dict[str, Any]) -> None:
    """Append one change (or its outcome) to changes.jsonl, with the time."""
    with open_append(run_dir / LOG) as f:
        f.write(json.dumps({"at": round(time.time(), 3), **entry}).encode() + b"\n")


def read_log(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / LOG).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _failed(run_dir: Path, change: Request, name: str) -> str | None:
    return next((e["error"] for e in read_log(run_dir)
                 if e.get("id") == change.id and e.get("name") == name and "error" in e), None)


def wait_ready(sdir: StateDir, change: Request, name: str, timeout_s: float) -> Record:
    """Until the supervisor has started `name` for `change` and it is ready; ChangeError
    when it died first (the supervisor forgot it), when the run stopped, or past
    `timeout_s` (an instance of that name started before the change is not it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = sdir.read()
        if state.phase != "running":
            raise ChangeError(f"`{state.name}` stopped ({state.phase}) while `{name}` started")
        error = _failed(sdir.path, change, name)
        if error is not None:
            raise ChangeError(error)
        record = state.records.get(name)
        if record is not None and record.state == "ready" and record.started_at >= change.at:
            return record
        time.sleep(POLL_S)
    raise ChangeError(f"`{name}` was not ready within {timeout_s:g}s; see "
                       f"`epdctl logs {name}`")


def wait_gone(sdir: StateDir, name: str, timeout_s: float) -> None:
    """Until the supervisor has stopped and forgotten `name`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = sdir.read()
        if name not in state.records and all(s.name != name for s in state.specs):
            return
        if state.phase != "running":
            raise ChangeError(f"`{state.name}` stopped ({state.phase}) while `{name}` stopped")
        time.sleep(POLL_S)
    raise ChangeError(f"the supervisor did not stop `{name}` within {timeout_s:g}s")
