"""The one harness for tests that start real servers: topologies through epdctl's run API
(the code `epdctl up -d` and `down` run), engines outside a topology through epdctl's
launcher, free ports, and the checks and clients the tests use on them.

A module shares one running topology among its tests (a module-scoped fixture):

    @pytest.fixture(scope="module")
    def demo(tiny_llava, tmp_path_factory):
        tmp = tmp_path_factory.mktemp("cpu-demo")
        path, cache_dir = write_topology("cpu-demo", tmp, tiny_llava)
        with topology_up(path, cache_dir, tmp / "state") as run:   # ready, or StartupError
            yield run                                               # run.proxy_url, run.state()

On the way out everything it started is stopped by process group (recorded, then anything
still marked for its run dir), and its store root, /dev/shm files, IPC directories and
leftover semaphores are removed. `start_engine` / `wait_all_ready` / `stop_servers` do the
same for a bare `vllm serve` (tests/baselines.py, tests/connector/epd.py).
"""

from __future__ import annotations

from tests.harness.checks import (
    cache_entry,
    check_all_ready,
    check_down,
    check_logs,
    check_verify,
    encoder_posts,
    leftovers,
    proxy_counters,
    shm_files,
    store_counters,
    store_files,
)
from tests.harness.client import chat, chat_completion, chat_messages, image_data_url, make_image
from tests.harness.engine import (
    CPU_ARGS,
    CPU_ENV,
    Server,
    ServerStartError,
    is_running,
    process_up,
    proxy_spec,
    start_engine,
    start_process,
    stop_servers,
    wait_all_ready,
    with_port,
)
from tests.harness.ports import free_port, free_ports
from tests.harness.topology import (
    READY_TIMEOUT_S,
    REPO,
    TOPOLOGIES,
    TopologyRun,
    cli_env,
    copy_topology,
    edit_topology,
    edited_topology,
    release_new_semaphores,
    start_topology,
    stop_marked,
    stop_topology,
    store_root,
    topology_up,
    topology_with_baseline,
    write_topology,
)
from tests.waits import wait_for

__all__ = [
    "CPU_ARGS", "CPU_ENV", "READY_TIMEOUT_S", "REPO", "Server", "ServerStartError", "TOPOLOGIES",
    "TopologyRun", "cache_entry", "chat", "chat_completion", "chat_messages", "check_all_ready",
    "check_down", "check_logs", "check_verify", "cli_env", "copy_topology", "edit_topology",
    "edited_topology", "encoder_posts", "free_port", "free_ports", "image_data_url", "is_running",
    "leftovers", "make_image", "process_up", "proxy_counters", "proxy_spec",
    "release_new_semaphores", "shm_files", "start_engine", "start_process", "start_topology",
    "stop_marked", "stop_servers", "stop_topology", "store_counters", "store_files", "store_root",
    "topology_up", "topology_with_baseline", "wait_all_ready", "wait_for", "with_port",
    "write_topology",
]
