"""python -m epdctl.proxy: the proxy as its own process (argv built by epdctl.launch.plan)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from epdctl.proxy.argv import parse_argv
from epdctl.proxy.config import LOOPBACK, MODE_LABEL, ProxyConfig

log = logging.getLogger("epdctl.proxy")
# vLLM drops idle keep-alive connections after 5 s; retire ours first so a request never
# lands on a socket the server is closing.
KEEPALIVE_EXPIRY_S = 2.0


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    """The config from argv (flags derived from ProxyConfig's fields) and the environment."""
    return parse_argv(argv, description=__doc__)


async def serve(config: ProxyConfig) -> list[int]:
    """Own the shared client, run the health loop beside the server, close both on exit;
    the signals that stopped it (main raises them again once all is written)."""
    import uvicorn

    from epdctl.proxy.server.app import create_app
    from epdctl.proxy.server.logline import LineWriter

    class Server(uvicorn.Server):
        """uvicorn's, except that the signal it stopped on is not raised again as serve()
        returns (the process would die there, before the cleanup below) but kept."""

        stopped_by: list[int] = []

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    self.stopped_by = list(captured)
                    captured.clear()

    lines = LineWriter()
    async with upstream_client(config) as client:
        app = create_app(config, client, lines)
        server = Server(uvicorn.Config(
            app, host=config.host, port=config.port, http=http_protocol(), lifespan="off",
            access_log=False, log_level="warning", timeout_keep_alive=30, backlog=4096,
            # Nothing reads the client's address or scheme: no X-Forwarded-* rewrite.
            proxy_headers=False))
        health = asyncio.create_task(app.state.proxy.run_health_checks())
        log.info("proxy on http://%s:%d mode=%s encode=%s prefill_decode=%s prefill=%s "
                 "decode=%s rewrite=%s ec=%s skip_cached=%s overlap=%s auth=%s client=%s",
                 config.host, config.port, MODE_LABEL[config.mode], list(config.encode),
                 list(config.prefill_decode), list(config.prefill), list(config.decode),
                 config.metadata_rewrite, config.ec_protocol, config.should_look_up,
                 config.should_overlap,
                 "on" if config.api_key else "off", config.client)
        if not config.api_key and config.host not in LOOPBACK:
            log.warning("listening on %s without an API key: anyone who can reach it can use "
                        "the model (set proxy.api_key)", config.host)
        try:
            await server.serve()
        finally:
            health.cancel()
            # Overlapped requests' lines wait for their E stages: cancel those first.
            await app.state.proxy.stop_background()
            lines.flush()
            app.state.proxy.close()
    return server.stopped_by


def upstream_client(config: ProxyConfig) -> Any:
    """The one shared upstream client (an async context manager that closes it); the tests'
    proxy rig builds its clients here too, so that they are the ones that ship."""
    if config.client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        timeout = httpx.Timeout(config.decode_timeout_s, connect=config.connect_timeout_s)
        return httpx.AsyncClient(limits=limits, timeout=timeout)
    from epdctl.proxy.transport.aiohttp_impl import session

    return session(config.connect_timeout_s, config.decode_timeout_s, KEEPALIVE_EXPIRY_S)


def http_protocol() -> Any:
    """uvicorn's httptools protocol with an answer's writes combined (server/writes.py), when
    httptools is installed (a dependency where it builds); else "auto": uvicorn's h11."""
    try:
        from epdctl.proxy.server.writes import Protocol
    except ImportError:
        return "auto"
    return Protocol


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
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
        stopped_by = runner.run(serve(config))
    for sig in reversed(stopped_by):  # die of it, as uvicorn would have (the exit status)
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)


if __name__ == "__main__":
    main()
