"""Bounded load on a real CPU topology (tiny Qwen2-VL, E|PD with the metadata rewrite).

First, deterministically: an entry E could not save is never reported (PD gets the image),
and a rewritten request (image replaced by E's metadata) whose entry is evicted before PD
pins it fails alone in PD, and the proxy resends it with the image.
Then eight clients send mixed requests (text, fresh images, repeated images, two images,
streaming or not) through the proxy for LOAD_S seconds, into an EC store whose budget holds
only a handful of entries and whose grace is one second, so the janitor evicts all the time
and a rewritten request can find its entry gone (PD fails it, the proxy resends the image).
Every request must come back exactly once, complete or with a clear error; memory and the
store must stay bounded; no engine may die.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from epdctl.proxy.config import UPSTREAM_KEY_ENV
from tests.harness import TopologyRun, edited_topology, process_up, proxy_spec, store_root
from tests.reliability.helpers import wait_for
from tests.reliability.probe import Probe, answer, body, broken_store, image, streamed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny-qwen2vl"
LOAD_S = float(os.environ.get("EPDCTL_LOAD_SECONDS", "30"))
WARMUP_S = 6.0
CONCURRENCY = 8
CAPACITY = 48 << 10  # ~8 entries of a 56 px image (4 KiB header + 4 x 128 float32)
JANITOR_WAIT_S = 30.0  # the supervisor's janitor runs every 5 s; entries need 1 s of age
RSS_SLACK = 256 << 20
KINDS = ("text", "fresh", "repeat-stream", "fresh-stream", "two", "text-stream")
REPEATED = (501, 502, 503)


@pytest.fixture(scope="module")
def run(tiny_qwen2vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TopologyRun]:
    tmp = tmp_path_factory.mktemp("load")
    with store_root(tmp, size="64m") as (cache_dir, _):

        def change(data: dict[str, Any]) -> None:
            data["cache"].update(capacity=CAPACITY, grace="1s", ttl="10m")

        with edited_topology("cpu-qwen2vl", tmp, tiny_qwen2vl, cache_dir, change) as running:
            yield running


def _fallbacks(proxy: str) -> dict[str, float]:
    """The proxy's fallback counters by reason."""
    metrics = httpx.get(f"{proxy}/metrics", timeout=10).text
    found = re.findall(r'epdctl_proxy_fallbacks_total\{reason="(\w+)"\} (\S+)', metrics)
    return {reason: float(value) for reason, value in found}


