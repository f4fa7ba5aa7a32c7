"""The EC connectors a topology may name (`cache.connector`) and the syntax of a name: the
topology schema checks names here; what each connector does is launch/connectors.py."""

from __future__ import annotations

import re

from epdctl import cache

OURS = cache.CONNECTOR_NAME
EXAMPLE = "ECExampleConnector"
MOONCAKE = "ECMooncakeConnector"
CPU = "ECCPUConnector"
BUILTIN = (EXAMPLE, MOONCAKE, CPU)
"""vLLM's own (vllm/distributed/ec_transfer/ec_connector/factory.py registers them)."""
NAMES = (OURS, *BUILTIN)
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CUSTOM = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT})")


def check_name(value: str) -> str:
    """cache.connector's syntax: a name epdctl knows, or module.path:ClassName."""
    if value in NAMES:
        return value
    match = _CUSTOM.fullmatch(value)
    if match is None:
        raise ValueError(f"expected {', '.join(NAMES)} or module.path:ClassName, got `{value}`")
    module, name = match.groups()
    if name in NAMES:
        # vLLM's factory looks names up in its registry first and would ignore the module.
        whose = "epdctl's" if name == OURS else "vLLM's"
        raise ValueError(f"`{name}` is {whose} own connector name, so vLLM would load that "
                         f"one and ignore `{module}`; give your class another name")
    return value


def split(connector: str) -> tuple[str | None, str]:
    """(module path, class name); no module for a name vLLM registers itself."""
    module, sep, name = connector.rpartition(":")
    if sep:
        return module, name
    return (cache.CONNECTOR_MODULE if connector == OURS else None), connector


def is_custom(connector: str) -> bool:
    return ":" in connector
