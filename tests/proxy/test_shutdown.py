"""`python -m epdctl.proxy` stopped while E stages run beside PD (overlap): every request's
line is still written, and no pending mark is left in the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from epdctl.cache.store import Store
from tests.proxy.fakes import MODEL, PNG, completion, image_part
from tests.proxy.test_process import _free_port

NAMESPACE = "shutdown-0123456789ab"
WAIT_S = 20.0  # an upper bound for an observed event, never a duration a test relies on
REQUESTS = 3


class _Upstream(BaseHTTPRequestHandler):
    """E holds every request until released; PD answers at once."""

    protocol_version = "HTTP/1.1"
    release = threading.Event()
    pd_posts: list[str] = []
    e_posts: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._reply(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        if self.server.role == "encode":  # type: ignore[attr-defined]
            self.e_posts.append(self.headers["x-request-id"])
            self.release.wait(WAIT_S)
            return self._reply(json.dumps({"id": "e", "choices": []}).encode())
        self.pd_posts.append(self.headers["x-request-id"])
        self._reply(json.dumps(completion()).encode())

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(role: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.role = role  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _until(predicate: object, what: str, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never happened: {what}\n{log.read_text()}"
        time.sleep(0.02)


@pytest.fixture
def upstreams() -> Iterator[tuple[ThreadingHTTPServer, ThreadingHTTPServer]]:
    _Upstream.release.clear()
    _Upstream.pd_posts, _Upstream.e_posts = [], []
    enc, pd = _serve("encode"), _serve("prefill_decode")
    try:
        yield enc, pd
    finally:
        _Upstream.release.set()
        enc.shutdown()
        pd.shutdown()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_shutdown_keeps_the_lines_of_requests_whose_e_is_still_running(
        tmp_path: Path, upstreams: tuple[ThreadingHTTPServer, ThreadingHTTPServer],
        how: signal.Signals) -> None:
    enc, pd = upstreams
    store = Store(tmp_path / "store", NAMESPACE).create()
    port, log = _free_port(), tmp_path / "proxy.log"
    argv = [sys.executable, "-m", "epdctl.proxy", "--port", str(port), "--model", MODEL,
            "--encode", f"http://127.0.0.1:{enc.server_port}",
            "--prefill-decode", f"http://127.0.0.1:{pd.server_port}",
            "--store-dir", str(store.root.parent), "--namespace", NAMESPACE,
            "--overlap", "--no-metadata-rewrite"]  # no rewrite: the first image overlaps
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _is_up(base, proc), "the proxy answers /health", log)
        for n in range(REQUESTS):
            body = {"model": MODEL, "messages": [{"role": "user", "content": [
                image_part(PNG + bytes([n]))]}]}
            reply = httpx.post(f"{base}/v1/chat/completions", json=body,
                               headers={"x-request-id": f"held-{n}"}, timeout=WAIT_S)
            assert reply.status_code == 200  # PD's answer; E still holds the item
        _until(lambda: len(_Upstream.e_posts) == REQUESTS, "E has every item", log)
        assert len(list(store.pending.iterdir())) == REQUESTS
        os.killpg(proc.pid, how)
        assert proc.wait(WAIT_S) in (0, -how), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    for n in range(REQUESTS):
        lines = [x for x in text.splitlines() if f"rid=held-{n} " in x]
        assert len(lines) == 1, text
        (line,) = lines
        assert "status=200" in line and "overlap=1" in line
    assert list(store.pending.iterdir()) == []  # the cancelled stages took their marks


def _is_up(base: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, "the proxy exited"
    try:
        return httpx.get(f"{base}/health").status_code == 200
    except httpx.HTTPError:
        return False
