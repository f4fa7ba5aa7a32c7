"""The time a log line carries: vLLM's `INFO 12-01 08:26:02 [file.py:12]`, logging's
`%(asctime)s` (the proxy's), ISO 8601, and epdctl's own `--- epdctl start <iso>` header."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

HEADER = "--- epdctl start "
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's format is `[PREFIX](Process pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg`: no year,
# local time. The level, the time and the `[` together keep message text from matching.
VLLM = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)"
                  r"(?:[.,](\d{1,6}))? \[")
VLLM_SPAN = 200
"""How far into a line vLLM's time may start (after VLLM_LOGGING_PREFIX and the process)."""
ASCTIME = re.compile(r"\[?(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,6}))?"
                   r"(Z|[+-]\d\d:?\d\d)?\b")
# A vLLM time (no year) is taken in the year that puts it at most this far after the
# reference (the file's last write): a log is never written in the future.
FUTURE_SLACK = timedelta(days=1)


def own_time(text: str, reference: float) -> float | None:
    """The epoch time a line carries, or None; `reference` (epoch) gives vLLM's its year."""
    if "\x1b" in text:
        text = ANSI.sub("", text)
    if text.startswith(HEADER):
        stamp = text[len(HEADER):].split(" ", 1)[0]
        try:
            return datetime.fromisoformat(stamp).timestamp()
        except ValueError:
            return None
    match = ASCTIME.match(text)
    if match:
        return _full(match)
    match = VLLM.search(text, 0, VLLM_SPAN)
    if match:
        return _yearless(match, reference)
    return None


def _fraction(digits: str | None) -> int:
    return int((digits or "0").ljust(6, "0")) if digits else 0


def _full(match: re.Match[str]) -> float | None:
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        moment = datetime(year, month, day, hour, minute, second, _fraction(match[7]))
        zone = match[8]
        if zone:
            zone = "+00:00" if zone == "Z" else zone if ":" in zone else f"{zone[:3]}:{zone[3:]}"
            return datetime.fromisoformat(f"{moment.isoformat()}{zone}").timestamp()
        return moment.timestamp()  # naive: local time, as logging writes it
    except ValueError:
        return None


def _yearless(match: re.Match[str], reference: float) -> float | None:
    month, day, hour, minute, second = (int(g) for g in match.groups()[:5])
    limit = datetime.fromtimestamp(reference) + FUTURE_SLACK
    for year in (limit.year, limit.year - 1):
        try:
            moment = datetime(year, month, day, hour, minute, second, _fraction(match[6]))
        except ValueError:
            continue  # 02-29 outside a leap year
        if moment <= limit:
            return moment.timestamp()
    return None
