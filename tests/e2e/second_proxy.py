"""A second proxy before a running topology's engines, with other proxy settings.

Proxy settings such as `proxy.overlap` change the proxy alone (its argv), not the engines:
the planned proxy command with those flags added, on a port of its own, is that topology
with those settings, and costs no second start of the engines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.harness import (
    TopologyRun,
    free_port,
    start_process,
    stop_servers,
    wait_all_ready,
    with_port,
)

READY_TIMEOUT_S = 60


@contextmanager
def second_proxy(run: TopologyRun, flags: Sequence[str]) -> Iterator[str]:
    """The run's proxy as planned, plus `flags`, on a free port; its URL. Its log is
    logs/second-proxy.log in the run's state dir."""
    spec = run.state().proxy.spec()
    spec = with_port(spec, "second-proxy", free_port(), run.run_dir / "logs" / "second-proxy.log",
                     flags)
    proxy = start_process(spec, run.run_dir)  # marked: a `down --force` of the run stops it
    try:
        wait_all_ready([proxy], READY_TIMEOUT_S)
        yield proxy.url
    finally:
        stop_servers([proxy])
