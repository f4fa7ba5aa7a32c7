"""`python -m epdctl.proxy` as a real process, the official openai client through it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests.proxy.fakes import MODEL, STREAM, completion, image_part

openai = pytest.importorskip("openai")
KEY = "test-key"


class _Upstream(BaseHTTPRequestHandler):
    """A tiny vLLM stand-in: E answers ec_transfer_params, PD answers text or SSE."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, dict, dict]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            card = {"object": "list", "data": [{"id": MODEL, "object": "model",
                                                "owned_by": "vllm", "max_model_len": 512}]}
            return self._reply(200, json.dumps(card).encode())
        self._reply(200, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        role = self.server.role  # type: ignore[attr-defined]
        self.seen.append((role, dict(self.headers), body))
        if role == "pd-flaky":
            return self._flaky(body)
        if "slow" in json.dumps(body):
            time.sleep(3)
        if role == "encode":
            key = body["messages"][0]["content"][0].get("uuid", "k")
            out = {"id": "e", "choices": [], "ec_transfer_params": {
                key: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 2, 2]}}}}
            return self._reply(200, json.dumps(out).encode())
        if body.get("stream"):
            # Chunked in pieces that split a multi-byte character, as a real server may.
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            cut = STREAM.index("€".encode()) + 1
            for piece in (STREAM[:cut], STREAM[cut:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return None
        return self._reply(200, json.dumps(completion("Hello from PD")).encode())


    def _flaky(self, body: dict) -> None:
        """A PD whose streams break after their first token (the instance died) and whose
        /tokenize never answers (hung)."""
        if self.path == "/tokenize":
            time.sleep(60)
            return None
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        piece = STREAM[:STREAM.index(b"\n\n", STREAM.index(b"Hel")) + 2]  # up to "Hel"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)  # cut: no last chunk
        self.close_connection = True
        return None


def _serve(role: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.role = role  # type: ignore[attr-defined]
    server.daemon_threads = True
    server.handle_error = lambda *args: None  # type: ignore[method-assign]  # resets on close
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _until_healthy(base: str, proc: subprocess.Popen[bytes], log: Path,
                   is_ready: Callable[[httpx.Response], object]) -> None:
    """Until the proxy's /health satisfies `is_ready` (20 s at most, and while it runs)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            if is_ready(httpx.get(base + "/health")):
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.fixture(params=["aiohttp", "httpx"])
def proxy(request, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    enc, pd = _serve("encode"), _serve("prefill_decode")
    _Upstream.seen = []
    port = _free_port()
    log = tmp_path / "proxy.log"
    argv = [sys.executable, "-m", "epdctl.proxy", "--port", str(port), "--model", MODEL,
            "--encode", f"http://127.0.0.1:{enc.server_port}",
            "--prefill-decode", f"http://127.0.0.1:{pd.server_port}",
            "--prefill-decode", f"http://127.0.0.1:{_free_port()}",
            "--encode-timeout", "5", "--decode-timeout", "1", "--client", request.param,
            "--health-interval", "0.2", "--eject-after", "1"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "EPDCTL_PROXY_API_KEY": KEY},
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        # up, and the dead PD instance has been ejected
        _until_healthy(base, proc, log, lambda h: h.json()["roles"]["prefill_decode"]["out"])
        yield base, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        # uvicorn re-raises the SIGTERM it handled after a graceful shutdown.
        assert proc.wait(10) in (0, -signal.SIGTERM), log.read_text()
        enc.shutdown()
        pd.shutdown()


def test_openai_client_through_the_proxy_process(proxy):
    base, log = proxy
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what?"}, image_part()]}], extra_headers={"x-request-id": "p-1"})
    assert out.choices[0].message.content == "Hello from PD"
    stream = client.chat.completions.create(
        model=MODEL, stream=True, messages=[{"role": "user", "content": "hi"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "Hello é€😀"
    with httpx.stream("POST", base + "/v1/chat/completions", headers={
            "authorization": f"Bearer {KEY}"}, json={"model": MODEL, "stream": True,
                                                    "messages": [{"role": "user",
                                                                  "content": "hi"}]}) as r:
        assert r.read() == STREAM
    roles = [(role, headers.get("X-Request-Id") or headers.get("x-request-id"))
             for role, headers, _ in _Upstream.seen]
    assert roles[:2] == [("encode", "p-1:enc0"), ("prefill_decode", "p-1")]
    pd_body = _Upstream.seen[1][2]
    assert pd_body["messages"][0]["content"][1]["type"] == "image_embeds"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
    line = "rid=p-1 route=/v1/chat/completions status=200"
    deadline = time.monotonic() + 10  # the proxy writes its request lines in 0.1 s batches
    while line not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.mark.parametrize("rid", ["请求-1", "req-😀"])
def test_a_body_request_id_in_any_script_is_answered(proxy, rid):
    """vLLM takes any printable body `request_id` and names its answer by it; through the
    proxy too (text, image, streamed), never a 500 from a header that cannot be encoded.
    The answering instance gets the body's id as sent and no x-request-id (which would
    rename the answer); E gets a child id, percent-encoded, in its header."""
    base, _ = proxy
    headers = {"authorization": f"Bearer {KEY}"}
    for content, stream in [("hi", False), ([{"type": "text", "text": "what?"}, image_part()],
                                            False), ("hi", True)]:
        _Upstream.seen = []
        body = {"model": MODEL, "request_id": rid, "stream": stream,
                "messages": [{"role": "user", "content": content}]}
        r = httpx.post(base + "/v1/chat/completions", headers=headers, json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert (r.text == STREAM.decode()) if stream else (
            r.json()["choices"][0]["message"]["content"] == "Hello from PD")
        sent = {role: (hdrs, seen_body) for role, hdrs, seen_body in _Upstream.seen}
        pd_headers, pd_body = sent["prefill_decode"]
        assert pd_body["request_id"] == rid
        assert "x-request-id" not in {k.lower() for k in pd_headers}
        if "encode" in sent:
            e_headers = {k.lower(): v for k, v in sent["encode"][0].items()}
            assert e_headers["x-request-id"] == quote(rid, safe="-") + ":enc0"


def test_process_maps_timeouts_to_504(proxy):
    base, _ = proxy
    r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "slow"}]},
                   timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == 504


# `python -m epdctl.proxy` where httptools and uvloop cannot be imported.
WITHOUT_SPEEDUPS = ("import sys; sys.modules.update(httptools=None, uvloop=None); "
                    "from epdctl.proxy.__main__ import main; main()")


@pytest.mark.parametrize("has_speedups", [True, False], ids=["speedups", "no-speedups"])
def test_process_maps_a_dead_instance_to_502(tmp_path, has_speedups):
    port, dead = _free_port(), _free_port()
    start = ["-m", "epdctl.proxy"] if has_speedups else ["-c", WITHOUT_SPEEDUPS]
    proc = subprocess.Popen(
        [sys.executable, *start, "--port", str(port), "--model", MODEL,
         "--prefill-decode", f"http://127.0.0.1:{dead}", "--health-interval", "0.2",
         "--replay-wait", "0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                break
            except httpx.ConnectError:
                assert proc.poll() is None, "the proxy exited"
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 502 and r.json()["error"]["code"] == 502
        # /health turns 503 once the health loop has ejected the dead instance (until then
        # it has not failed a probe yet): wait for that, then it says who is out.
        health = f"http://127.0.0.1:{port}/health"
        while (h := httpx.get(health)).status_code == 200:
            assert time.monotonic() < deadline + 20, h.text
            time.sleep(0.1)
        assert h.status_code == 503
        assert {k: h.json()[k] for k in ("status", "roles")} == {
            "status": "unavailable",
            "roles": {"prefill_decode": {"in": [], "out": [f"http://127.0.0.1:{dead}"]}}}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(10) in (0, -signal.SIGTERM)


def test_a_hung_tokenize_while_resuming_ends_the_stream_within_its_deadline(tmp_path):
    """A stream breaks after "Hel"; the PD that would take it over never answers /tokenize
    (the proxy asks it how the text sent so far tokenizes). With the client `up` runs, the
    client's stream ends with the error event once /tokenize's deadline has passed (and
    replay_wait found no other PD), not whenever the client gives up."""
    from epdctl.proxy.stages.replay import TOKENIZE_TIMEOUT_S

    pds = [_serve("pd-flaky"), _serve("pd-flaky")]
    port = _free_port()
    argv = [sys.executable, "-m", "epdctl.proxy", "--port", str(port), "--model", MODEL,
            "--replay-wait", "1", "--client", "aiohttp",
            *[arg for pd in pds for arg in ("--prefill-decode",
                                            f"http://127.0.0.1:{pd.server_port}")]]
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _until_healthy(base, proc, log, lambda h: h.status_code == 200)
        began = time.monotonic()
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body,
                          timeout=TOKENIZE_TIMEOUT_S + 30) as reply:
            assert reply.status_code == 200
            text = reply.read().decode()
        took = time.monotonic() - began
        assert '"content":"Hel"' in text.replace(" ", ""), text
        assert text.rstrip().splitlines()[-1].startswith('data: {"error"'), text
        assert TOKENIZE_TIMEOUT_S <= took < TOKENIZE_TIMEOUT_S + 15, (took, log.read_text())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        for pd in pds:
            pd.shutdown()
