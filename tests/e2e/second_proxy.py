"""A second proxy before a running topology's engines, with other proxy settings.

Proxy settings such as `proxy.overlap` change the proxy alone (its argv), not the engines:
the planned proxy command with those flags added, on a port of its own, is that topology
with those settings, and costs no second start of the engines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.harness import TopologyRun, free_port, process_up, with_port


@contextmanager
def second_proxy(run: TopologyRun, flags: Sequence[str]) -> Iterator[str]:
    """The run's proxy as planned, plus `flags`, on a free port; its URL. Its log is
    logs/second-proxy.log in the run's state dir."""
    spec = with_port(run.state().proxy.spec(), "second-proxy", free_port(),
                     run.run_dir / "logs" / "second-proxy.log", flags)
    with process_up(spec, run.run_dir) as proxy:  # marked: `down --force` of the run stops it
        yield proxy.url
