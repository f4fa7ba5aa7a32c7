"""What another user of this machine can do to a running topology, read from its state:
whether every engine requires the run's key, where the EC store is and whether it is
private, and who may use the proxy. `status` and `doctor` say it in one line."""

from __future__ import annotations

from typing import Any

from epdctl.cache.store_root import store_safety
from epdctl.launch.state import RunState

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def run_safety(state: RunState) -> dict[str, Any]:
    """The facts, for `status --json`."""
    engines = state.engines
    store = store_safety(state)
    return {
        "engines_keyed": bool(engines) and all(s.is_key_required for s in engines),
        "store_dir": str(store.namespace_dir) if store.is_used else None,
        "store_private": store.is_private if store.is_used else None,
        "store_problem": store.problem if store.is_used else None,
        "store_is_fresh_root": store.is_fresh if store.is_used else None,
        "proxy_keyed": state.proxy_api_key is not None,
        "proxy_host": state.proxy.host,
    }


def safety_line(facts: dict[str, Any]) -> str:
    """`safety: engines keyed; store private at DIR; proxy keyed`, or what is not so."""
    parts = ["engines keyed" if facts["engines_keyed"] else
             "ENGINES OPEN: any local user can send them requests"]
    if facts["store_dir"] is not None:
        fresh = " (a fresh root: the default was taken)" if facts["store_is_fresh_root"] else ""
        parts.append(f"store private at {facts['store_dir']}{fresh}" if facts["store_private"]
                     else f"STORE NOT PRIVATE: {facts['store_problem']}")
    where = ("local users" if facts["proxy_host"] in _LOOPBACK
             else f"anyone who reaches {facts['proxy_host']}")
    parts.append("proxy keyed" if facts["proxy_keyed"] else
                 f"proxy open to {where} (no proxy.api_key)")
    return "safety: " + "; ".join(parts)
