"""Instance logs with true times, merged across instances: `12:03:04 pd-0 | line`.

A line's time is its own where it carries one (vLLM's, the proxy's), else when it was written
(noted by the supervisor, see stamps.py, or read by `-f`), else the last known time before
it. History of several instances is merged in time order, each file keeping its own order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from epdctl.logs.follow import POLL_S, Reader, Writer, follow
from epdctl.logs.lines import Line, Match, history, is_probe, matcher, merged
from epdctl.logs.printer import JsonPrinter, Printer, wants_colour

__all__ = [
    "POLL_S", "JsonPrinter", "Line", "Match", "Printer", "Reader", "Writer", "follow", "history",
    "is_probe", "matcher", "merged", "show", "wants_colour",
]


def show(printer: Writer, files: Sequence[tuple[str, Path]], n: int | None,
         match: Match = lambda line: True, since: float | None = None) -> None:
    """The last n matching lines of each file (None: all), merged in time order."""
    per_file = [history(name, path, n, match, since) for name, path in files]
    for line in merged(per_file):
        printer.write(line)
