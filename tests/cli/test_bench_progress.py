"""How `epdctl bench` shows its progress ticks: a status line on a terminal, else a line
every TICK_EVERY_S seconds (on a fake clock)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from epdctl.cli._app import App
from epdctl.cli._bench_render import TICK_EVERY_S, BenchProgress


def bench_progress(monkeypatch: pytest.MonkeyPatch, *, interactive: bool
                   ) -> tuple[BenchProgress, io.StringIO, list[float]]:
    from epdctl.cli import _bench_render

    now = [1000.0]
    monkeypatch.setattr(_bench_render, "time", SimpleNamespace(monotonic=lambda: now[0]))
    app = App(state_root=Path("unused"))
    err = io.StringIO()
    app.err = Console(file=err, force_terminal=interactive, force_interactive=interactive,
                      width=120)
    return BenchProgress(app), err, now


def test_without_a_terminal_a_tick_is_printed_every_thirty_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    progress, err, now = bench_progress(monkeypatch, interactive=False)
    for moment, text in [(0.0, "a 0s"), (10.0, "a 10s"), (TICK_EVERY_S - 0.1, "a 29s"),
                         (TICK_EVERY_S, "a 30s"), (TICK_EVERY_S + 1, "a 31s"),
                         (2 * TICK_EVERY_S, "a 1m00s")]:
        now[0] = 1000.0 + moment
        progress.tick(text)
    assert err.getvalue() == "a 0s\na 30s\na 1m00s\n"


def test_on_a_terminal_the_status_line_shows_the_latest_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    progress, _, _ = bench_progress(monkeypatch, interactive=True)
    try:
        progress.tick("  epd: load point 1/2 (1 req/s): 1s / ~10s")
        progress.tick("  epd: load point 1/2 (1 req/s): 2s / ~10s")
        assert progress.status is not None
        assert str(progress.status.renderable.text) == (  # type: ignore[attr-defined]
            "  epd: load point 1/2 (1 req/s): 2s / ~10s")
        progress.line("  epd: load point 1/2 (1 req/s): done in 3s")
        assert progress.status is None  # a line ends the status line
    finally:
        progress.close()
