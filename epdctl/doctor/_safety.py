"""`doctor`'s `safety` line: what another user of this machine can and cannot do to the run
(engines keyed, where the EC store is and whether it is private, who may use the proxy)."""

from __future__ import annotations

from pathlib import Path

from epdctl.errors import TopologyError
from epdctl.launch.preflight import Check
from epdctl.topology import keys
from epdctl.topology.model import Topology

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def client_access(topology: Topology) -> str:
    """Who may use the proxy, in a few words."""
    proxy = topology.proxy
    where = "local users" if proxy.host in _LOOPBACK else f"anyone who reaches {proxy.host}"
    if proxy.api_key_file is not None:
        return f"proxy keyed (proxy.api_key_file {proxy.api_key_file})"
    if (name := keys.env_name(proxy)) is not None:
        return f"proxy keyed (${name})"
    if proxy.api_key is not None:
        return "proxy keyed (literal proxy.api_key)"
    return f"proxy open to {where} (no proxy.api_key)"


def check_safety(topology: Topology, topology_path: Path | None, store: str) -> Check:
    """One line: the engines' key, the store (`store`: where and whether private, as the
    run will use it), the proxy's key; a warning for a literal key others can read, a
    failure for a key that cannot be read."""
    line = f"engines keyed (a fresh key every run); {store}; {client_access(topology)}"
    try:
        keys.resolve_api_key(topology.proxy)
    except TopologyError as exc:
        return Check("safety", "fail", f"{line}; {exc}",
                     "fix proxy.api_key / api_key_file, then run doctor again")
    literal = keys.literal_key(topology.proxy) is not None
    if literal and topology_path is not None and keys.readable_by_others(topology_path):
        return Check("safety", "warn", f"{line}; proxy.api_key is written in {topology_path}, "
                     "which others can read",
                     f"move the key to a file of mode 0600 (`proxy.api_key_file: PATH`) or "
                     f"the environment (`proxy.api_key: ${{VAR}}`), or `chmod 600 "
                     f"{topology_path}`")
    return Check("safety", "ok", line)
