"""The request-line writer batches lines in the logging module's format."""

from __future__ import annotations

import asyncio
import io
import re

import pytest

from epdctl.proxy.server.logline import FLUSH_S, LineWriter

pytestmark = pytest.mark.anyio


async def test_lines_are_batched_and_formatted_like_logging():
    stream = io.StringIO()
    write = LineWriter(stream)
    write("rid=a status=200")
    write("rid=b status=500")
    assert stream.getvalue() == ""  # not yet: one write per batch
    await asyncio.sleep(FLUSH_S * 2)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    pattern = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO epdctl\.proxy: rid=a status=200"
    assert re.fullmatch(pattern, lines[0])
    write("rid=c")
    write.flush()
    assert stream.getvalue().endswith("epdctl.proxy: rid=c\n")
