"""Log lines with their times: read from a file (history) and put in time order."""

from __future__ import annotations

import heapq
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from epdctl.launch.spec import PROBE_PATHS
from epdctl.logs.stamps import Stamps
from epdctl.logs.times import own_time

TimeSource = Literal["own", "written", "inherited", "unknown"]
"""own: the line's own time; written: when it was written (the supervisor's note, or when
`-f` read it); inherited: the last known time before it (a lower bound); unknown: none."""
FIRST_WINDOW_BYTES = 64 * 1024
# uvicorn's access line for a probe: `INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 200 OK`.
_PATHS = "|".join(re.escape(p) for p in PROBE_PATHS)
PROBE = re.compile(rf'"(?:GET|HEAD) (?:{_PATHS})(?:\?\S*)? HTTP/[\d.]+"')


@dataclass(frozen=True)
class Line:
    """One line of one instance's log, and when it happened."""

    instance: str
    text: str
    time: float | None
    source: TimeSource
    order: float = 0.0
    """Sort key: the largest time so far in its file, so merging keeps each file's order."""


Match = Callable[[Line], bool]


def is_probe(text: str) -> bool:
    """An access-log line of a health or metrics probe (the noise `logs` hides)."""
    return "HTTP/" in text and PROBE.search(text) is not None


def matcher(*, show_probes: bool = False, pattern: re.Pattern[str] | None = None,
            since: float | None = None) -> Match:
    """The filter of `logs --all/--grep/--since` as one predicate."""

    def match(line: Line) -> bool:
        if since is not None and line.order < since:
            return False
        if not show_probes and is_probe(line.text):
            return False
        return pattern is None or pattern.search(line.text) is not None

    return match


def timed(instance: str, rows: Iterable[tuple[str, int]], stamps: Stamps,
          reference: float) -> Iterator[Line]:
    """(text, end offset) rows of one file as Lines: own time, else written, else inherited."""
    last: float | None = None
    order = float("-inf")
    for text, end in rows:
        at = own_time(text, reference)
        source: TimeSource = "own"
        if at is None:
            at, source = stamps.written_at(end, last), "written"
        if at is None:
            at, source = last, "inherited" if last is not None else "unknown"
        else:
            last = at
        order = max(order, at) if at is not None else order
        yield Line(instance, text, at, source, order)


def read_from(instance: str, path: Path, start: int) -> list[Line]:
    """Every whole line from byte `start` (a partial first line is skipped) to the end."""
    try:
        with open(path, "rb") as f:
            reference = os.fstat(f.fileno()).st_mtime
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    offset = start
    if start > 0:
        cut = data.find(b"\n") + 1
        data, offset = data[cut:], start + cut
    rows = []
    for raw in data.splitlines(keepends=True):
        offset += len(raw)
        if raw.endswith(b"\n"):
            rows.append((raw.rstrip(b"\r\n").decode("utf-8", "replace"), offset))
    return list(timed(instance, rows, Stamps.load(path), reference))


def history(instance: str, path: Path, n: int | None, match: Match,
            since: float | None = None) -> list[Line]:
    """The last n matching lines (None: all) of a file, reading back only as far as needed."""
    try:
        size = path.stat().st_size
    except OSError:
        return []
    window = FIRST_WINDOW_BYTES
    while True:
        start = max(0, size - window)
        lines = read_from(instance, path, start)
        kept = [line for line in lines if match(line)]
        if n is not None:
            kept = kept[-n:] if n else []
        if start == 0 or _is_enough(lines, kept, n, since):
            return kept
        window *= 4


def _is_enough(lines: list[Line], kept: list[Line], n: int | None, since: float | None) -> bool:
    """Whether reading further back could not change the answer."""
    if since is not None:
        first = next((line.time for line in lines if line.time is not None), None)
        return first is not None and first < since  # what comes before is older still
    if n is None or len(kept) < n:
        return False
    # The window's first lines know no time before them; the kept ones must not need one.
    return not kept or kept[0].source != "unknown"


def merged(per_instance: Sequence[Sequence[Line]]) -> Iterator[Line]:
    """Lines of several instances in time order, each instance's lines in file order."""
    return heapq.merge(*per_instance, key=lambda line: line.order)
