"""Cross-request encoder-cache reuse: the proxy skips E for images already in the EC store.

    .venv/bin/python benchmarks/cache_reuse.py [--requests 160] [--rate R | --concurrency 8]
        [--e-delay-ms 40] [--e-slots 2] [--pd-delay-ms 20]
    .venv/bin/python benchmarks/cache_reuse.py --real    # topologies/cpu-demo.yaml, real vLLM

One workload with half its images repeated (new and repeated images alternate; each image
comes back once, well after its first answer), sent through a proxy with the skip off and
through one with it on, taking turns off, on, on, off (half the requests per turn), after a
warm-up of WARMUP requests per proxy that is not counted; each turn has images of its own,
so none finds another's entries. Streaming chat requests arrive at --rate (Poisson; by
default 90 % of the fake E's capacity, so without the skip requests queue for E), or from a
closed loop of --concurrency clients (--rate 0, the default with --real). Prints E
sub-requests and TTFT p50/p90 per arm and their ratios (on / off), ending with one key=value
line that gives each ratio's spread too (`_spread=LOW-HIGH`: the ratio of each off/on pair
of turns).

Fakes (default): one process serves a fake E that takes --e-delay-ms per item, at most
--e-slots at a time, and then saves the item into a temporary store (as a real E does before
it answers), and a fake PD that streams its answer after --pd-delay-ms; each arm's proxy is
`python -m epdctl.proxy`, its own process. --real brings cpu-demo.yaml up (tiny LLaVA, a
private state dir and store; run it alone: it takes both CPU cores) and adds a second proxy
with the skip off before the same E and PD; E sub-requests are then E's own count
(`vllm:request_success_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
EMBED_SHAPE = (576, 1024)  # LLaVA-1.5's 576 image tokens, float16: 1.1 MiB an entry
ORDER = ("off", "on", "on", "off")
"""The arms' turns: A B B A, so a drift in the machine's load favours neither."""
WARMUP = 4
SSE = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}\n\n'
       b"data: [DONE]\n\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 in {timeout_s:.0f}s")


def workload(n: int, seed: int, make: Any, lag: int) -> list[str]:
    """n data URLs, n/2 of them repeats: new and repeated images alternate once `lag` new
    ones are out, and each image comes back `lag` new images later (long after its first
    answer: at most `lag / 3` requests are in flight), so E's load halves throughout."""
    images = [make(seed * 100_000 + i) for i in range(n - n // 2)]
    out: list[str] = []
    pending: list[str] = []
    for image in images:
        out.append(image)
        pending.append(image)
        if len(pending) > lag and len(out) < n:
            out.append(pending.pop(0))
    return (out + pending)[:n]


def fake_image(seed: int) -> str:
    data = random.Random(seed).randbytes(48 * 1024)  # the fakes never decode it
    return "data:image/png;base64," + base64.b64encode(data).decode()


def png_image(seed: int) -> str:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(56, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _one(session: Any, url: str, model: str, image: str) -> float:
    """TTFT of one streamed request: until the first chunk with generated text."""
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}},
                {"type": "text", "text": "What is in the image?"}]}]}
    start = time.perf_counter()
    ttft = None
    async with session.post(url + CHAT, json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
        buf = b""
        async for chunk in reply.content.iter_any():
            buf += chunk
            while ttft is None and b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                if data != b"[DONE]" and _has_text(data):
                    ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream carried no text")
    return ttft


def _has_text(data: bytes) -> bool:
    try:
        choices = json.loads(data).get("choices") or [{}]
    except ValueError:
        return False
    return bool((choices[0].get("delta") or {}).get("content"))


async def _drive(url: str, model: str, images: list[str], concurrency: int,
                 rate: float) -> list[float]:
    """TTFTs: a closed loop of `concurrency` clients, or (rate > 0) Poisson arrivals."""
    import aiohttp

    todo = iter(images)
    ttfts: list[float] = []

    async def client(session: Any) -> None:
        for image in todo:
            ttfts.append(await _one(session, url, model, image))

    async def arrive(session: Any, at: float, image: str) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        ttfts.append(await _one(session, url, model, image))

    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if rate <= 0:
            await asyncio.gather(*(client(session) for _ in range(concurrency)))
            return ttfts
        rng, at = random.Random(7), time.perf_counter()
        arrivals = []
        for image in images:
            at += rng.expovariate(rate)
            arrivals.append(arrive(session, at, image))
        await asyncio.gather(*arrivals)
    return ttfts


def drive(url: str, model: str, images: list[str], a: argparse.Namespace) -> list[float]:
    return asyncio.run(_drive(url, model, images, a.concurrency, a.rate))


def repeat_lag(a: argparse.Namespace) -> int:
    """New images between an image and its repeat: well past its first answer."""
    return max(3 * a.concurrency, int(a.rate / 2))


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def _serve_fakes(e_port: int, pd_port: int, store_dir: str, namespace: str, e_delay_s: float,
                 e_slots: int, pd_delay_s: float) -> None:
    from aiohttp import web

    from epdctl.cache.store import Store

    store = Store(store_dir, namespace).create()
    payload = bytes(EMBED_SHAPE[0] * EMBED_SHAPE[1] * 2)
    count = {"e": 0}

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    slots = asyncio.Semaphore(e_slots)  # bound to a loop at first use (Python >= 3.10)

    async def encode(request: web.Request) -> web.Response:
        key = (await request.json())["messages"][0]["content"][0]["uuid"]
        async with slots:  # an encoder runs a few items at a time: the rest queue
            await asyncio.sleep(e_delay_s)
            store.publish(key, payload, dtype="float16", shape=EMBED_SHAPE)
        count["e"] += 1
        return web.json_response({"id": "e", "choices": [], "ec_transfer_params": {
            key: {"item_indices": [0], "metadata": {}}}})

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(pd_delay_s)
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        await reply.write(SSE)
        await reply.write_eof()
        return reply

    async def counted(_: web.Request) -> web.Response:
        return web.json_response(count)

    async def main() -> None:
        for port, route in ((e_port, encode), (pd_port, generate)):
            app = web.Application(client_max_size=64 << 20)
            app.add_routes([web.get("/health", health), web.post(CHAT, route),
                            web.get("/count", counted)])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def _proxy(port: int, model: str, e_url: str, pd_url: str, store: tuple[str, str],
           is_on: bool, upstream_key: str | None = None) -> subprocess.Popen[bytes]:
    return extra_proxy(port, model, e_url, pd_url, store, upstream_key,
                       "--skip-cached-items" if is_on else "--no-skip-cached-items")


def extra_proxy(port: int, model: str, e_url: str, pd_url: str, store: tuple[str, str],
                upstream_key: str | None, *flags: str) -> subprocess.Popen[bytes]:
    """`python -m epdctl.proxy` before these E and PD, over this store, with these flags."""
    from epdctl.proxy.config import UPSTREAM_KEY_ENV

    env = {**os.environ, **({UPSTREAM_KEY_ENV: upstream_key} if upstream_key else {})}
    argv = [sys.executable, "-m", "epdctl.proxy", "--port", str(port), "--model", model,
            "--encode", e_url, "--prefill-decode", pd_url, "--max-inflight", "4096",
            "--store-dir", store[0], "--namespace", store[1], *flags]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)


