"""The one readiness rule: an instance is ready while its process lives and /health says 200.

The supervisor, `status`, `verify`'s baseline and the run API all ask here.
"""

from __future__ import annotations

import http.client
from typing import Literal
from urllib.parse import urlsplit

HEALTH_TIMEOUT_S = 1.0
STARTUP_TIMEOUT_S = 600.0
"""Seconds every instance gets to become ready (`up --timeout`)."""
READY_STATUS = 200

Readiness = Literal["ready", "starting", "unhealthy", "exited", "stale"]


def probe(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> int | None:
    """HTTP status of GET url, or None when nothing answers."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def is_ready(health_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether the server at health_url answers its health check (the process's liveness is
    the caller's: it knows the pid)."""
    return probe(health_url, timeout_s) == READY_STATUS


def judge(is_alive: bool | None, is_healthy: bool, was_ready: bool) -> Readiness:
    """An instance's state from its process (None: the pid is someone else's now), its health
    check, and whether it was ever ready (a failed probe after that means unhealthy)."""
    if is_alive is None:
        return "stale"
    if not is_alive:
        return "exited"
    if is_healthy:
        return "ready"
    return "unhealthy" if was_ready else "starting"
