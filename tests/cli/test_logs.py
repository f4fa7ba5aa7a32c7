from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(60)


def test_logs_of_a_stopped_topology(epdctl, fake_topology, state_root) -> None:
    assert epdctl("up", str(fake_topology()), "-d", "--timeout", "20").exit_code == 0
    assert epdctl("down").exit_code == 0
    result = epdctl("logs", "-n", "1", "pd-0", "proxy")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\d\d:\d\d:\d\d pd-0  \| .+", lines[0])
    assert re.fullmatch(r"\d\d:\d\d:\d\d proxy \| .+", lines[1])
    assert "\x1b[" not in result.stdout  # NO_COLOR and not a TTY

    everything = epdctl("logs", "-n", "2")
    names = [line.split()[1] for line in everything.stdout.splitlines()]
    assert names == ["encode-0"] * 2 + ["pd-0"] * 2 + ["proxy"] * 2  # supervisor.log is empty
    header = epdctl("logs", "-n", "1000", "encode-0").stdout.splitlines()[0]
    assert re.fullmatch(r"\S+ encode-0 \| --- epdctl start \S+ .*fake_server\.py .*", header)


def test_unknown_instance(epdctl, fake_topology, state_root) -> None:
    assert epdctl("up", str(fake_topology()), "-d", "--timeout", "20").exit_code == 0
    result = epdctl("logs", "nope")
    assert result.exit_code == 1
    assert result.stderr == ("Error: no instance `nope` in fake "
                             "(instances: encode-0, pd-0, proxy, supervisor)\n")
    assert epdctl("down").exit_code == 0
