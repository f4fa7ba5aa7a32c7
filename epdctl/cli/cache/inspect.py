"""`epdctl cache inspect`: namespaces (and entries) of the EC store, with usage counters."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from epdctl.cli._app import App, pass_app
from epdctl.cli.cache._store import StoreView, resolve_store, store_dir_option
from epdctl.cli.views import duration, percent, size

_COLUMNS = ("ENTRIES", "SIZE", "PINNED", "HITS", "MISSES", "SAVES", "LOADS", "HIT%", "OLDEST",
            "NEWEST")
HIT_LEGEND = "HIT% = the proxy's store lookups that found the item (no encoder round trip)"


@click.command()
@store_dir_option
@click.option("--entries", "show_entries", is_flag=True, help="Also list every entry.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_app
def inspect(app: App, store_dir: Path | None, show_entries: bool, as_json: bool) -> None:
    """Show what the EC store holds and how it was used"""
    view = resolve_store(app, store_dir)
    if not view.is_ours:
        from epdctl.cli.cache._foreign import inspect_items

        return inspect_items(app, view, show_entries, as_json)
    doc = collect(view, show_entries)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    if not doc["namespaces"]:
        app.err.print(Text(f"The EC store {view.root} is empty."))
        return
    now = time.time()
    app.out.print(_namespace_table(doc["namespaces"], now))
    app.out.print(Text(_footer(doc)))
    for ns in doc["namespaces"] if show_entries else ():
        app.out.print(Text(f"\n{ns['namespace']}"))
        app.out.print(_entry_table(ns["items"], now))


def collect(view: StoreView, show_entries: bool) -> dict[str, Any]:
    """The `cache inspect --json` document (stable keys)."""
    from epdctl.cache.listing import inspect as list_namespaces
    from epdctl.cache.listing import list_entries
    from epdctl.cache.stats import hit_ratio

    namespaces = []
    for stats in list_namespaces(view.root):
        row = dataclasses.asdict(stats)
        row["hit_ratio"] = hit_ratio(row)
        row["active"] = stats.namespace == view.active_namespace
        if show_entries:
            items = list_entries(view.root, stats.namespace)
            row["items"] = [dataclasses.asdict(e) for e in items]
        namespaces.append(row)
    try:
        usage = shutil.disk_usage(view.root)
        fs = {"total_bytes": usage.total, "free_bytes": usage.free}
    except OSError:
        fs = None
    return {
        "connector": view.connector,
        "store_dir": str(view.root),
        "capacity_bytes": view.capacity_bytes,
        "active_namespace": view.active_namespace,
        "size_bytes": sum(ns["size_bytes"] for ns in namespaces),
        "pool_files": sum(ns["pool_files"] for ns in namespaces),
        "pool_bytes": sum(ns["pool_bytes"] for ns in namespaces),
        "filesystem": fs,
        "namespaces": namespaces,
    }


def _age(now: float, t: float | None) -> str:
    return "-" if t is None else duration(max(0.0, now - t))


def _namespace_table(namespaces: list[dict[str, Any]], now: float) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("NAMESPACE", overflow="fold")
    for name in _COLUMNS:
        table.add_column(name, justify="right")
    for ns in namespaces:
        name = ns["namespace"] + (" *" if ns["active"] else "")
        pinned = f"{ns['pinned_entries']}/{ns['pins']}" if ns["pins"] else str(ns["pinned_entries"])
        cells = (
            ns["entries"],
            size(ns["size_bytes"]),
            pinned,
            ns["hits"],
            ns["misses"],
            ns["saves"],
            ns["loads"],
            percent(ns["hit_ratio"]),
            _age(now, ns["oldest"]),
            _age(now, ns["newest"]),
        )
        table.add_row(Text(name), *(Text(str(c)) for c in cells))
    return table


def _footer(doc: dict[str, Any]) -> str:
    # The pool's spare files count in the capacity as entries do.
    used = size(doc["size_bytes"] + doc["pool_bytes"])
    capacity = doc["capacity_bytes"]
    line = f"store {doc['store_dir']}: {used}"
    line += f" of {size(capacity)} capacity" if capacity else " used"
    if doc["pool_files"]:
        files = "file" if doc["pool_files"] == 1 else "files"
        line += (f" ({size(doc['pool_bytes'])} of it in the pool: {doc['pool_files']} spare "
                 f"{files} for the next saves)")
    if doc["filesystem"]:
        fs = doc["filesystem"]
        line += f"; filesystem {size(fs['free_bytes'])} free of {size(fs['total_bytes'])}"
    if doc["active_namespace"]:
        line += "; * = the running topology's namespace"
    if any(ns["lookups"] for ns in doc["namespaces"]):
        line += f"\n{HIT_LEGEND}"
    return line


def _entry_table(items: list[dict[str, Any]], now: float) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("KEY", overflow="fold")
    for name in ("MODALITY", "DTYPE", "SHAPE", "SIZE", "AGE", "HITS", "PINNED"):
        table.add_column(name, justify="right")
    for e in items:
        shape = "?" if e["shape"] is None else "x".join(str(d) for d in e["shape"])
        cells = (
            e.get("modality") or "?",
            e["dtype"] or "?",
            shape,
            size(e["size_bytes"]),
            _age(now, e["last_used"]),
            e["hits"],
            "yes" if e["pinned"] else "",
        )
        table.add_row(Text(e["key"]), *(Text(str(c)) for c in cells))
    return table
