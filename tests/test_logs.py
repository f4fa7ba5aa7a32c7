from __future__ import annotations

import io
import os
import re
from datetime import datetime
from pathlib import Path

import pytest

from epdctl.logs import Line, Printer, Reader, follow, history, matcher, merged, show, wants_colour
from epdctl.logs.lines import is_probe, read_from, timed
from epdctl.logs.printer import as_json
from epdctl.logs.stamps import STAMP_INTERVAL_S, Stamper, Stamps, stamps_path
from epdctl.logs.times import own_time

NAMES = ["encode-0", "pd-0", "proxy"]
T = datetime(2025, 1, 2, 12, 3, 4).timestamp()


def at(text: str) -> float:
    """Local time `YYYY-MM-DD HH:MM:SS[.ffffff]` as epoch seconds."""
    return datetime.fromisoformat(text).timestamp()


def line(name: str, text: str, when: float | None = T, source: str = "own") -> Line:
    return Line(name, text, when, source, when if when is not None else float("-inf"))


def test_prefix_is_time_and_name_padded_to_the_longest() -> None:
    out = io.StringIO()
    printer = Printer(NAMES, out)
    printer.write(line("pd-0", "INFO hello"))
    printer.write(line("encode-0", "  indented line"))
    assert out.getvalue() == (
        "12:03:04 pd-0     | INFO hello\n"
        "12:03:04 encode-0 |   indented line\n"
    )


def test_an_inherited_time_is_marked_and_an_unknown_one_shown_as_such() -> None:
    printer = Printer(NAMES, io.StringIO(), shown=["pd-0"])
    assert printer.format(line("pd-0", "x", source="inherited")) == "12:03:04 pd-0 ~ x"
    assert printer.format(line("pd-0", "x", None, "unknown")) == "--:--:-- pd-0 | x"


def test_width_follows_the_names_shown() -> None:
    printer = Printer(NAMES, io.StringIO(), shown=["pd-0", "proxy"])
    assert printer.format(line("pd-0", "x")) == "12:03:04 pd-0  | x"


def test_colour_comes_from_the_position_in_the_topology() -> None:
    printer = Printer(NAMES, io.StringIO(), is_colour=True, shown=["proxy"])
    assert printer.format(line("proxy", "x")) == "\x1b[32m12:03:04 proxy |\x1b[0m x"
    assert printer.format(line("encode-0", "x")).startswith("\x1b[36m")
    assert printer.format(line("pd-0", "x")).startswith("\x1b[33m")


def test_json_is_one_object_with_a_full_time() -> None:
    doc = as_json(line("pd-0", "hello", at("2025-01-02 12:03:04.250")))
    assert doc == {"time": datetime.fromtimestamp(at("2025-01-02 12:03:04.250")).astimezone()
                   .isoformat(timespec="milliseconds"), "instance": "pd-0", "text": "hello",
                   "time_source": "own"}
    assert doc["time"].startswith("2025-01-02T12:03:04.250")
    assert as_json(line("pd-0", "x", None, "unknown"))["time"] is None


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


@pytest.mark.parametrize(("text", "expected"), [
    ("(APIServer pid=28016) INFO 01-02 12:03:04 [api_utils.py:347] version 0.32.0",
     "2025-01-02 12:03:04"),
    ("(EngineCore pid=7) DEBUG 01-02 12:03:05 [v1/core/sched/scheduler.py:12] x",
     "2025-01-02 12:03:05"),
    ("myprefix (Worker pid=9) WARNING 01-02 12:03:06 [ec.py:136] EC store: could not save",
     "2025-01-02 12:03:06"),
    ("\x1b[32mINFO\x1b[0m 01-02 12:03:07 [launcher.py:195] Route: /health",
     "2025-01-02 12:03:07"),
    ("2025-01-02 12:03:08,018 INFO epdctl.proxy: rid=a route=/v1/chat/completions",
     "2025-01-02 12:03:08.018"),
    ("2025-01-02T12:03:09.5 something", "2025-01-02 12:03:09.5"),
])
def test_own_times_of_vllm_logging_and_iso_lines(text: str, expected: str) -> None:
    assert own_time(text, at("2025-01-02 13:00:00")) == pytest.approx(at(expected))


