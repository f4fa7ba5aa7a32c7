"""vLLM general plugin: registers the connector by name in every vLLM process."""

from __future__ import annotations

from epdctl.cache import CONNECTOR_MODULE, CONNECTOR_NAME


def register() -> None:
    """Register CONNECTOR_NAME with vLLM's ECConnectorFactory (idempotent)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    try:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        pass  # vLLM may load general plugins more than once per process