@contextmanager
def evicting_proxy(run: TopologyRun, entries: Path) -> Iterator[tuple[str, list[str]]]:
    """A second proxy before the same PD, whose encoder is E behind a shim that deletes
    every entry E reports before passing E's answer on: each one is evicted after E saved
    and reported it and before PD can pin it. Yields the proxy URL and the keys deleted."""
    import http.client
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from epdctl.cache._format import ENTRY_SUFFIX, key_filename

    specs = {s.name: s for s in run.state().specs}
    e_port = specs["encode-0"].port
    deleted: list[str] = []

    class Shim(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _relay(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            data = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection("127.0.0.1", e_port, timeout=60)
            headers = {"content-type": "application/json"} if data else {}
            if self.headers.get("authorization"):  # the run's internal key, E wants it
                headers["authorization"] = self.headers["authorization"]
            conn.request(method, self.path, data, headers)
            reply = conn.getresponse()
            payload = reply.read()
            conn.close()
            if method == "POST" and reply.status == 200:
                for key in json.loads(payload).get("ec_transfer_params") or {}:
                    os.unlink(entries / f"{key_filename(key)}{ENTRY_SUFFIX}")
                    deleted.append(key)
            self.send_response(reply.status)
            self.send_header("content-type", reply.getheader("content-type") or "")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            self._relay("GET")

        def do_POST(self) -> None:
            self._relay("POST")

    shim = ThreadingHTTPServer(("127.0.0.1", 0), Shim)
    threading.Thread(target=shim.serve_forever, daemon=True).start()
    spec = proxy_spec("evicting-proxy", run.run_dir / "logs" / "evicting-proxy.log",
                      ("--model", MODEL, "--encode", f"http://127.0.0.1:{shim.server_address[1]}",
                       "--prefill-decode", f"http://127.0.0.1:{specs['pd-0'].port}"),
                      env={UPSTREAM_KEY_ENV: run.state().internal_key})
    try:
        with process_up(spec, run.run_dir) as proxy:
            yield proxy.url, deleted
    finally:
        shim.shutdown()
        shim.server_close()


def test_missing_entries_with_the_metadata_rewrite(run: TopologyRun) -> None:
    """E cannot save: it reports nothing, so PD gets the image. E saved and reported the
    entry but it is evicted before PD pins it: PD fails only that metadata-only request (no
    engine death) and the proxy resends it with the image. Every answer is still right."""
    from epdctl.cache.store import Store

    probe = Probe(run)
    store = Store(run.cache_dir, run.state().namespace)
    seeds = (801, 802, 803, 804)
    refs = [answer(probe.urls["pd-0"], body(MODEL, urls=(image(s)[1],), uuid_=f"ref-{s}"),
                   key=probe.key)
            for s in seeds]

    def ask(seed: int, *, stream: bool) -> str:
        request = body(MODEL, urls=(image(seed)[1],))
        return streamed(probe.proxy, request) if stream else answer(probe.proxy, request)

    before = _fallbacks(probe.proxy).get("rewrite", 0.0)
    e_at = probe.mark("encode-0")
    with broken_store(run):
        assert [ask(801, stream=False), ask(802, stream=True)] == refs[:2]
    assert probe.wait_logged("encode-0", e_at, f"EC store: could not save {image(801)[0]}")
    assert _fallbacks(probe.proxy).get("rewrite", 0.0) == before  # nothing was rewritten

    pd_at = probe.mark("pd-0")
    with evicting_proxy(run, store.entries) as (proxy, deleted):
        got = [answer(proxy, body(MODEL, urls=(image(803)[1],))),
               streamed(proxy, body(MODEL, urls=(image(804)[1],)))]
        rewrites = _fallbacks(proxy).get("rewrite", 0.0)
    assert got == refs[2:]
    assert deleted == [image(803)[0], image(804)[0]]
    for key in deleted:
        assert probe.wait_logged("pd-0", pd_at, f"EC store miss for {key} (missing) and request")
    assert rewrites == 2
    status = probe.status()
    assert {n: (r["state"], r["restarts"]) for n, r in status.items()} == dict.fromkeys(
        status, ("ready", 0))


class Load:
    """Sends, and tallies: what was sent, what came back (by x-request-id), and how."""

    def __init__(self, proxy: str) -> None:
        self.proxy = proxy
        self.seeds = itertools.count(10_000)
        self.lock = threading.Lock()
        self.sent: list[str] = []
        self.echoed: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()

    def request(self, kind: str) -> dict[str, Any]:
        with self.lock:
            fresh = next(self.seeds)
        urls: tuple[str, ...] = ()
        if "fresh" in kind:
            urls = (image(fresh)[1],)
        elif "repeat" in kind:
            urls = (image(REPEATED[fresh % len(REPEATED)])[1],)
        elif kind == "two":
            urls = (image(fresh)[1], image(REPEATED[fresh % len(REPEATED)])[1])
        return body(MODEL, urls=urls, stream=kind.endswith("stream"))

    def one(self, client: httpx.Client, rid: str, kind: str) -> str:
        """Send one request; its outcome: ok, error:<why> (clear) or unclear:<why>."""
        request = self.request(kind)
        headers = {"x-request-id": rid}
        try:
            if not request["stream"]:
                reply = client.post("/v1/chat/completions", json=request, headers=headers)
                self._echo(reply)
                if reply.status_code == 200:
                    return "ok" if "choices" in reply.json() else "unclear:200-shape"
                return _clear_error(reply)
            with client.stream("POST", "/v1/chat/completions", json=request,
                               headers=headers) as reply:
                self._echo(reply)
                if reply.status_code != 200:
                    reply.read()
                    return _clear_error(reply)
                events = [line for line in reply.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as exc:
            return f"unclear:{type(exc).__name__}"
        if events and events[-1] == "data: [DONE]":
            return "ok" if not any('"error"' in e for e in events) else "unclear:error+done"
        if events and "error" in json.loads(events[-1].removeprefix("data: ")):
            return "error:stream"
        return "unclear:truncated-stream"

    def _echo(self, reply: httpx.Response) -> None:
        with self.lock:
            self.echoed.append(reply.headers.get("x-request-id", "<none>"))

    def worker(self, n: int, until: float, tag: str) -> None:
        with httpx.Client(base_url=self.proxy, timeout=120) as client:
            for i in itertools.count():
                if time.monotonic() >= until:
                    return
                rid, kind = f"{tag}-{n}-{i}", KINDS[(n + i) % len(KINDS)]
                with self.lock:
                    self.sent.append(rid)
                outcome = self.one(client, rid, kind)
                with self.lock:
                    self.outcomes[outcome] += 1
                    self.kinds[kind] += 1

    def drive(self, seconds: float, tag: str) -> None:
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=self.worker, args=(n, until, tag))
                   for n in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=seconds + 300)
        assert not any(t.is_alive() for t in threads), "a client hung past its timeout"


def _clear_error(reply: httpx.Response) -> str:
    try:
        error = reply.json()["error"]
        assert error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"unclear:{reply.status_code}"
    return f"error:{reply.status_code}"


class StoreWatch(threading.Thread):
    """Samples the namespace's entry bytes twice a second: each sample, the largest, and when
    each entry was first seen."""

    def __init__(self, entries: Path) -> None:
        super().__init__(daemon=True)
        self.entries = entries
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self.first_seen: dict[str, float] = {}
        self.stop = threading.Event()

    def bytes_now(self) -> int:
        total = 0
        now = time.monotonic()
        for path in self.entries.glob("*.ec"):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
            self.first_seen.setdefault(path.name, now)
        return total

    def run(self) -> None:
        while not self.stop.wait(0.5):
            size = self.bytes_now()
            self.samples.append((time.monotonic(), size))
            self.peak = max(self.peak, size)

    def new_before(self, at: float, window_s: float) -> int:
        """How many entries were first seen in the `window_s` seconds up to `at`."""
        return sum(at - window_s < seen <= at for seen in self.first_seen.values())


def test_mixed_load_loses_nothing(run: TopologyRun) -> None:
    from epdctl.cache.stats import read_stats
    from epdctl.cache.store import Store

    probe = Probe(run)
    store = Store(run.cache_dir, run.state().namespace)
    reference = answer(probe.urls["pd-0"], body(MODEL, urls=(image(77)[1],), uuid_="ref-77"),
                       key=probe.key)

    load = Load(probe.proxy)
    load.drive(WARMUP_S, "warm")  # first requests allocate; measure memory after them
    rss_before = probe.tree_rss()
    load = Load(probe.proxy)
    watch = StoreWatch(store.entries)
    watch.start()
    begin = time.monotonic()
    load.drive(LOAD_S, "load")
    elapsed = time.monotonic() - begin
    # The janitor brings the store back under its budget, and the proxy's request log is
    # flushed, each on its own clock: wait for both.
    is_settled = wait_for(lambda: watch.bytes_now() <= CAPACITY, JANITOR_WAIT_S, 0.5)
    watch.stop.set()
    watch.join()
    pattern = re.compile(r"rid=(load-\d+-\d+) ")
    assert wait_for(lambda: Counter(pattern.findall(run.log("proxy"))) == Counter(load.sent),
                    10), "the proxy's request log disagrees"
    rss_after = probe.tree_rss()
    counts = read_stats(store.root)[0]
    fallbacks = _fallbacks(probe.proxy)
    settled = watch.bytes_now()
    print(f"\nload: {len(load.sent)} requests in {elapsed:.0f}s at concurrency {CONCURRENCY}; "
          f"outcomes {dict(load.outcomes)}; kinds {dict(load.kinds)}")
    print(f"store: peak {watch.peak} B, settled {settled} B, budget {CAPACITY} B; "
          f"saves {counts['saves']:.0f} hits {counts['hits']:.0f} misses {counts['misses']:.0f} "
          f"invalid {counts['invalid']:.0f}; proxy fallbacks {fallbacks}")
    print(f"rss MiB before {_mib(rss_before)} after {_mib(rss_after)}")

    # Every request came back exactly once, under its own id, complete or with a clear error.
    assert Counter(load.echoed) == Counter(load.sent)
    assert sum(load.outcomes.values()) == len(load.sent)
    unclear = {k: v for k, v in load.outcomes.items() if not k.startswith(("ok", "error:"))}
    assert unclear == {}
    # Nothing lost: a request whose entry was evicted under it is resent with its image by
    # the proxy, so none fails (errors would be clear ones, but there must be none).
    assert load.outcomes == Counter(ok=len(load.sent)), load.outcomes
    assert len(load.sent) >= 4 * CONCURRENCY, "too little load to prove anything"
    assert set(load.kinds) == set(KINDS)

    # The store stayed within its budget, although far more than that was written.
    entry_bytes = os.path.getsize(store.entry_path(image(REPEATED[0])[0])) if store.has_entry(
        image(REPEATED[0])[0]) else 4096 + 4 * 128 * 4
    assert counts["saves"] * entry_bytes > 3 * CAPACITY, "eviction was never needed"
    assert is_settled and settled <= CAPACITY
    # Between two janitor passes the store grows by what E saves; a pass takes it back to
    # the budget but keeps entries younger than the grace (1 s: saved, or touched by a hit,
    # as the repeated images are all along) and pinned ones (at most one per client). So no
    # sample exceeds the budget by more than the entries new in one janitor period plus the
    # grace (and a second of scheduling), the repeated images and one pin per client.
    from epdctl.launch.supervisor import JANITOR_INTERVAL_S

    window_s = JANITOR_INTERVAL_S + 1.0 + 1.0
    over = [(at - begin, size, watch.new_before(at, window_s)) for at, size in watch.samples
            if size > CAPACITY + (watch.new_before(at, window_s) + len(REPEATED) + CONCURRENCY)
            * entry_bytes]
    assert over == [], (entry_bytes, over)
    assert counts["hits"] > 0

    # Memory is bounded and no engine died or restarted.
    for name, before in rss_before.items():
        assert before > 0 and rss_after[name] <= before * 1.5 + RSS_SLACK, (name, _mib(
            rss_before), _mib(rss_after))
    status = probe.status()
    assert {n: (r["state"], r["restarts"]) for n, r in status.items()} == dict.fromkeys(
        status, ("ready", 0))
    assert answer(probe.proxy, body(MODEL, urls=(image(77)[1],))) == reference


def _mib(rss: dict[str, int]) -> dict[str, int]:
    return {name: value >> 20 for name, value in rss.items()}
