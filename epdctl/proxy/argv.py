"""The proxy's command line: argparse built from ProxyConfig's knobs (each flag, help and
default lives on its field in config.py), read back into a ProxyConfig."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from epdctl.proxy.config import API_KEY_ENV, UPSTREAM_KEY_ENV, ProxyConfig


def _parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="E|PD: --encode URL... --prefill-decode URL...   E|P|D: --encode URL... "
               "--prefill URL... --decode URL...   Aggregated: --prefill-decode URL...   "
               "The API key comes from "
               f"${API_KEY_ENV}.",
    )
    for f in dataclasses.fields(ProxyConfig):
        flag, meta = f.metadata["flag"], f.metadata
        if flag is None:
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           **kwargs)
        elif isinstance(f.default, tuple):
            p.add_argument(flag, action="append", default=None,
                           required=f.name == "models", **kwargs)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, **kwargs)
    # The flag's old name (deprecated, hidden): old command lines still start the proxy.
    p.add_argument("--pd", dest="prefill_decode", action="append", default=None,
                   metavar="URL", help=argparse.SUPPRESS)
    # Kept for people who pass it by hand; $EPDCTL_PROXY_API_KEY keeps it off `ps`.
    p.add_argument("--api-key", dest="api_key", default=argparse.SUPPRESS,
                   help=f"bearer token every route but /health requires; better given as "
                        f"${API_KEY_ENV}, which keeps it off the command line")
    return p


def parse_argv(argv: Sequence[str] | None = None, *, prog: str = "python -m epdctl.proxy",
               description: str | None = None) -> ProxyConfig:
    """The config that argv (as `to_argv` writes it) and the environment describe."""
    p = _parser(prog, description)
    values = vars(p.parse_args(argv))
    if any(a == "--pd" or a.startswith("--pd=") for a in (sys.argv[1:] if argv is None else argv)):
        print(f"{prog}: --pd is deprecated; use --prefill-decode", file=sys.stderr)
    pairs = []
    for pair in values.get("ec_consumers") or ():
        url, sep, address = pair.rpartition("=")  # a control address has no `=`
        if not (sep and url and address):
            p.error(f"--ec-consumer {pair}: expected URL=tcp://host:port")
        pairs.append((url, address))
    values["ec_consumers"] = pairs
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in values.items() if v is not None}
    kwargs["api_key"] = values.get("api_key") or os.environ.get(API_KEY_ENV) or None
    kwargs["upstream_api_key"] = os.environ.get(UPSTREAM_KEY_ENV) or None
    try:
        return ProxyConfig(**kwargs)
    except ValueError as exc:
        p.error(str(exc))
    raise AssertionError("unreachable")  # p.error exits
