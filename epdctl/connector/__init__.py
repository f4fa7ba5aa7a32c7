"""epdctl's shared-memory EC connector, a vLLM plugin (imports vLLM; never the CLI)."""

from __future__ import annotations

from epdctl.connector.ec import EpdctlShmECConnector

__all__ = ["EpdctlShmECConnector"]
