"""python -m epdctl.proxy: the proxy as its own process (argv built by epdctl.plan)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from epdctl.proxy.config import ProxyConfig

log = logging.getLogger("epdctl.proxy")
# vLLM drops idle keep-alive connections after 5 s; retire ours first so a request never
# lands on a socket the server is closing.
KEEPALIVE_EXPIRY_S = 2.0


def parse_args(argv: Sequence[str] | None = None) -> tuple[ProxyConfig, str, int, str]:
    """The config plus the address to bind."""
    p = argparse.ArgumentParser(
        prog="python -m epdctl.proxy", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="E|PD: --encode URL... --pd URL...   E|P|D: --encode URL... --prefill URL... "
               "--decode URL...   Aggregated: --pd URL...",
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback should come with --api-key")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--model", action="append", required=True,
                   help="model name the instances serve (repeat for several)")
    roles = {"encode": "an encoder (ec_producer) instance", "pd": "a prefill+decode instance",
             "prefill": "a prefill (kv_producer) instance",
             "decode": "a decode (kv_consumer) instance"}
    for role, what in roles.items():
        p.add_argument(f"--{role}", action="append", default=[], metavar="URL",
                       help=f"base URL of {what}; repeat for replicas")
    p.add_argument("--encode-timeout", type=float, default=60.0,
                   help="seconds an encoder gets per item before PD encodes it itself")
    p.add_argument("--prefill-timeout", type=float, default=120.0,
                   help="seconds the prefill stage gets (E|P|D)")
    p.add_argument("--decode-timeout", type=float, default=120.0,
                   help="seconds until the first byte from decode or PD")
    p.add_argument("--stream-idle-timeout", type=float, default=60.0,
                   help="seconds allowed between two chunks of a stream")
    p.add_argument("--max-inflight", type=int, default=256,
                   help="requests served at once; more get 503 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024,
                   help="larger request bodies get 413")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds to fetch an http(s) media URL (hashed for the cache key)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health probes of every instance")
    p.add_argument("--eject-after", type=int, default=3,
                   help="failed probes in a row before an instance gets no requests")
    p.add_argument("--no-metadata-rewrite", action="store_true",
                   help="always send PD the media, never E's *_embeds metadata")
    p.add_argument("--ec-protocol", choices=("shared", "mooncake"), default="shared",
                   help="mooncake: pick PD first and have E push into it (vLLM's "
                        "ECMooncakeConnector, E|PD only)")
    p.add_argument("--ec-consumer", action="append", default=[], metavar="URL=ZMQ",
                   help="a --pd URL and its Mooncake control socket, e.g. "
                        "http://pd-0:8000=tcp://pd-0:14579; one per --pd")
    p.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                   help="upstream HTTP client (see benchmarks/proxy.py)")
    p.add_argument("--api-key", default=argparse.SUPPRESS,
                   help="bearer token every route but /health requires; better given as "
                        "$EPDCTL_PROXY_API_KEY, which keeps it off the command line")
    a = p.parse_args(argv)
    consumers = []
    for pair in a.ec_consumer:
        url, sep, address = pair.rpartition("=")  # a control address has no `=`
        if not (sep and url and address):
            p.error(f"--ec-consumer {pair}: expected URL=tcp://host:port")
        consumers.append((url, address))
    try:
        config = ProxyConfig(
            models=tuple(a.model), encode=tuple(a.encode), pd=tuple(a.pd),
            prefill=tuple(a.prefill), decode=tuple(a.decode),
            encode_timeout_s=a.encode_timeout, prefill_timeout_s=a.prefill_timeout,
            decode_timeout_s=a.decode_timeout, stream_idle_timeout_s=a.stream_idle_timeout,
            max_inflight=a.max_inflight, max_body_bytes=a.max_body_bytes,
            media_fetch_timeout_s=a.media_fetch_timeout, health_interval_s=a.health_interval,
            eject_after=a.eject_after, metadata_rewrite=not a.no_metadata_rewrite,
            api_key=getattr(a, "api_key", None) or os.environ.get("EPDCTL_PROXY_API_KEY")
            or None, ec_protocol=a.ec_protocol, ec_consumers=tuple(consumers),
        )
    except ValueError as exc:
        p.error(str(exc))
    return config, a.host, a.port, a.client


async def serve(config: ProxyConfig, host: str, port: int, client_kind: str = "aiohttp") -> None:
    """Own the shared client, run the health loop beside the server, close both on exit."""
    import uvicorn

    from epdctl.proxy.app import create_app
    from epdctl.proxy.logline import LineWriter

    lines = LineWriter()
    async with _client(config, client_kind) as client:
        app = create_app(config, client, lines)
        # "auto": httptools when installed (a dependency), else uvicorn's pure-Python h11.
        server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, http="auto", lifespan="off", access_log=False,
            log_level="warning", timeout_keep_alive=30, backlog=4096))
        health = asyncio.create_task(app.state.proxy.run_health_checks())
        log.info("proxy on http://%s:%d mode=%s encode=%s pd=%s prefill=%s decode=%s "
                 "rewrite=%s ec=%s auth=%s client=%s", host, port, config.mode,
                 list(config.encode), list(config.pd), list(config.prefill), list(config.decode),
                 config.metadata_rewrite, config.ec_protocol,
                 "on" if config.api_key else "off", client_kind)
        if not config.api_key and host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening on %s without an API key: anyone who can reach it can use "
                        "the model (set proxy.api_key)", host)
        try:
            await server.serve()
        finally:
            health.cancel()
            lines.flush()


def _client(config: ProxyConfig, kind: str) -> Any:
    """The one shared upstream client (an async context manager that closes it)."""
    if kind == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        timeout = httpx.Timeout(config.decode_timeout_s, connect=config.connect_timeout_s)
        return httpx.AsyncClient(limits=limits, timeout=timeout)
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
    # No cookie jar (instances set none) and no decompression (we ask for identity): both
    # cost time on every request.
    return aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                      sock_read=config.decode_timeout_s))


def main(argv: Sequence[str] | None = None) -> None:
    config, host, port, client_kind = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every sub-request at INFO; the proxy's own line per request says more.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        import uvloop  # a dependency where it builds (not on Windows)

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config, host, port, client_kind))


if __name__ == "__main__":
    main()
