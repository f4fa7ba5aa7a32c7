"""A second proxy before a running topology's engines, with other proxy settings.

Proxy settings such as `proxy.overlap` change the proxy alone (its argv), not the engines:
the planned proxy command with those flags added, on a port of its own, is that topology
with those settings, and costs no second start of the engines.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.e2e.topology_run import TopologyRun, wait_for
from tests.vllm_harness import free_port


@contextmanager
def second_proxy(run: TopologyRun, flags: Sequence[str]) -> Iterator[str]:
    """The run's proxy as planned, plus `flags`, on a free port; its URL. Its log is
    logs/second-proxy.log in the run's state dir."""
    from epdctl.launch.processes import probe

    spec = run.state().proxy.spec()
    port = free_port()
    argv = [*spec.argv, *flags, "--port", str(port)]  # argparse: the last --port wins
    with open(run.run_dir / "logs" / "second-proxy.log", "ab") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **spec.env}, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: proc.poll() is None and probe(f"{url}/health") == 200, 60), (
            run.run_dir / "logs" / "second-proxy.log").read_text()
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
