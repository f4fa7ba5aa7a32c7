"""`epdctl cache clean`: remove entries by age, size or all, never one being loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.text import Text

from epdctl.cli._app import App, pass_app
from epdctl.cli.cache._store import resolve_store, store_dir_option
from epdctl.cli.views import size
from epdctl.errors import CacheError


class _Parsed(click.ParamType):
    """A click type over one of topology's parsers (sizes such as 1GiB, durations such as 10m)."""

    def __init__(self, name: str, parser_name: str) -> None:
        self.name = name
        self._parser_name = parser_name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from epdctl.topology import model as topology

        try:
            return getattr(topology, self._parser_name)(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.command()
@store_dir_option
@click.option("--all", "remove_all", is_flag=True, help="Remove every entry not being loaded.")
@click.option(
    "--older-than",
    "older_than_s",
    type=_Parsed("duration", "parse_duration"),
    metavar="AGE",
    help="Remove entries unused for longer than AGE (e.g. 10m).",
)
@click.option(
    "--max-bytes",
    "max_bytes",
    type=_Parsed("size", "parse_size"),
    metavar="SIZE",
    help="Evict least recently used entries until the store holds at most SIZE.",
)
@click.option("--namespace", "namespace", metavar="NS", help="Only this namespace.")
@click.option("--dry-run", "is_dry_run", is_flag=True, help="Show what would go; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_app
def clean(
    app: App,
    store_dir: Path | None,
    remove_all: bool,
    older_than_s: float | None,
    max_bytes: int | None,
    namespace: str | None,
    is_dry_run: bool,
    as_json: bool,
) -> None:
    """Remove EC store entries, stale pins and orphaned tmp files"""
    from epdctl.cache import janitor
    from epdctl.cache.listing import inspect as list_namespaces

    view = resolve_store(app, store_dir)
    if not view.is_ours:
        from epdctl.cli.cache._foreign import clean_items

        return clean_items(app, view, remove_all=remove_all, older_than_s=older_than_s,
                           max_bytes=max_bytes, namespace=namespace, is_dry_run=is_dry_run,
                           as_json=as_json)
    if namespace is not None and namespace not in {
        ns.namespace for ns in list_namespaces(view.root)
    }:
        raise CacheError(f"no namespace `{namespace}` in the EC store {view.root}")
    keep = {view.active_namespace} if view.active_namespace else set()
    report = janitor.clean(
        view.root,
        all=remove_all,
        older_than_s=older_than_s,
        max_bytes=max_bytes,
        namespace=namespace,
        dry_run=is_dry_run,
        keep_namespaces=keep,
    )
    if as_json:
        doc = {
            "store_dir": str(view.root),
            "dry_run": is_dry_run,
            "freed_bytes": report.freed_bytes,
            "kept_pinned": report.kept_pinned,
            "bytes_before": report.bytes_before,
            "bytes_after": report.bytes_after,
            "removed": [r.__dict__ for r in report.removed],
        }
        click.echo(json.dumps(doc, indent=2))
        return
    entries = report.count("all", "older-than", "budget")
    verb = "Would remove" if is_dry_run else "Removed"
    line = (
        f"{verb} {entries} {_plural(entries, 'entry', 'entries')} "
        f"({size(report.freed_bytes)}), {report.count('stale-pin')} stale "
        f"{_plural(report.count('stale-pin'), 'pin', 'pins')}, "
        f"{report.count('orphan-tmp')} orphaned tmp "
        f"{_plural(report.count('orphan-tmp'), 'file', 'files')} from {view.root}"
    )
    if report.kept_pinned:
        line += f"; kept {report.kept_pinned} being loaded"
    app.out.print(Text(line))


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many
