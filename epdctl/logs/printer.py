"""How `epdctl logs` writes lines: honcho's `12:03:04 pd-0 | line`, or one JSON object each."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TextIO

from epdctl.logs.lines import Line

# ANSI colours by position in the topology, so an instance keeps its colour across runs.
COLOURS = ("36", "33", "32", "35", "34", "31", "96", "93", "92", "95", "94", "91")
NO_TIME = "--:--:--"


@dataclass
class Printer:
    """Formats and writes prefixed lines; names are padded to the longest one shown.

    The bar is `~` where the line carries no time and none was noted when it was written:
    the time shown is then the last known one before it.
    """

    names: Sequence[str]
    """Every instance in topology order: position picks the colour."""
    out: TextIO
    is_colour: bool = False
    shown: Sequence[str] = ()
    """The names actually printed (default: all); they set the width."""
    width: int = field(init=False)

    def __post_init__(self) -> None:
        self.width = max((len(n) for n in (self.shown or self.names)), default=0)

    def format(self, line: Line) -> str:
        clock = NO_TIME if line.time is None else f"{datetime.fromtimestamp(line.time):%H:%M:%S}"
        bar = "~" if line.source == "inherited" else "|"
        prefix = f"{clock} {line.instance.ljust(self.width)} {bar}"
        if self.is_colour:
            names = list(self.names)
            index = names.index(line.instance) if line.instance in names else 0
            prefix = f"\x1b[{COLOURS[index % len(COLOURS)]}m{prefix}\x1b[0m"
        return f"{prefix} {line.text}"

    def write(self, line: Line) -> None:
        self.out.write(self.format(line) + "\n")
        self.out.flush()


@dataclass
class JsonPrinter:
    """One object per line: time (ISO 8601, local offset), instance, text, time_source."""

    out: TextIO

    def write(self, line: Line) -> None:
        self.out.write(json.dumps(as_json(line)) + "\n")
        self.out.flush()


def as_json(line: Line) -> dict[str, str | None]:
    moment = None
    if line.time is not None:
        moment = datetime.fromtimestamp(line.time).astimezone().isoformat(
            timespec="milliseconds")
    return {"time": moment, "instance": line.instance, "text": line.text,
            "time_source": line.source}


def wants_colour(stream: TextIO, forced: bool | None = None) -> bool:
    """Colour only on a TTY, never with NO_COLOR set; --color/--no-color decide first."""
    if forced is not None:
        return forced
    return "NO_COLOR" not in os.environ and stream.isatty()