def run_fakes(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    store_dir = tempfile.mkdtemp(prefix="epdctl-bench-", dir=base)
    namespace = "bench-" + os.urandom(6).hex()
    e_port, pd_port = free_port(), free_port()
    fakes = subprocess.Popen([sys.executable, __file__, "--fakes", str(e_port), str(pd_port),
                              store_dir, namespace, str(a.e_delay_ms / 1000),
                              str(a.e_slots), str(a.pd_delay_ms / 1000)], cwd=ROOT)
    procs = [fakes]
    try:
        wait_http(f"http://127.0.0.1:{e_port}/health")
        proxies = {}
        for name in ("off", "on"):
            port = free_port()
            procs.append(_proxy(port, "m", f"http://127.0.0.1:{e_port}",
                                f"http://127.0.0.1:{pd_port}", (store_dir, namespace),
                                name == "on"))
            proxies[name] = f"http://127.0.0.1:{port}"
            wait_http(f"{proxies[name]}/health")
        return take_turns(proxies, "m", fake_image, a,
                          lambda: _json(f"http://127.0.0.1:{e_port}/count")["e"])
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(store_dir, ignore_errors=True)


def take_turns(proxies: dict[str, str], model: str, make: Any, a: argparse.Namespace,
               e_count: Any) -> dict[str, dict[str, Any]]:
    """A warm-up per proxy (not counted), then the turns in ORDER, each with images of its
    own: per arm, every turn's TTFTs and E sub-requests."""
    for n, name in enumerate(proxies):
        drive(proxies[name], model, [make(10**6 + n * WARMUP + i) for i in range(WARMUP)], a)
    arms: dict[str, dict[str, Any]] = {name: {"turns": []} for name in proxies}
    per_turn = max(2, a.requests // 2)
    for n, name in enumerate(ORDER):
        before = e_count()
        ttfts = drive(proxies[name], model, workload(per_turn, n + 1, make, repeat_lag(a)), a)
        arms[name]["turns"].append({"ttfts": ttfts, "e_requests": e_count() - before})
    for arm in arms.values():
        arm["ttfts"] = [t for turn in arm["turns"] for t in turn["ttfts"]]
        arm["e_requests"] = sum(turn["e_requests"] for turn in arm["turns"])
    return arms


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _e_finished(url: str, key: str | None) -> float:
    """E's finished requests, from vLLM's own /metrics (the run's internal key)."""
    request = urllib.request.Request(url + "/metrics", headers={
        "authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(m[1]) for m in re.finditer(r"^vllm:request_success_total\{.*\} (\S+)$",
                                                text, re.M))


@dataclass(frozen=True)
class Demo:
    """A running cpu-demo topology: instance URLs, its store, the key instances require."""

    urls: dict[str, str]
    store: tuple[str, str]  # store dir, namespace
    key: str | None
    model: str


@contextlib.contextmanager
def cpu_demo(name: str) -> Iterator[Demo]:
    """topologies/cpu-demo.yaml up (tiny LLaVA, a private state dir and store), then down
    and every file of it removed."""
    import yaml

    from epdctl.dev.tiny_models import ensure_model
    from epdctl.launch.state import RunState

    model = ensure_model("llava")
    tmp = Path(tempfile.mkdtemp(prefix="epdctl-bench-"))
    store_dir = f"/dev/shm/epdctl-bench-{os.urandom(4).hex()}"
    data = yaml.safe_load((ROOT / "topologies" / "cpu-demo.yaml").read_text())
    data.update(model=str(model), name=name, cache={**data["cache"], "dir": store_dir},
                proxy={"port": free_port()}, ports={"base": free_port(),
                                                    "side_channel_base": free_port()})
    topology = tmp / "cpu-demo.yaml"
    topology.write_text(yaml.safe_dump(data, sort_keys=False))
    cli = [sys.executable, "-m", "epdctl", "--state-dir", str(tmp / "state")]
    try:
        up = subprocess.run([*cli, "up", str(topology), "-d", "--timeout", "400"], cwd=ROOT)
        if up.returncode != 0:
            raise RuntimeError("`epdctl up` failed")
        state = RunState.model_validate_json(
            (tmp / "state" / name / "state.json").read_text())
        yield Demo({s.name: f"http://127.0.0.1:{s.port}" for s in state.specs},
                   (store_dir, state.namespace), state.internal_key, data["served_model_name"])
    finally:
        subprocess.run([*cli, "down", "--name", name], cwd=ROOT)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)


def run_real(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    off = None
    with cpu_demo("cache-reuse-bench") as demo:
        try:
            port = free_port()
            off = _proxy(port, demo.model, demo.urls["encode-0"], demo.urls["pd-0"],
                         demo.store, False, demo.key)
            wait_http(f"http://127.0.0.1:{port}/health")
            proxies = {"off": f"http://127.0.0.1:{port}", "on": demo.urls["proxy"]}
            return take_turns(proxies, demo.model, png_image, a, lambda: round(
                _e_finished(demo.urls["encode-0"], demo.key)))
        finally:
            if off is not None:
                off.terminate()
                off.wait(10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s, Poisson arrivals (0: the closed loop); default 0.9 x "
                        "the fake E's capacity (--e-slots / --e-delay-ms), 0 with --real")
    p.add_argument("--e-delay-ms", type=float, default=40.0)
    p.add_argument("--e-slots", type=int, default=2)
    p.add_argument("--pd-delay-ms", type=float, default=20.0)
    p.add_argument("--real", action="store_true", help="topologies/cpu-demo.yaml, real vLLM")
    p.add_argument("--fakes", nargs=7, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.fakes:
        e, pd, store_dir, ns, e_delay, slots, pd_delay = a.fakes
        _serve_fakes(int(e), int(pd), store_dir, ns, float(e_delay), int(slots),
                     float(pd_delay))
        return
    if a.real and a.concurrency == p.get_default("concurrency"):
        a.concurrency = 4  # cpu-demo.yaml serves 4 sequences at a time
    if a.rate is None:
        # Without the skip, E runs at 90 % of its capacity: requests queue for it.
        a.rate = 0.0 if a.real else 0.9 * a.e_slots / (a.e_delay_ms / 1000)
    arms = run_real(a) if a.real else run_fakes(a)
    rows = {}
    for name, arm in arms.items():
        ttfts = sorted(arm["ttfts"])
        rows[name] = {"e": arm["e_requests"], "p50": statistics.median(ttfts),
                      "p90": quantile(ttfts, 0.9)}
        print(f"skip {name:<3}  requests={len(ttfts)}  e_requests={arm['e_requests']:<4} "
              f"ttft_p50={rows[name]['p50'] * 1000:7.1f}ms  "
              f"ttft_p90={rows[name]['p90'] * 1000:7.1f}ms", flush=True)
    on, off = rows["on"], rows["off"]
    pairs = [(arms["off"]["turns"][0], arms["on"]["turns"][0]),
             (arms["off"]["turns"][1], arms["on"]["turns"][1])]
    print(f"e_requests_ratio={on['e'] / max(off['e'], 1):.2f} "
          f"e_requests_ratio_spread={spread(pairs, lambda t: t['e_requests'])} "
          f"ttft_p50_ratio={on['p50'] / off['p50']:.2f} "
          f"ttft_p50_ratio_spread={spread(pairs, lambda t: statistics.median(t['ttfts']))} "
          f"ttft_p90_ratio={on['p90'] / off['p90']:.2f} "
          f"ttft_p90_ratio_spread={spread(pairs, lambda t: quantile(sorted(t['ttfts']), 0.9))}")


def spread(pairs: list[tuple[dict[str, Any], dict[str, Any]]], figure: Any) -> str:
    """LOW-HIGH of on / off over the pairs of turns."""
    ratios = [figure(on) / max(figure(off), 1e-9) for off, on in pairs]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


if __name__ == "__main__":
    main()
