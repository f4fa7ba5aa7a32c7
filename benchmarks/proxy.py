"""Proxy overhead: fake upstreams with a fixed delay, direct calls vs calls through the proxy,
and image requests with store lookups vs without, side by side in one run.

    .venv/bin/python benchmarks/proxy.py [--delay-ms 1] [--seconds 3] [--levels 1,8,32,64]
        [--no-store]

Starts a fake E + PD server (raw asyncio, one process, two ports) and two proxies
(`python -m epdctl.proxy`, each its own process) before the same fakes: one over an empty EC
store (`--store-dir/--namespace`), which looks each image up before the E stage, and one
without a store (no lookups). Then it drives them with a closed-loop raw asyncio HTTP/1.1 load
generator at several concurrency levels: text straight to PD (direct) and through the proxy
without lookups (proxy), and image requests on both proxies in the order A B B A (which arm
is A alternating from level to level; an arm's figure at a level is the mean of its two runs).
Every image request carries an image of its own,
so every lookup misses: the two image arms measure the cost of the skip when nothing repeats.
--no-store: the proxy without lookups alone (for proxies without them).

Prints added latency p50/p99 (text, the first level), the best requests/s and each proxy's CPU
per request, ending with one key=value line; with both arms, image_rps_ratio_lookups (best
image req/s with lookups / without) and image_p50_ratio_lookups (image p50 at the first level,
with / without).
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


def _start_proxy(port: int, e_port: int, pd_port: int, client: str,
                 store: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "epdctl.proxy", "--port", str(port), "--model", "m",
         "--encode", f"http://127.0.0.1:{e_port}",
         "--prefill-decode", f"http://127.0.0.1:{pd_port}",
         "--max-inflight", "4096", "--client", client, *store],
        cwd=ROOT, stderr=subprocess.DEVNULL)


def _arms(level_index: int, proxies: dict[str, tuple[int, subprocess.Popen]],
          pd_port: int) -> list[tuple[str, int, dict, subprocess.Popen | None]]:
    """One level's rows in order: (name, port, body, the proxy whose CPU is counted)."""
    port, plain = proxies["plain"]
    rows: list[tuple[str, int, dict, subprocess.Popen | None]] = [
        ("direct", pd_port, TEXT, None), ("proxy", port, TEXT, plain)]
    if "lookups" not in proxies:
        return [*rows, ("proxy-image", port, IMAGE, plain)]
    look_port, looking = proxies["lookups"]
    images = [("image-lookups", look_port, IMAGE, looking),
              ("image-no-lookups", port, IMAGE, plain)]
    if level_index % 2:
        images.reverse()
    # A B B A: what comes first or last at a level (a warmer proxy, a busier machine) weighs
    # on both arms alike; each arm's figure at the level is the mean of its two runs.
    return rows + images + images[::-1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--levels", default="1,8,32,64")
    p.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    p.add_argument("--no-store", dest="has_store", action="store_false",
                   help="no store arm: one proxy, without an EC store (no lookups)")
    p.add_argument("--fakes", nargs=3, type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.fakes:
        _run(_serve_fakes(int(a.fakes[0]), int(a.fakes[1]), a.fakes[2]))
        return
    e_port, pd_port = free_port(), free_port()
    fakes = subprocess.Popen([sys.executable, __file__, "--fakes", str(e_port), str(pd_port),
                              str(a.delay_ms / 1000)])
    store_dir = tempfile.mkdtemp(prefix="epdctl-bench-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    namespace = "bench-0123456789ab"
    (Path(store_dir) / namespace / "entries").mkdir(parents=True)  # empty: every look misses
    stores: dict[str, list[str]] = {"plain": []}
    if a.has_store:
        stores["lookups"] = ["--store-dir", store_dir, "--namespace", namespace]
    proxies: dict[str, tuple[int, subprocess.Popen]] = {}
    try:
        for arm, store in stores.items():
            port = free_port()
            proxies[arm] = (port, _start_proxy(port, e_port, pd_port, a.client, store))
        for port in (e_port, pd_port, *(port for port, _ in proxies.values())):
            _wait_port(port)
        rows = []
        for n, level in enumerate(int(x) for x in a.levels.split(",")):
            for name, port, body, proxy in _arms(n, proxies, pd_port):
                cpu_before = _cpu_s(proxy.pid) if proxy else 0.0
                result: dict = _run(_load(port, body, level, a.seconds))  # type: ignore
                # Proxy CPU per request (warm-up included): robust on a busy machine.
                cpu_us = (_cpu_s(proxy.pid) - cpu_before) * 1e6 / max(result["n"], 1) \
                    if proxy else 0.0
                rows.append((level, name, result))
                print(f"c={level:<4} {name:<16} rps={result['rps']:8.0f} "
                      f"p50={result['p50_ms']:7.2f}ms p99={result['p99_ms']:7.2f}ms"
                      + (f" proxy_cpu={cpu_us:6.0f}us/req" if proxy else ""), flush=True)
    finally:
        for _, proc in proxies.values():
            proc.terminate()
        fakes.terminate()
        for _, proc in proxies.values():
            proc.wait(10)
        fakes.wait(10)
        shutil.rmtree(store_dir, ignore_errors=True)
    print(_summary(rows))


def _summary(rows: list[tuple[int, str, dict]]) -> str:
    """The key=value line: text overhead at the first level, best req/s, lookup ratios."""
    first = rows[0][0]
    runs: dict[tuple[int, str], list[dict]] = {}
    for lvl, name, res in rows:
        runs.setdefault((lvl, name), []).append(res)
    by = {key: {k: statistics.fmean(r[k] for r in results) for k in ("rps", "p50_ms", "p99_ms")}
          for key, results in runs.items()}
    best = {name: max(res["rps"] for (_, n), res in by.items() if n == name)
            for _, name in by}
    added_p50 = by[(first, "proxy")]["p50_ms"] - by[(first, "direct")]["p50_ms"]
    added_p99 = by[(first, "proxy")]["p99_ms"] - by[(first, "direct")]["p99_ms"]
    line = (f"added_p50_ms={added_p50:.3f} added_p99_ms={added_p99:.3f} "
            f"max_rps={best['proxy']:.0f}")
    if "proxy-image" in best:
        return f"{line} max_rps_image={best['proxy-image']:.0f}"
    p50_ratio = by[(first, "image-lookups")]["p50_ms"] / by[(first, "image-no-lookups")]["p50_ms"]
    return (f"{line} max_rps_image={best['image-lookups']:.0f} "
            f"image_rps_ratio_lookups={best['image-lookups'] / best['image-no-lookups']:.3f} "
            f"image_p50_ratio_lookups={p50_ratio:.3f}")


if __name__ == "__main__":
    main()
