"""Fixtures shared with another suite: the proxy rig (tests/proxy)."""

from __future__ import annotations

# Re-exported so pytest sees them here too; conftest fixtures are only visible below their dir.
from tests.proxy.conftest import anyio_backend, names, rig_factory, transport  # noqa: F401
