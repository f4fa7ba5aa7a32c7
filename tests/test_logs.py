from __future__ import annotations

import io
from datetime import datetime
from pathlib import Path

import pytest

from epdctl.logs import Printer, Reader, follow, show, wants_colour

NAMES = ["encode-0", "pd-0", "proxy"]


def fixed() -> datetime:
    return datetime(2025, 1, 2, 12, 3, 4)


def test_prefix_is_time_and_name_padded_to_the_longest() -> None:
    out = io.StringIO()
    printer = Printer(NAMES, out, clock=fixed)
    printer.write("pd-0", "INFO hello\n")
    printer.write("encode-0", "  indented line")
    assert out.getvalue() == (
        "12:03:04 pd-0     | INFO hello\n"
        "12:03:04 encode-0 |   indented line\n"
    )


def test_width_follows_the_names_shown() -> None:
    printer = Printer(NAMES, io.StringIO(), clock=fixed, shown=["pd-0", "proxy"])
    assert printer.format("pd-0", "x") == "12:03:04 pd-0  | x"


def test_colour_comes_from_the_position_in_the_topology() -> None:
    printer = Printer(NAMES, io.StringIO(), is_colour=True, clock=fixed, shown=["proxy"])
    assert printer.format("proxy", "x") == "\x1b[32m12:03:04 proxy |\x1b[0m x"
    assert printer.format("encode-0", "x").startswith("\x1b[36m")
    assert printer.format("pd-0", "x").startswith("\x1b[33m")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_tty_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert wants_colour(Tty()) is True
    assert wants_colour(io.StringIO()) is False
    assert wants_colour(io.StringIO(), forced=True) is True
    monkeypatch.setenv("NO_COLOR", "1")
    assert wants_colour(Tty()) is False
    assert wants_colour(Tty(), forced=True) is True


def test_show_prints_the_last_lines_instance_by_instance(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("1\n2\n3\n")
    (tmp_path / "b.log").write_text("x\n")
    out = io.StringIO()
    show(Printer(["a", "b"], out, clock=fixed), [("a", tmp_path / "a.log"),
                                                  ("b", tmp_path / "b.log"),
                                                  ("c", tmp_path / "missing.log")], 2)
    assert out.getvalue() == "12:03:04 a | 2\n12:03:04 a | 3\n12:03:04 b | x\n"


def test_reader_waits_for_whole_lines_and_survives_truncation(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text("old\n")
    reader = Reader("a", path, from_end=True)
    assert reader.read() == []
    with open(path, "a") as f:
        f.write("new li")
    assert reader.read() == []
    with open(path, "a") as f:
        f.write("ne\nnext\n")
    assert reader.read() == ["new line", "next"]
    path.write_text("again\n")  # truncated and rewritten
    assert reader.read() == ["again"]


def test_follow_polls_until_told_to_stop(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text("before\n")
    out = io.StringIO()
    ticks: list[float] = []

    def sleep(seconds: float) -> None:
        ticks.append(seconds)
        if len(ticks) == 1:
            with open(path, "a") as f:
                f.write("after\n")

    follow(Printer(["a"], out, clock=fixed), [("a", path)], sleep=sleep,
           should_stop=lambda: len(ticks) >= 3)
    assert out.getvalue() == "12:03:04 a | after\n"
    assert ticks == [0.2, 0.2, 0.2]
