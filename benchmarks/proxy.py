"""Proxy overhead: fake upstreams with a fixed delay, direct calls vs calls through the proxy,
image requests with store lookups (over stores of 0, 1 000 and 10 000 entries) vs without,
and, given its source, vLLM's example EPD proxy (the peer), side by side in one run.

    .venv/bin/python benchmarks/proxy.py [--delay-ms 1] [--seconds 3] [--levels 1,8,32,64]
        [--no-store] [--peer PATH/disagg_epd_proxy.py] [--before CHECKOUT] [--repeat N]

Starts a fake E + PD server (raw asyncio, one process, two ports) and proxies (`python -m
epdctl.proxy`, each its own process) before the same fakes: three over an EC store
(`--store-dir/--namespace`) of 0, 1 000 and 10 000 entries, which look each image up before
the E stage (and index their store in a thread every second), and one without a store (no
lookups). Then it drives them with a closed-loop raw asyncio HTTP/1.1 load generator at
several concurrency levels: text straight to PD (direct) and through the proxy without
lookups (proxy), streamed text through it (proxy-stream: 16 events, each its own write), and
image requests on every proxy in the order A B C D D C B A (which arm comes first rotating
from level to level; an arm's figure at a level is the mean of its two runs). Every image
request carries an image of its own, so every lookup misses: the image arms measure the cost
of the look, and of the store's size, when nothing repeats.
--no-store: the proxy without lookups alone (for proxies without them).
--peer: vLLM's `examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py`, the
newest from vLLM 0.34.0's source archive (`vllm-0.34.0.tar.gz` on PyPI; the wheels do not
ship examples) or a vLLM checkout; it imports msgspec, fastapi and uvloop (vLLM's own
dependencies). Run as shipped (`--prefill-servers-urls none`: E+PD) before the same fakes;
its text, stream and image arms each A B B A with epdctl's (proxy, proxy-stream,
image-lookups: the look on, as `epdctl up` runs it).

Prints added latency p50/p99 (text, the first level), the best requests/s and each proxy's CPU
per request, ending with one key=value line; with the store arms, image_rps_ratio_lookups
(best image req/s with lookups / without), image_p50_ratio_lookups (image p50 at the first
level, with / without), max_rps_stream, and image_rps_ratio_1k / image_rps_ratio_10k (best
image req/s with lookups over 1 000 / 10 000 entries, over none); with --peer also
text_/stream_/image_cpu_ratio_peer (epdctl's proxy CPU per request / the peer's, at the last
level: where the proxies are the bottleneck) and text_/stream_/image_rps_ratio_peer
(epdctl's best req/s / the peer's) before the 10k ratio, which ends the line.
--before: another epdctl checkout (`git worktree add /tmp/before <commit>`), whose proxy runs
beside this one before the same fakes, as `python -m epdctl.proxy` from that tree, with and
without a store: each path (text, stream, image without lookups, image with lookups) A B B A
with this tree's, rotating. Prints a before/after table (best req/s, added p50 at the first
level: the arm's p50 less direct text's) with a verdict per path, and adds
<path>_rps_ratio_before and <path>_p50_added_ms_before (before's, after this tree's own
<path>_p50_added_ms) to the key=value line, with before_verdict=ok|worse last. The
1 000 and 10 000 entry stores are left out of such a run (fewer proxies: less noise).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEXT = {"model": "m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}
STREAM = {**TEXT, "stream": True}
IMAGE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
    {"type": "text", "text": "What is this?"},
    {"type": "image_url",
     "image_url": {"url": "data:image/png;base64," + base64.b64encode(os.urandom(1536)).decode()}},
]}]}
PD_BODY = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Hello there"},
     "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode()
# PD's stream as vLLM sends it: one chunk per event (role, 14 tokens, finish: 16 chunks),
# then [DONE]; each chunk its own write (TCP_NODELAY: a segment each, as tokens come).
_WORDS = "Hello there , this is a stream of fourteen tokens from the fake epd".split()
_DELTAS = [{"role": "assistant", "content": ""}, *({"content": f" {w}"} for w in _WORDS), {}]
STREAM_EVENTS = [b"data: " + json.dumps({
    "id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [
        {"index": 0, "delta": d, "finish_reason": "stop" if not d else None}]}).encode()
    + b"\n\n" for d in _DELTAS] + [b"data: [DONE]\n\n"]
IS_STREAM = re.compile(rb'"stream"\s*:\s*true')
# E answers for the item's own key (the uuid the proxy sent it), as a real E does.
E_HEAD, E_TAIL = json.dumps({"id": "e", "choices": [], "ec_transfer_params": {"KEY": {
    "item_indices": [0], "metadata": {"image_grid_thw": [1, 4, 4]}}}}).encode().split(b"KEY")
UUID = re.compile(rb'"uuid"\s*:\s*"')
# The first characters of IMAGE's base64 payload, rewritten per request: a fresh image each.
IMAGE_AT = json.dumps(IMAGE).encode().index(b"base64,") + len(b"base64,")
STAMP_CHARS = 16
_stamps = itertools.count()
STORE_SIZES = {"lookups": 0, "lookups-1k": 1000, "lookups-10k": 10000}
"""The store arms: entries in each one's store before the run (none of them ever a hit)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _response(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


