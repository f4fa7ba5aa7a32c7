"""When each log line was written, for lines that carry no time of their own.

Engines write their logs straight to the file (the OS does it, so logs outlive epdctl), so
no epdctl code sees a line as it is written. Instead the supervisor notes, at most once per
STAMP_INTERVAL_S, how far each log has grown: `logs/<name>.times` holds `<size> <epoch>`
lines, and a line that ends at byte offset E was written by the first time noted at a size
of at least E (at most one interval and one tick late).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from pathlib import Path

from epdctl.host.private import open_append

STAMP_INTERVAL_S = 1.0
SLACK_S = STAMP_INTERVAL_S + 0.5
"""How long before its note a line may have been written (an interval, a tick, a delay)."""
SUFFIX = ".times"


def stamps_path(log_path: Path) -> Path:
    return log_path.with_suffix(SUFFIX)


class Stamper:
    """Supervisor side: appends `<size> <time>` to a log's .times file when the log grew."""

    def __init__(self, log_paths: Iterable[Path], clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        # What is there already was stamped by an earlier run (or never): start from it.
        self.sizes = {Path(p): _size(Path(p)) for p in log_paths}
        self.noted_at = 0.0

    def tick(self, *, force: bool = False) -> None:
        """Note the logs that grew; cheap enough for every supervisor tick."""
        now = self.clock()
        if not force and now - self.noted_at < STAMP_INTERVAL_S:
            return
        self.noted_at = now
        for path, known in self.sizes.items():
            size = _size(path)
            if size == known:
                continue
            self.sizes[path] = size
            try:
                with open_append(stamps_path(path)) as f:  # 0600, as the log itself
                    f.write(f"{size} {now:.3f}\n".encode())
            except OSError:
                pass  # times are best effort; a log is never lost for them


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


class Stamps:
    """Reader side: the time by which a byte offset of the log had been written."""

    def __init__(self, sizes: list[int], times: list[float]) -> None:
        self.sizes, self.times = sizes, times

    @classmethod
    def load(cls, log_path: Path) -> Stamps:
        sizes: list[int] = []
        times: list[float] = []
        try:
            text = stamps_path(log_path).read_text()
        except OSError:
            return cls([], [])
        for row in text.splitlines():
            try:
                size_text, time_text = row.split()
                size, at = int(size_text), float(time_text)
            except ValueError:
                continue  # a torn last row
            if sizes and size < sizes[-1]:
                sizes, times = [], []  # the log was truncated or replaced: a new file
            sizes.append(size)
            times.append(at)
        return cls(sizes, times)

    def written_by(self, end_offset: int) -> float | None:
        """When the bytes up to end_offset were all in the file (None: not noted)."""
        index = bisect_left(self.sizes, end_offset)
        return self.times[index] if index < len(self.times) else None

    def written_at(self, end_offset: int, after: float | None) -> float | None:
        """When a line ending at end_offset was written, the line before it at `after`.

        The note is at most SLACK_S late, and a line comes after the one before it; a
        busy log's note would otherwise put its untimed lines up to a second late.
        """
        upper = self.written_by(end_offset)
        if upper is None or after is None:
            return upper
        return min(upper, max(after, upper - SLACK_S))
