"""The shared-memory EC store: layout, entries, pins, eviction (stdlib only; no vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

from epdctl.errors import CacheError
from epdctl.host import private

# Written once here; plan.py builds --ec-transfer-config from them and the connector
# registers itself under CONNECTOR_NAME (a name no vLLM built-in uses).
CONNECTOR_NAME = "EpdctlShmECConnector"
CONNECTOR_MODULE = "epdctl.connector"
FORMAT_VERSION = 2
_WHAT = "the EC store"
_ELSEWHERE = "set cache.dir to a directory of your own"


STORE_BASE = "/dev/shm"
"""Where the default store roots live (tests point it elsewhere)."""


def default_store_root(uid: int | None = None) -> str:
    """Where the store lives unless a topology's `cache.dir` says otherwise: tmpfs, one root
    per user (a shared one would be whoever made it first's, readable by all). Anyone can
    create it first: `up` then uses a fresh one of its own (epdctl.cache.store_root)."""
    return f"{STORE_BASE}/epdctl-{os.geteuid() if uid is None else uid}"


def make_store_dir(path: str | os.PathLike[str]) -> Path:
    """Create a store root or namespace dir with mode 0700, or take the one there if it is a
    real directory of this user's that nobody else can reach (0700); else CacheError (one line
    naming it and the fix). Another user's directory could be read, or hold planted entries."""
    return private.make_dir(path, _WHAT, _ELSEWHERE, CacheError)


def check_store_dir(path: str | os.PathLike[str]) -> None:
    """CacheError unless the existing `path` is a store directory to trust (as make_store_dir);
    FileNotFoundError if it does not exist."""
    private.check_dir(path, _WHAT, _ELSEWHERE, CacheError)