def _stream_response() -> list[bytes]:
    """The head, then each event as an HTTP chunk: one write each."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
    chunks = [f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in STREAM_EVENTS]
    chunks[-1] += b"0\r\n\r\n"
    return [head + b"\r\n\r\n" + chunks[0], *chunks[1:]]


class _FakeServer(asyncio.Protocol):
    """Keep-alive HTTP/1.1: answers every request after the delay with a canned body (E:
    keyed by the request's uuid; PD: a chunked SSE stream when the request asks for one)."""

    def __init__(self, answer: bytes | None, delay_s: float) -> None:
        self.answer = answer
        self.stream = _stream_response()
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
            answer: bytes | list[bytes] | None = (
                self.health if head.startswith(b"get /health") else self.answer)
            if answer is None:
                at = UUID.search(body).end()  # type: ignore[union-attr]
                answer = _response(E_HEAD + body[at:body.index(b'"', at)] + E_TAIL)
            elif answer is not self.health and IS_STREAM.search(body):
                answer = self.stream
            if self.delay_s:
                asyncio.get_running_loop().call_later(self.delay_s, self._write, answer)
            else:
                self._write(answer)

    def _write(self, answer: bytes | list[bytes]) -> None:
        for part in answer if isinstance(answer, list) else (answer,):
            if self.transport.is_closing():
                return
            self.transport.write(part)  # type: ignore[attr-defined]


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


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    """One whole response (content-length or chunked); its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    at = lower.find(b"content-length:")
    if at >= 0:
        await reader.readexactly(int(lower[at + 15:lower.find(b"\r\n", at)]))
        return head
    while True:  # chunked: size line, data, CRLF; a 0 size and a CRLF end it
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return head


async def _worker(port: int, request: bytes, deadline: float, lat: list[float],
                  stamp_at: int | None = None) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            writer.write(_stamped(request, stamp_at))
            head = await _read_answer(reader)
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
    warm_s = min(0.5, seconds)  # the tests' short runs warm up as long as they run
    await asyncio.gather(*(_worker(port, request, time.perf_counter() + warm_s, warm, stamp_at)
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
                 store: list[str], tree: Path = ROOT) -> subprocess.Popen:
    """`python -m epdctl.proxy` from `tree` (its cwd comes first on sys.path)."""
    return subprocess.Popen(
        [sys.executable, "-m", "epdctl.proxy", "--port", str(port), "--model", "m",
         "--encode", f"http://127.0.0.1:{e_port}",
         "--prefill-decode", f"http://127.0.0.1:{pd_port}",
         "--max-inflight", "4096", "--client", client, *store],
        cwd=tree, stderr=subprocess.DEVNULL)


def _start_peer(path: str, port: int, e_port: int, pd_port: int) -> subprocess.Popen:
    """vLLM's example proxy as shipped, E+PD (its own log lines are part of its cost)."""
    return subprocess.Popen(
        [sys.executable, path, "--host", "127.0.0.1", "--port", str(port),
         "--encode-servers-urls", f"http://127.0.0.1:{e_port}",
         "--prefill-servers-urls", "none",
         "--decode-servers-urls", f"http://127.0.0.1:{pd_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _fill_store(store_dir: str, namespace: str, entries: int) -> list[str]:
    """A namespace holding `entries` small entries under fresh content-like keys (64 hex
    digits, as the proxy's own keys): the proxy's --store-dir/--namespace flags."""
    from epdctl.cache.store import Store

    store = Store(store_dir, namespace).create()
    for n in range(entries):
        store.publish(f"{n:064x}", bytes(16), dtype="float32", shape=(4,))
    return ["--store-dir", store_dir, "--namespace", namespace]


Arm = tuple[str, int, dict[str, Any], "subprocess.Popen | None"]


def _alternated(arms: list[Arm], level_index: int) -> list[Arm]:
    """A B .. Z Z .. B A, the first arm rotating from level to level: what comes first or
    last at a level (a warmer proxy, a busier machine) weighs on every arm alike; each arm's
    figure at the level is the mean of its two runs."""
    shift = level_index % len(arms)
    order = arms[shift:] + arms[:shift]
    return order + order[::-1]


def _arms(level_index: int, proxies: dict[str, tuple[int, subprocess.Popen]],
          pd_port: int) -> list[Arm]:
    """One level's rows in order: (name, port, body, the proxy whose CPU is counted)."""
    port, plain = proxies["plain"]
    rows: list[Arm] = [("direct", pd_port, TEXT, None)]
    text: list[Arm] = [("proxy", port, TEXT, plain)]
    stream: list[Arm] = [("proxy-stream", port, STREAM, plain)]
    for other in ("peer", "before"):
        if other in proxies:
            other_port, proc = proxies[other]
            text.append((other, other_port, TEXT, proc))
            stream.append((f"{other}-stream", other_port, STREAM, proc))
    for arms in (text, stream):
        rows += _alternated(arms, level_index) if len(arms) > 1 else arms
    images: list[Arm]
    if "lookups" not in proxies:
        images = [("proxy-image", port, IMAGE, plain)]
    else:
        images = [(f"image-{arm}", proxies[arm][0], IMAGE, proxies[arm][1])
                  for arm in STORE_SIZES if arm in proxies]
        images.insert(1, ("image-no-lookups", port, IMAGE, plain))
    if "peer" in proxies:
        images.append(("peer-image", proxies["peer"][0], IMAGE, proxies["peer"][1]))
    if "before" in proxies:
        images.append(("before-image-no-lookups", proxies["before"][0], IMAGE,
                       proxies["before"][1]))
        if "before-lookups" in proxies:
            lookups_port, lookups = proxies["before-lookups"]
            images.append(("before-image-lookups", lookups_port, IMAGE, lookups))
    return rows + (_alternated(images, level_index) if len(images) > 1 else images)


BEFORE_PATHS = {"text": ("proxy", "before"), "stream": ("proxy-stream", "before-stream"),
                "image": ("image-no-lookups", "before-image-no-lookups"),
                "lookups": ("image-lookups", "before-image-lookups")}
"""Each path's arm on this tree and on --before's."""
RPS_NOISE = 0.95
P50_NOISE_MS = 0.05
"""A path is "worse" than before when its best req/s is under RPS_NOISE of before's, or its
added p50 over before's by more than P50_NOISE_MS and 10 %: what two runs of one tree
differ by on a 2-core machine."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--levels", default="1,8,32,64")
    p.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    p.add_argument("--no-store", dest="has_store", action="store_false",
                   help="no store arms: one proxy, without an EC store (no lookups)")
    p.add_argument("--peer", metavar="PATH",
                   help="vLLM's examples/disaggregated/disaggregated_encoder/"
                        "disagg_epd_proxy.py, run beside epdctl's proxy")
    p.add_argument("--before", metavar="CHECKOUT", type=Path,
                   help="another epdctl checkout whose proxy runs beside this one: the "
                        "before/after verdict per path")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="each level's alternation N times (each arm's figure at a level is "
                        "then the mean of 2N runs)")
    p.add_argument("--fakes", nargs=3, type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.fakes:
        _run(_serve_fakes(int(a.fakes[0]), int(a.fakes[1]), a.fakes[2]))
        return
    if a.peer and not os.path.isfile(a.peer):
        p.error(f"--peer: no file {a.peer}")
    if a.before and not (a.before / "epdctl" / "proxy" / "__main__.py").is_file():
        p.error(f"--before: no epdctl checkout at {a.before}")
    e_port, pd_port = free_port(), free_port()
    fakes = subprocess.Popen([sys.executable, __file__, "--fakes", str(e_port), str(pd_port),
                              str(a.delay_ms / 1000)])
    store_dir = tempfile.mkdtemp(prefix="epdctl-bench-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stores: dict[str, list[str]] = {"plain": []}
    proxies: dict[str, tuple[int, subprocess.Popen]] = {}
    try:
        if a.has_store:
            for n, (arm, entries) in enumerate(STORE_SIZES.items()):
                if a.before and entries:
                    continue  # a before/after run: fewer proxies, less noise
                stores[arm] = _fill_store(store_dir, f"bench{n}-0123456789ab", entries)
        for arm, store in stores.items():
            port = free_port()
            proxies[arm] = (port, _start_proxy(port, e_port, pd_port, a.client, store))
        if a.before:
            befores: dict[str, list[str]] = {"before": []}
            if a.has_store:
                befores["before-lookups"] = _fill_store(store_dir, "before-0123456789ab", 0)
            for arm, store in befores.items():
                port = free_port()
                proxies[arm] = (port, _start_proxy(port, e_port, pd_port, a.client, store,
                                                   a.before.resolve()))
        if a.peer:
            port = free_port()
            proxies["peer"] = (port, _start_peer(a.peer, port, e_port, pd_port))
        for port in (e_port, pd_port, *(port for port, _ in proxies.values())):
            _wait_port(port)
        rows = []
        levels = [int(x) for x in a.levels.split(",")]
        for n, level in enumerate(lvl for lvl in levels for _ in range(a.repeat)):
            for name, port, body, proxy in _arms(n, proxies, pd_port):
                cpu_before = _cpu_s(proxy.pid) if proxy else 0.0
                result: dict = _run(_load(port, body, level, a.seconds))  # type: ignore
                # Proxy CPU per request (warm-up included): robust on a busy machine.
                cpu_us = (_cpu_s(proxy.pid) - cpu_before) * 1e6 / max(result["n"], 1) \
                    if proxy else 0.0
                result["cpu_us"] = cpu_us
                rows.append((level, name, result))
                print(f"c={level:<4} {name:<17} rps={result['rps']:8.0f} "
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
    line = _summary(rows)
    if a.before:
        table, extra = _before_after(rows)
        print(table)
        line += extra
    print(line)


def _runs(rows: list[tuple[int, str, dict]]) -> dict[tuple[int, str], list[dict]]:
    """Each (level, arm)'s runs, in order."""
    runs: dict[tuple[int, str], list[dict]] = {}
    for lvl, name, res in rows:
        runs.setdefault((lvl, name), []).append(res)
    return runs


def _summary(rows: list[tuple[int, str, dict]]) -> str:
    """The key=value line: text overhead at the first level, best req/s, the ratios."""
    first = rows[0][0]
    runs = _runs(rows)
    by = {key: {k: statistics.fmean(r[k] for r in results) for k in ("rps", "p50_ms", "p99_ms")}
          for key, results in runs.items()}
    best = {name: max(res["rps"] for (_, n), res in by.items() if n == name)
            for _, name in by}
    added_p50 = by[(first, "proxy")]["p50_ms"] - by[(first, "direct")]["p50_ms"]
    added_p99 = by[(first, "proxy")]["p99_ms"] - by[(first, "direct")]["p99_ms"]
    line = (f"added_p50_ms={added_p50:.3f} added_p99_ms={added_p99:.3f} "
            f"max_rps={best['proxy']:.0f}")
    peer = ""
    if "peer" in best:
        image = "image-lookups" if "image-lookups" in best else "proxy-image"
        last = rows[-1][0]
        cpu = {name: statistics.fmean(r["cpu_us"] for r in results)
               for (lvl, name), results in runs.items() if lvl == last}
        peer = (f" text_cpu_ratio_peer={cpu['proxy'] / cpu['peer']:.3f}"
                f" stream_cpu_ratio_peer={cpu['proxy-stream'] / cpu['peer-stream']:.3f}"
                f" image_cpu_ratio_peer={cpu[image] / cpu['peer-image']:.3f}"
                f" text_rps_ratio_peer={best['proxy'] / best['peer']:.3f}"
                f" stream_rps_ratio_peer={best['proxy-stream'] / best['peer-stream']:.3f}"
                f" image_rps_ratio_peer={best[image] / best['peer-image']:.3f}")
    if "proxy-image" in best:
        return f"{line} max_rps_image={best['proxy-image']:.0f}" \
               f" max_rps_stream={best['proxy-stream']:.0f}{peer}"
    p50_ratio = by[(first, "image-lookups")]["p50_ms"] / by[(first, "image-no-lookups")]["p50_ms"]
    none = best["image-lookups"]
    line = (f"{line} max_rps_image={none:.0f} "
            f"image_rps_ratio_lookups={none / best['image-no-lookups']:.3f} "
            f"image_p50_ratio_lookups={p50_ratio:.3f} "
            f"max_rps_stream={best['proxy-stream']:.0f}")
    if "image-lookups-1k" not in best:  # a before/after run
        return line + peer
    return (f"{line} image_rps_ratio_1k={best['image-lookups-1k'] / none:.3f}{peer} "
            f"image_rps_ratio_10k={best['image-lookups-10k'] / none:.3f}")


def _before_after(rows: list[tuple[int, str, dict]]) -> tuple[str, str]:
    """The before/after table and its key=value additions: per path, best req/s and added
    p50 at the first level, each arm's figure the mean of its runs at the level."""
    first = rows[0][0]
    runs = _runs(rows)
    rps = {key: statistics.fmean(r["rps"] for r in results) for key, results in runs.items()}
    best = {name: max(v for (_, n), v in rps.items() if n == name) for _, name in rps}
    direct = statistics.fmean(r["p50_ms"] for r in runs[(first, "direct")])
    lines = [f"{'path':<8} {'req/s after':>12} {'before':>8} {'ratio':>6}   "
             f"{'added p50 after':>15} {'before':>7}   verdict"]
    extra, is_worse = "", False
    for path, (after, before) in BEFORE_PATHS.items():
        if after not in best or before not in best:
            continue
        added = {arm: statistics.fmean(r["p50_ms"] for r in runs[(first, arm)]) - direct
                 for arm in (after, before)}
        ratio = best[after] / best[before]
        worse = ratio < RPS_NOISE or (added[after] > added[before] * 1.1 + P50_NOISE_MS)
        is_worse |= worse
        lines.append(f"{path:<8} {best[after]:>12.0f} {best[before]:>8.0f} {ratio:>6.3f}   "
                     f"{added[after]:>13.3f}ms {added[before]:>5.3f}ms   "
                     f"{'worse' if worse else 'no worse'}")
        extra += (f" {path}_rps_ratio_before={ratio:.3f} {path}_p50_added_ms={added[after]:.3f}"
                  f" {path}_p50_added_ms_before={added[before]:.3f}")
    return "\n".join(lines), extra + f" before_verdict={'worse' if is_worse else 'ok'}"


if __name__ == "__main__":
    main()
