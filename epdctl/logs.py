"""Instance logs multiplexed at read time, honcho style: `12:03:04 pd-0 | line`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TextIO

from epdctl.launcher import tail

POLL_S = 0.2
# ANSI colours by position in the topology, so an instance keeps its colour across runs.
COLOURS = ("36", "33", "32", "35", "34", "31", "96", "93", "92", "95", "94", "91")


@dataclass
class Printer:
    """Formats and writes prefixed lines; names are padded to the longest one shown."""

    names: Sequence[str]
    """Every instance in topology order: position picks the colour."""
    out: TextIO
    is_colour: bool = False
    clock: Callable[[], datetime] = datetime.now
    shown: Sequence[str] = ()
    """The names actually printed (default: all); they set the width."""
    width: int = field(init=False)

    def __post_init__(self) -> None:
        self.width = max((len(n) for n in (self.shown or self.names)), default=0)

    def format(self, name: str, line: str) -> str:
        prefix = f"{self.clock():%H:%M:%S} {name.ljust(self.width)} |"
        if self.is_colour:
            index = list(self.names).index(name) if name in self.names else 0
            prefix = f"\x1b[{COLOURS[index % len(COLOURS)]}m{prefix}\x1b[0m"
        return f"{prefix} {line}"

    def write(self, name: str, line: str) -> None:
        self.out.write(self.format(name, line.rstrip("\r\n")) + "\n")
        self.out.flush()


def wants_colour(stream: TextIO, forced: bool | None = None) -> bool:
    """Colour only on a TTY, never with NO_COLOR set; --color/--no-color decide first."""
    if forced is not None:
        return forced
    return "NO_COLOR" not in os.environ and stream.isatty()


class Reader:
    """Reads complete new lines of one file; survives truncation and re-creation."""

    def __init__(self, name: str, path: Path, *, from_end: bool) -> None:
        self.name, self.path = name, path
        self.pos, self.inode, self.partial = 0, None, b""
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
        return [line.decode("utf-8", "replace") for line in lines]


def show(printer: Printer, files: Sequence[tuple[str, Path]], n: int) -> None:
    """The last n lines of each file, instance by instance."""
    for name, path in files:
        for line in tail(path, n) if n > 0 else []:
            printer.write(name, line)


def follow(
    printer: Printer,
    files: Sequence[tuple[str, Path]],
    *,
    sleep: Callable[[float], None] = time.sleep,
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Print lines as they are appended, polling every POLL_S, until should_stop()."""
    readers = [Reader(name, path, from_end=True) for name, path in files]
    while not should_stop():
        for reader in readers:
            for line in reader.read():
                printer.write(reader.name, line)
        sleep(POLL_S)
