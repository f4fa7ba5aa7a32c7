"""`cache inspect` / `cache clean` when the running topology's EC connector is not epdctl's
store: ECExampleConnector's files are shown and cleaned, any other connector is named."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from epdctl.cli._app import App
from epdctl.cli.cache._store import StoreView
from epdctl.cli.views import duration, size
from epdctl.errors import CacheError

# vLLM's ECExampleConnector checks a file exists, then loads it a step later, with no fallback
# (vllm-epd-contracts.md §1.6): removing it in between fails the loading engine.
NO_PINS = ("warning: ECExampleConnector pins nothing: a file removed while P/PD is about to "
           "load it fails that engine; clean while no request is in flight")


def inspect_items(app: App, view: StoreView, show_entries: bool, as_json: bool) -> None:
    """What the connector holds: ECExampleConnector's items, or a line saying epdctl can't see."""
    from epdctl.cache.example_files import list_items

    root = view.example_dir
    items = list_items(root) if root is not None else []
    if as_json:
        doc: dict[str, Any] = {
            "connector": view.connector, "topology": view.topology,
            "store_dir": None if root is None else str(root), "note": view.not_ours(),
            "active_namespace": view.active_namespace,
            "entries": len(items), "size_bytes": sum(i.size_bytes for i in items),
        }
        if root is not None and show_entries:
            doc["items"] = [dataclasses.asdict(i) for i in items]
        click.echo(json.dumps(doc, indent=2))
        return
    app.err.print(Text(view.not_ours()))
    if root is None:
        return
    now = time.time()
    if not items:
        app.err.print(Text("It holds no item yet."))
        return
    ages = [now - i.mtime for i in items]
    app.out.print(Text(
        f"{len(items)} {'item' if len(items) == 1 else 'items'}, "
        f"{size(sum(i.size_bytes for i in items))}, saved {duration(max(0.0, min(ages)))} to "
        f"{duration(max(0.0, max(ages)))} ago (no hit counts: the connector keeps none)"))
    if show_entries:
        table = Table(box=None, pad_edge=False, header_style="bold")
        table.add_column("KEY", overflow="fold")
        for name in ("SIZE", "AGE"):
            table.add_column(name, justify="right")
        for item, age in zip(items, ages, strict=True):
            table.add_row(Text(item.key), Text(size(item.size_bytes)),
                          Text(duration(max(0.0, age))))
        app.out.print(table)


def clean_items(app: App, view: StoreView, *, remove_all: bool, older_than_s: float | None,
                max_bytes: int | None, namespace: str | None, is_dry_run: bool,
                as_json: bool) -> None:
    """ECExampleConnector: remove its items by the same rules; another connector: say so."""
    from epdctl.cache.example_files import list_items, remove, select

    root = view.example_dir
    if root is None:
        app.err.print(Text(f"{view.not_ours()}; nothing for `cache clean` to remove"))
        return
    if namespace is not None and namespace != view.active_namespace:
        raise CacheError(f"`{view.topology}` runs {view.connector} in namespace "
                         f"`{view.active_namespace}`, not `{namespace}`")
    doomed = select(list_items(root), remove_all=remove_all, older_than_s=older_than_s,
                    max_bytes=max_bytes)
    if not is_dry_run:
        remove(root, [item for item, _ in doomed])
    freed = sum(item.size_bytes for item, _ in doomed)
    if as_json:
        click.echo(json.dumps({
            "connector": view.connector, "store_dir": str(root), "dry_run": is_dry_run,
            "freed_bytes": freed,
            "removed": [{"key": i.key, "path": str(Path(i.path).parent),
                         "size_bytes": i.size_bytes, "reason": why} for i, why in doomed],
        }, indent=2))
        return
    app.err.print(Text(view.not_ours()))
    if doomed and not is_dry_run:
        app.err.print(Text(NO_PINS, style="yellow"))
    verb = "Would remove" if is_dry_run else "Removed"
    count = len(doomed)
    app.out.print(Text(f"{verb} {count} {'item' if count == 1 else 'items'} ({size(freed)}) "
                       f"from {root}"))
