"""Fixtures shared with other suites: tiny models (tests/e2e) and the proxy rig (tests/proxy)."""

from __future__ import annotations

# Re-exported so pytest sees them here too; conftest fixtures are only visible below their dir.
from tests.e2e.conftest import tiny_llava, tiny_qwen2vl  # noqa: F401
from tests.proxy.conftest import anyio_backend, names, rig_factory, transport  # noqa: F401