def test_own_times_with_a_zone_and_epdctl_s_header() -> None:
    header = "--- epdctl start 2025-01-02T12:03:04+00:00 /py -m epdctl.proxy --port 1"
    assert own_time(header, 0) == datetime.fromisoformat("2025-01-02T12:03:04+00:00").timestamp()
    assert own_time("2025-01-02 12:03:04Z x", 0) == own_time(header, 0)
    assert own_time("2025-01-02 14:03:04+0200 x", 0) == own_time(header, 0)


@pytest.mark.parametrize("text", [
    'INFO:     127.0.0.1:55632 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    "Traceback (most recent call last):",
    "  File \"x.py\", line 3, in <module>",
    "the prompt said INFO 01-02 12:03:04 without a bracket",
    "nanobind: leaked 64 types!",
    "",
])
def test_lines_without_a_time(text: str) -> None:
    assert own_time(text, T) is None


def test_a_vllm_time_takes_the_year_that_is_not_in_the_future() -> None:
    new_year = at("2026-01-01 00:10:00")
    assert own_time("INFO 12-31 23:59:59 [a.py:1] x", new_year) == at("2025-12-31 23:59:59")
    assert own_time("INFO 01-01 00:09:00 [a.py:1] x", new_year) == at("2026-01-01 00:09:00")
    assert own_time("INFO 02-29 10:00:00 [a.py:1] x", at("2025-03-01 00:00:00")) == at(
        "2024-02-29 10:00:00")


def test_lines_without_a_time_are_timed_when_written_else_inherit_the_last_known() -> None:
    stamps = Stamps([30, 90], [at("2025-01-02 12:00:05"), at("2025-01-02 12:00:09")])
    rows = [("no time yet", 10), ("INFO 01-02 12:00:01 [a.py:1] own", 20),
            ('INFO:     1.2.3.4:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK', 30),
            ("INFO 01-02 12:00:02 [a.py:1] own again", 60), ("written later", 90),
            ("after the last note", 95)]
    got = list(timed("pd-0", rows, stamps, at("2025-01-02 13:00:00")))
    assert [(g.source, g.time) for g in got] == [
        ("written", at("2025-01-02 12:00:05")),  # the first note covers its bytes
        ("own", at("2025-01-02 12:00:01")),
        # Noted at :05, so written at most SLACK_S (1.5 s) before, and after the line before.
        ("written", at("2025-01-02 12:00:03.5")),
        ("own", at("2025-01-02 12:00:02")),
        ("written", at("2025-01-02 12:00:07.5")),
        ("inherited", at("2025-01-02 12:00:07.5")),
    ]
    # The sort key never goes back, so merging keeps the file's own order.
    assert [g.order for g in got] == sorted(g.order for g in got)
    bare = list(timed("pd-0", rows[:2], Stamps([], []), T))
    assert [(g.source, g.time) for g in bare] == [("unknown", None),
                                                  ("own", at("2025-01-02 12:00:01"))]


def test_the_stamper_notes_growth_at_most_once_an_interval(tmp_path: Path) -> None:
    log = tmp_path / "pd-0.log"
    log.write_text("from an earlier run\n")
    now = [100.0]
    stamper = Stamper([log, tmp_path / "missing.log"], clock=lambda: now[0])
    stamper.tick()
    assert not stamps_path(log).exists()  # nothing new: the earlier run's lines are not ours
    with open(log, "a") as f:
        f.write("one\n")
    now[0] += STAMP_INTERVAL_S / 2
    stamper.tick()
    assert not stamps_path(log).exists()  # too soon after the last look
    now[0] += STAMP_INTERVAL_S
    stamper.tick()
    with open(log, "a") as f:
        f.write("two\n")
    stamper.tick(force=True)
    assert stamps_path(log).read_text() == "24 101.500\n28 101.500\n"
    stamps = Stamps.load(log)
    assert (stamps.written_by(24), stamps.written_by(28), stamps.written_by(29)) == (
        101.5, 101.5, None)


