"""`epdctl status`: what runs, and is it ready (table, --json, or --watch)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import click

from epdctl.cli._app import App, pass_app
from epdctl.cli.views import percent, proxy_url, status_table

if TYPE_CHECKING:
    from epdctl.launch.state import Record, RunState, SpecModel, StateDir


def _rss(pid: int) -> int | None:
    """Resident memory of the whole tree (vLLM's engine core and workers are children)."""
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return None


def _instance(spec: SpecModel, record: Record | None, now: float) -> dict[str, Any]:
    from epdctl.launch.identity import still_ours
    from epdctl.launch.readiness import is_ready, judge

    row: dict[str, Any] = {
        "name": spec.name, "role": spec.role, "gpus": spec.gpus, "port": spec.port,
        "url": spec.url, "pid": None, "state": "starting",
        "uptime_s": None, "rss_bytes": None, "restarts": 0, "exit_code": None,
        "log": spec.log_path, "error": None,
    }
    if record is None:
        return row
    row.update(pid=record.pid, restarts=record.restarts, exit_code=record.exit_code)
    if record.state == "failed":  # out of restarts: the supervisor gave up on it
        return {**row, "state": "failed", "error": record.error}
    match = still_ours(record)
    row["state"] = judge(match, bool(match) and is_ready(spec.health_url),
                         record.ready_at is not None)
    if match:
        row["uptime_s"] = round(now - record.started_at, 1)
        row["rss_bytes"] = _rss(record.pid)
    return row


def _cache(state: RunState) -> dict[str, Any]:
    """The proxy's store lookups for this topology (`cache inspect` has the rest)."""
    from epdctl.cache.stats import hit_ratio, read_stats

    counts, _ = read_stats(state.store_dir)
    row: dict[str, Any] = {k: int(counts[k]) for k in ("lookups", "skipped", "sent", "waits",
                                                         "expired")}
    row["wait_s"] = float(counts["wait_s"])
    return {"namespace": state.namespace, **row, "hit_ratio": hit_ratio(counts)}


def cache_line(cache: dict[str, Any]) -> str | None:
    """`encoder cache: 50% hit (...)`, once the proxy has looked anything up; then what PD
    waited for while E encoded (overlap)."""
    line = None
    if cache["lookups"]:
        line = (f"encoder cache: {percent(cache['hit_ratio'])} hit ({cache['skipped']} of "
                f"{cache['lookups']} media items were in the store and skipped the encoder)")
    if cache.get("waits"):
        mean_ms = 1000 * cache["wait_s"] / cache["waits"]
        waited = (f"overlap: PD waited for {cache['waits']} items E was still encoding "
                  f"(mean {mean_ms:.0f} ms; {cache['expired']} encoded by PD itself after E "
                  "failed or ran late)")
        line = waited if line is None else f"{line}\n{waited}"
    return line


def collect(sdir: StateDir, state: RunState) -> dict[str, Any]:
    """The `status --json` document (stable keys)."""
    from epdctl.launch.exposure import run_safety
    from epdctl.launch.identity import still_ours

    now = time.time()
    instances = [_instance(s, state.records.get(s.name), now) for s in state.specs]
    sup = state.supervisor
    return {
        "name": state.name, "phase": state.phase, "mode": state.mode,
        "model": state.model_name, "topology": state.topology_path,
        "state_dir": str(sdir.path), "proxy_url": proxy_url(state),
        "supervisor": None if sup is None else {
            "pid": sup.pid, "alive": bool(still_ours(sup))},
        "ready": all(i["state"] == "ready" for i in instances),
        "error": state.error,
        "instances": instances,
        "cache": _cache(state),
        "safety": run_safety(state),
    }


@click.command()
@click.option("--name", "name", metavar="NAME|FILE",
              help="Topology name or file; default: the only one under the state dir.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", "should_watch", is_flag=True, help="Redraw every second until Ctrl+C.")
@click.pass_context
@pass_app
def status(app: App, ctx: click.Context, name: str | None, as_json: bool,
           should_watch: bool) -> None:
    """Show each instance's state; exit 0 only when all are ready"""
    from epdctl.launch.state import find_state_dir

    sdir = find_state_dir(app.state_root, name)
    doc = collect(sdir, sdir.read())
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    elif should_watch:
        from rich.live import Live

        try:
            with Live(status_table(doc["instances"]), console=app.out,
                      auto_refresh=False) as live:
                while True:
                    time.sleep(1.0)
                    doc = collect(sdir, sdir.read())
                    live.update(status_table(doc["instances"]), refresh=True)
        except KeyboardInterrupt:
            pass
    else:
        app.out.print(status_table(doc["instances"]))
        line = cache_line(doc["cache"])
        if line:
            app.out.print(line, markup=False, highlight=False)
        from epdctl.launch.exposure import safety_line

        app.out.print(safety_line(doc["safety"]), markup=False, highlight=False)
        for row in doc["instances"]:
            if row["error"] and row["error"] not in (doc["error"] or ""):
                app.err.print(row["error"], markup=False)
        if doc["error"]:
            app.err.print(doc["error"], markup=False)
    ctx.exit(0 if doc["ready"] else 1)
