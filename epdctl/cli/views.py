"""rich renderables built from data (pure functions), and the live progress view of `up`."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from epdctl.launch.state import RunState
from epdctl.units import format_bytes

if TYPE_CHECKING:
    from rich.live import Live

    from epdctl.cli._app import App

STATE_STYLE = {"ready": "green", "starting": "yellow", "pending": "dim", "backoff": "yellow",
               "unhealthy": "red", "exited": "red", "failed": "red", "stale": "magenta"}


def duration(seconds: float | None) -> str:
    """3.2s, 4m05s, 2h03m; '-' for unknown."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def size(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def elapsed(state: RunState, name: str, now: float) -> float | None:
    record = state.records.get(name)
    if record is None:
        return None
    return (record.ready_at or now) - record.started_at


def progress_table(state: RunState, now: float) -> Table:
    """One row per instance while `up` waits: name, state, elapsed."""
    table = Table(box=None, show_header=False, pad_edge=False)
    for spec in state.specs:
        record = state.records.get(spec.name)
        st = record.state if record else "pending"
        table.add_row(Text(spec.name), Text(st, style=STATE_STYLE.get(st, "")),
                      Text(duration(elapsed(state, spec.name, now))))
    return table


def progress_line(name: str, state: str, seconds: float | None) -> str:
    """What a non-interactive stderr gets when an instance changes state."""
    return f"{name}: {state}" + (f" ({duration(seconds)})" if seconds is not None else "")


def proxy_url(state: RunState) -> str:
    return state.proxy.url


def summary(state: RunState) -> Text:
    """What `up` prints once everything is ready: URLs, GPUs and a request to try."""
    width = max(len(s.name) for s in state.specs)
    text = Text(f"{state.name} is ready ({state.mode}): {len(state.engines)} instance(s), "
                f"model {state.model_name}\n")
    text.append(f"  {'proxy'.ljust(width)}  {proxy_url(state)}\n")
    for spec in state.engines:
        gpus = ",".join(spec.gpus) or "-"
        text.append(f"  {spec.name.ljust(width)}  {spec.url}  GPUs {gpus}\n")
    body = json.dumps({"model": state.model_name,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    argv = ["curl", f"{proxy_url(state)}/v1/chat/completions",
            "-H", "content-type: application/json", "-d", body]
    if state.proxy_api_key:
        # The key itself stays out of terminals and scrollback: name where it comes from.
        argv[2:2] = ["-H", "authorization: Bearer <proxy.api_key from the topology>"]
    text.append(f"try:\n  {shlex.join(argv)}")
    return text


def status_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """`epdctl status`: one row per instance (rows as in `status --json`)."""
    table = Table(box=None, pad_edge=False)
    for column in ("INSTANCE", "ROLE", "GPUS", "PORT", "PID", "STATE", "UPTIME", "RSS"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        st = row["state"]
        table.add_row(
            Text(row["name"]), Text(row["role"]), Text(",".join(row["gpus"]) or "-"),
            Text(str(row["port"])), Text(str(row["pid"] or "-")),
            Text(st, style=STATE_STYLE.get(st, "")), Text(duration(row["uptime_s"])),
            Text(size(row["rss_bytes"])),
        )
    return table


class Progress:
    """Instance states while `up` waits: a live table on a TTY, one line per change elsewhere."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.seen: dict[str, str] = {}
        self.live: Live | None = None
        if app.err.is_interactive:
            from rich.live import Live

            self.live = Live(console=app.err, transient=True, refresh_per_second=4)
            self.live.start()

    def update(self, state: RunState) -> None:
        if self.live is not None:
            self.live.update(progress_table(state, time.time()))
            return
        for name, record in state.records.items():
            if self.seen.get(name) != record.state:
                self.seen[name] = record.state
                seconds = (record.ready_at or time.time()) - record.started_at
                self.app.err.print(progress_line(name, record.state, seconds), markup=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
