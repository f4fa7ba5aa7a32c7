"""epdctl's shared-memory EC connector, a vLLM plugin (imports vLLM; never the CLI).

The connector class loads lazily, so the tensor I/O (`_io`) works without vLLM
(benchmarks/connector_cuda.py runs on a GPU machine with only torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epdctl.connector.ec import EpdctlShmECConnector

__all__ = ["EpdctlShmECConnector"]


def __getattr__(name: str) -> Any:
    # vLLM's factory imports this module and reads the class by name: both still work.
    if name == "EpdctlShmECConnector":
        from epdctl.connector.ec import EpdctlShmECConnector

        return EpdctlShmECConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
