"""What another user of this machine can do to a running topology, read from its state:
whether every engine requires the run's key, where the EC store is and whether it is
private, and who may use the proxy. `status` and `doctor` say it in one line."""

from __future__ import annotations

import os
import stat
from typing import Any

from epdctl.state import RunState

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def store_is_private(path: str) -> bool | None:
    """True: a real directory of ours that nobody else can enter or list (mode 0700 or
    tighter), and so is its parent (the store root); None: it does not exist."""
    try:
        sts = [os.lstat(path), os.lstat(os.path.dirname(path))]
    except FileNotFoundError:
        return None
    return all(stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
               and not st.st_mode & 0o077 for st in sts)


def run_safety(state: RunState) -> dict[str, Any]:
    """The facts, for `status --json`."""
    engines = state.engines
    host = state.proxy.host
    return {
        "engines_keyed": bool(engines) and all(s.is_key_required for s in engines),
        "store_dir": state.store_dir if any(s.role == "encode" for s in engines) else None,
        "store_private": (store_is_private(state.store_dir)
                          if any(s.role == "encode" for s in engines) else None),
        "proxy_keyed": state.proxy_api_key is not None,
        "proxy_host": host,
    }


def safety_line(facts: dict[str, Any]) -> str:
    """`safety: engines keyed; store private at DIR; proxy keyed`, or what is not so."""
    parts = ["engines keyed" if facts["engines_keyed"] else
             "ENGINES OPEN: any local user can send them requests"]
    if facts["store_dir"] is not None:
        private = facts["store_private"]
        parts.append(f"store private at {facts['store_dir']}" if private else
                     f"store at {facts['store_dir']} missing" if private is None else
                     f"STORE NOT PRIVATE at {facts['store_dir']}")
    where = ("local users" if facts["proxy_host"] in _LOOPBACK
             else f"anyone who reaches {facts['proxy_host']}")
    parts.append("proxy keyed" if facts["proxy_keyed"] else
                 f"proxy open to {where} (no proxy.api_key)")
    return "safety: " + "; ".join(parts)