def test_a_written_time_lies_between_the_line_before_and_the_note() -> None:
    stamps = Stamps([100], [50.0])
    assert stamps.written_at(100, None) == 50.0
    assert stamps.written_at(100, 49.5) == 49.5  # a busy log: right after the line before
    assert stamps.written_at(100, 10.0) == 48.5  # after a quiet spell: just before the note
    assert stamps.written_at(100, 60.0) == 50.0  # never after the note
    assert stamps.written_at(101, 10.0) is None


def test_stamps_of_a_replaced_log_start_again(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    stamps_path(log).write_text("50 1.0\n90 2.0\n10 3.0\n40 4.0\ntorn")
    stamps = Stamps.load(log)
    assert (stamps.sizes, stamps.times) == ([10, 40], [3.0, 4.0])


def vllm(hms: str, text: str) -> str:
    return f"(APIServer pid=1) INFO 01-02 {hms} [a.py:1] {text}"


def test_history_of_three_instances_is_merged_in_time_order(tmp_path: Path) -> None:
    files = {
        "encode-0": [vllm("12:00:01", "e1"), vllm("12:00:04", "e2"), "e2 traceback line"],
        "pd-0": [vllm("12:00:02", "p1"), vllm("12:00:03", "p2"), vllm("12:00:06", "p3")],
        "proxy": ["2025-01-02 12:00:05,500 INFO epdctl.proxy: rid=x route=/v1/chat/completions"],
    }
    paths = []
    for name, rows in files.items():
        (tmp_path / f"{name}.log").write_text("".join(f"{r}\n" for r in rows))
        os.utime(tmp_path / f"{name}.log", (at("2025-01-02 12:10:00"),) * 2)
        paths.append((name, tmp_path / f"{name}.log"))
    out = io.StringIO()
    show(Printer(NAMES, out), paths, 10)
    assert out.getvalue() == (
        "12:00:01 encode-0 | (APIServer pid=1) INFO 01-02 12:00:01 [a.py:1] e1\n"
        "12:00:02 pd-0     | (APIServer pid=1) INFO 01-02 12:00:02 [a.py:1] p1\n"
        "12:00:03 pd-0     | (APIServer pid=1) INFO 01-02 12:00:03 [a.py:1] p2\n"
        "12:00:04 encode-0 | (APIServer pid=1) INFO 01-02 12:00:04 [a.py:1] e2\n"
        "12:00:04 encode-0 ~ e2 traceback line\n"
        "12:00:05 proxy    | 2025-01-02 12:00:05,500 INFO epdctl.proxy: rid=x route=/v1/chat/"
        "completions\n"
        "12:00:06 pd-0     | (APIServer pid=1) INFO 01-02 12:00:06 [a.py:1] p3\n"
    )
    out = io.StringIO()
    show(Printer(NAMES, out), paths, 1)  # -n counts per instance
    assert [row.split()[1] for row in out.getvalue().splitlines()] == [
        "encode-0", "proxy", "pd-0"]


def test_probe_lines_are_left_out_unless_asked_for(tmp_path: Path) -> None:
    probe = 'INFO:     127.0.0.1:51208 - "GET /health HTTP/1.1" 200 OK'
    rows = [vllm("12:00:01", "start"), probe, 'INFO:     127.0.0.1:1 - "GET /metrics?x=1 '
            'HTTP/1.1" 200 OK', 'INFO:     127.0.0.1:2 - "POST /v1/chat/completions HTTP/1.1" '
            '200 OK', 'INFO:     127.0.0.1:3 - "GET /healthz HTTP/1.1" 404 Not Found']
    log = tmp_path / "pd-0.log"
    log.write_text("".join(f"{r}\n" for r in rows))
    texts = [x.text for x in history("pd-0", log, 10, matcher())]
    assert texts == [rows[0], rows[3], rows[4]]
    assert [x.text for x in history("pd-0", log, 10, matcher(show_probes=True))] == rows
    assert is_probe(probe) and not is_probe("GET /health without quotes")


def test_history_reads_back_only_as_far_as_needed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import epdctl.logs.lines as lines_module

    monkeypatch.setattr(lines_module, "FIRST_WINDOW_BYTES", 256)
    log = tmp_path / "a.log"
    rows = [vllm(f"12:{i // 60:02d}:{i % 60:02d}", f"line {i}") for i in range(600)]
    rows[595] = 'INFO:     127.0.0.1:2 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
    log.write_text("".join(f"{r}\n" for r in rows))
    os.utime(log, (at("2025-01-02 13:00:00"),) * 2)
    calls: list[int] = []
    real = lines_module.read_from
    monkeypatch.setattr(lines_module, "read_from",
                        lambda *a: calls.append(a[2]) or real(*a))  # type: ignore[func-returns-value]
    last = history("a", log, 3, matcher())
    assert [x.text.rsplit(" ", 2)[-2:] for x in last] == [["line", "597"], ["line", "598"],
                                                          ["line", "599"]]
    assert len(calls) == 1
    grep = history("a", log, 2, matcher(pattern=re.compile(r"line 1\d$")))
    assert [x.text[-7:] for x in grep] == ["line 18", "line 19"]
    assert calls[-1] == 0  # the matches are near the start: it read back to it
    since = history("a", log, None, matcher(since=at("2025-01-02 12:09:55")),
                    at("2025-01-02 12:09:55"))
    # 595 carries no time: it inherits 594's (12:09:54), before --since.
    assert [x.text[-8:] for x in since] == ["line 596", "line 597", "line 598", "line 599"]
    assert [x.source for x in read_from("a", log, 0) if x.source != "own"] == ["inherited"]


def test_reader_waits_for_whole_lines_and_survives_truncation(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text("old\n")
    reader = Reader("a", path, from_end=True)
    assert reader.read() == []
    with open(path, "a") as f:
        f.write("new li")
    assert reader.read() == []
    with open(path, "a") as f:
        f.write("ne\nnext\r\n")
    assert reader.read() == ["new line", "next"]
    path.write_text("again\n")  # truncated and rewritten
    assert reader.read() == ["again"]


def test_follow_times_lines_when_read_and_filters_them(tmp_path: Path) -> None:
    path, other = tmp_path / "a.log", tmp_path / "b.log"
    path.write_text("before\n")
    out = io.StringIO()
    ticks: list[float] = []

    def sleep(seconds: float) -> None:
        ticks.append(seconds)
        if len(ticks) == 1:
            with open(path, "a") as f:
                f.write('after\nINFO:     1.2.3.4:5 - "GET /health HTTP/1.1" 200 OK\n')
            other.write_text(vllm("12:03:01", "earlier, by its own time") + "\n")

    follow(Printer(["a", "b"], out), [("a", path), ("b", other)], matcher(), sleep=sleep,
           clock=lambda: T, should_stop=lambda: len(ticks) >= 3)
    assert out.getvalue() == (
        "12:03:01 b | (APIServer pid=1) INFO 01-02 12:03:01 [a.py:1] earlier, by its own time\n"
        "12:03:04 a | after\n"
    )
    assert ticks == [0.2, 0.2, 0.2]


def test_merge_keeps_each_files_order() -> None:
    a = [line("a", "1", T), line("a", "2", T + 5), line("a", "3", T + 5)]
    b = [line("b", "x", T + 1), line("b", "y", T + 6)]
    assert [x.text for x in merged([a, b])] == ["1", "x", "2", "3", "y"]
