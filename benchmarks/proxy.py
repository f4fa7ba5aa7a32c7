"""Proxy overhead: fake upstreams with a fixed delay, direct calls vs calls through the proxy.

    .venv/bin/python benchmarks/proxy.py [--delay-ms 1] [--seconds 3] [--levels 1,8,32,64]
        [--no-store]

Starts a fake E + PD server (raw asyncio, one process, two ports) and the proxy
(`python -m epdctl.proxy`, its own process), then drives each with a closed-loop raw
asyncio HTTP/1.1 load generator at several concurrency levels. Every image request carries
an image of its own, and the proxy looks each one up in an (empty) EC store first, so every
lookup misses: the overhead of the skip when nothing repeats (--no-store: no lookups, for
proxies without them). Prints added latency p50/p99 (text, concurrency 1) and the best
requests/s, ending with one key=value line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = {"model": "m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}
IMAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
    {"type": "text", "text": "What is this?"},
    {"type": "image_url",
     "image_url": {"url": "data:image/png;base64," + base64.b64encode(os.urandom(1536)).decode()}},
]}]}
PD_BODY = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Hello there"},
     "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode()
# E answers for the item's own key (the uuid the proxy sent it), as a real E does.
E_HEAD, E_TAIL = json.dumps({"id": "e", "choices": [], "ec_transfer_params": {"KEY": {
    "item_indices": [0], "metadata": {"image_grid_thw": [1, 4, 4]}}}}).encode().split(b"KEY")
UUID = b'"uuid":"'
# The first characters of IMAGE's base64 payload, rewritten per request: a fresh image each.
IMAGE_AT = json.dumps(IMAGE).encode().index(b"base64,") + len(b"base64,")
STAMP_CHARS = 16
_stamps = itertools.count()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _response(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


class _FakeServer(asyncio.Protocol):
    """Keep-alive HTTP/1.1: answers every request after the delay with a canned body (E:
    keyed by the request's uuid)."""

    def __init__(self, answer: bytes | None, delay_s: float) -> None:
        self.answer = answer
        self.health = _response(b"{}")
        self.delay_s = delay_s
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0
                              else None]) if at >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            answer = self.health if head.startswith(b"get /health") else self.answer
            if answer is None:
                at = body.find(UUID) + len(UUID)
                answer = _response(E_HEAD + body[at:body.index(b'"', at)] + E_TAIL)
            if self.delay_s:
                asyncio.get_running_loop().call_later(self.delay_s, self._write, answer)
            else:
                self._write(answer)

    def _write(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)  # type: ignore[attr-defined]


async def _serve_fakes(e_port: int, pd_port: int, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(lambda: _FakeServer(None, delay_s), "127.0.0.1",
                             e_port, backlog=4096)
    await loop.create_server(lambda: _FakeServer(_response(PD_BODY), delay_s), "127.0.0.1",
                             pd_port, backlog=4096)
    await asyncio.Event().wait()


def _run(coro: object) -> object:
    try:
        import uvloop

        return uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]


def _stamped(request: bytes, at: int | None) -> bytes:
    """The request, with a fresh image where `at` says (None: unchanged)."""
    if at is None:
        return request
    stamp = f"{next(_stamps):0{STAMP_CHARS}x}".encode()  # hex digits are base64 too
    return request[:at] + stamp + request[at + STAMP_CHARS:]


async def _worker(port: int, request: bytes, deadline: float, lat: list[float],
                  stamp_at: int | None = None) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            writer.write(_stamped(request, stamp_at))
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            at = lower.find(b"content-length:")
            await reader.readexactly(int(lower[at + 15:lower.find(b"\r\n", at)]))
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode(errors="replace"))
            lat.append(time.perf_counter() - t0)
    finally:
        writer.close()


async def _load(port: int, body: dict, concurrency: int, seconds: float) -> dict:
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
            ).encode()
    request = head + data
    stamp_at = len(head) + IMAGE_AT if body is IMAGE else None
    warm: list[float] = []
    await asyncio.gather(*(_worker(port, request, time.perf_counter() + 0.5, warm, stamp_at)
                           for _ in range(concurrency)))
    lat: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(_worker(port, request, start + seconds, lat, stamp_at)
                           for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    lat.sort()
    return {"rps": len(lat) / elapsed, "p50_ms": statistics.median(lat) * 1000,
            "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000, "n": len(lat)}


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--levels", default="1,8,32,64")
    p.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    p.add_argument("--no-store", dest="has_store", action="store_false",
                   help="start the proxy without an EC store (no lookups)")
    p.add_argument("--fakes", nargs=3, type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.fakes:
        _run(_serve_fakes(int(a.fakes[0]), int(a.fakes[1]), a.fakes[2]))
        return
    e_port, pd_port, proxy_port = free_port(), free_port(), free_port()
    fakes = subprocess.Popen([sys.executable, __file__, "--fakes", str(e_port), str(pd_port),
                              str(a.delay_ms / 1000)])
    store_dir = tempfile.mkdtemp(prefix="epdctl-bench-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    namespace = "bench-0123456789ab"
    (Path(store_dir) / namespace / "entries").mkdir(parents=True)  # empty: every look misses
    store = ["--store-dir", store_dir, "--namespace", namespace] if a.has_store else []
    proxy = subprocess.Popen(
        [sys.executable, "-m", "epdctl.proxy", "--port", str(proxy_port), "--model", "m",
         "--encode", f"http://127.0.0.1:{e_port}",
         "--prefill-decode", f"http://127.0.0.1:{pd_port}",
         "--max-inflight", "4096", "--client", a.client, *store],
        cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        _wait_port(e_port)
        _wait_port(pd_port)
        _wait_port(proxy_port)
        rows = []
        for level in [int(x) for x in a.levels.split(",")]:
            for name, port, body in (("direct", pd_port, TEXT), ("proxy", proxy_port, TEXT),
                                     ("proxy-image", proxy_port, IMAGE)):
                cpu_before = _cpu_s(proxy.pid)
                result: dict = _run(_load(port, body, level, a.seconds))  # type: ignore
                # Proxy CPU per request (warm-up included): robust on a busy machine.
                cpu_us = (_cpu_s(proxy.pid) - cpu_before) * 1e6 / max(result["n"], 1)
                result["cpu_us"] = cpu_us if name != "direct" else 0.0
                rows.append((level, name, result))
                print(f"c={level:<4} {name:<12} rps={result['rps']:8.0f} "
                      f"p50={result['p50_ms']:7.2f}ms p99={result['p99_ms']:7.2f}ms"
                      + (f" proxy_cpu={cpu_us:6.0f}us/req" if name != "direct" else ""),
                      flush=True)
    finally:
        proxy.terminate()
        fakes.terminate()
        proxy.wait(10)
        fakes.wait(10)
        shutil.rmtree(store_dir, ignore_errors=True)
    first = min(r[0] for r in rows)
    by = {(lvl, name): res for lvl, name, res in rows}
    added_p50 = by[(first, "proxy")]["p50_ms"] - by[(first, "direct")]["p50_ms"]
    added_p99 = by[(first, "proxy")]["p99_ms"] - by[(first, "direct")]["p99_ms"]
    max_rps = max(res["rps"] for lvl, name, res in rows if name == "proxy")
    max_image = max(res["rps"] for lvl, name, res in rows if name == "proxy-image")
    print(f"added_p50_ms={added_p50:.3f} added_p99_ms={added_p99:.3f} max_rps={max_rps:.0f} "
          f"max_rps_image={max_image:.0f}")


if __name__ == "__main__":
    main()
