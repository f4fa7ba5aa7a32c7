"""The shared-memory EC store: layout, entries, pins, eviction (stdlib only; no vLLM)."""

from __future__ import annotations

# Written once here; plan.py builds --ec-transfer-config from them and the connector
# registers itself under CONNECTOR_NAME (a name no vLLM built-in uses).
CONNECTOR_NAME = "EpdctlShmECConnector"
CONNECTOR_MODULE = "epdctl.connector"
FORMAT_VERSION = 2
DEFAULT_STORE_ROOT = "/dev/shm/epdctl"
"""Where the store lives unless a topology's `cache.dir` says otherwise (tmpfs)."""
