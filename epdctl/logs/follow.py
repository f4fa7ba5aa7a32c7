"""`logs -f`: lines as they are appended to several logs, timed when they are read."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from epdctl.logs.lines import Line, Match, merged
from epdctl.logs.times import own_time

POLL_S = 0.2


class Writer(Protocol):
    def write(self, line: Line) -> None: ...


class Reader:
    """Reads complete new lines of one file; survives truncation and re-creation."""

    def __init__(self, name: str, path: Path, *, from_end: bool) -> None:
        self.name, self.path = name, path
        self.pos, self.inode, self.partial = 0, None, b""
        self.order = float("-inf")
        if from_end:
            try:
                st = path.stat()
                self.pos, self.inode = st.st_size, st.st_ino
            except OSError:
                pass

    def read(self) -> list[str]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        if st.st_ino != self.inode or st.st_size < self.pos:
            self.pos, self.inode, self.partial = 0, st.st_ino, b""  # new or truncated file
        if st.st_size == self.pos:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = self.partial + f.read()
            self.pos = f.tell()
        *lines, self.partial = data.split(b"\n")
        return [line.rstrip(b"\r").decode("utf-8", "replace") for line in lines]

    def lines(self, now: float) -> list[Line]:
        """New lines with their own time, else the time they were read (within POLL_S)."""
        result = []
        for text in self.read():
            own = own_time(text, now)
            at = now if own is None else own
            self.order = max(self.order, at)
            result.append(Line(self.name, text, at, "written" if own is None else "own",
                               self.order))
        return result


def follow(
    printer: Writer,
    files: Sequence[tuple[str, Path]],
    match: Match = lambda line: True,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Print matching lines as they are appended, polling every POLL_S, until should_stop()."""
    readers = [Reader(name, path, from_end=True) for name, path in files]
    while not should_stop():
        now = clock()
        for line in merged([reader.lines(now) for reader in readers]):
            if match(line):
                printer.write(line)
        sleep(POLL_S)
