"""Profiling for real: the few small topologies whose instances cover every stage the
candidates need, and the sweeps against a running one over HTTP (each instance alone,
requests shaped as the workload's)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from epdctl.bench.images import png
from epdctl.bench.workload import WORDS, Workload
from epdctl.launch.state import RunState, SpecModel
from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.des import StepCost
from epdctl.tune.model import needed_stages, stage_key
from epdctl.tune.profile import (
    DECODE_TOKENS,
    LEVELS,
    Send,
    Timing,
    Upstream,
    combine,
    decode_level,
    profile_decode,
    profile_encode,
    profile_handoff,
    profile_prefill,
    slowdown,
)

CHAT = "/v1/chat/completions"
HANDOFF = "ec-handoff"
"""In `known` beside the stage keys: an earlier probe timed the EC hand-off (the proxy's hop
does not depend on the instances' sizes: timed once)."""


def probe_shapes(shapes: Sequence[Shape], gpus: int) -> list[Shape]:
    """Small shapes (at most `gpus` devices each) that hold an instance of every stage key
    the shapes need: E|PD for E and consumer PD, aggregated for PD that encodes, E|P|D for
    P and D (a shared one too where some candidate shares a GPU)."""
    needed = {k for s in shapes for k in needed_stages(s)}
    probes: list[Shape] = []
    for tp in sorted({s.pd.tp for s in shapes if s.pd.replicas and s.encoders}):
        probes.append(Shape("e-pd", 1, pd=Pool(1, tp)))
    for tp in sorted({s.pd.tp for s in shapes if s.pd.replicas and not s.encoders}):
        probes.append(Shape("aggregated", pd=Pool(1, tp)))
    pairs = sorted({(s.prefill.tp, s.decode.tp) for s in shapes if s.prefill.replicas})
    covered: set[str] = set()
    for tp_p, tp_d in pairs:
        keys = {stage_key("prefill", tp_p), stage_key("decode", tp_d)}
        if not keys <= covered:
            probes.append(Shape("epd", 1, prefill=Pool(1, tp_p), decode=Pool(1, tp_d)))
            covered |= keys
    if any(s.shared for s in shapes):
        probes.append(Shape("e-pd", 1, True, pd=Pool(1, 1)))
    if not needed:
        return []
    # Too big with E on a GPU of its own: E shares its host's first GPU (E idles while the
    # host is timed, so the host's figures stay its own).
    fitted = [p if p.gpus <= gpus or not p.encoders else replace(p, shared=True)
              for p in probes]
    return list(dict.fromkeys(p for p in fitted if p.gpus <= gpus))


@dataclass
class Bodies:
    """Requests shaped as the workload's, each with its own image."""

    workload: Workload
    model: str
    _images: dict[int, str] = field(default_factory=dict)

    def image(self, n: int) -> dict[str, Any]:
        if n not in self._images:
            w, h = self.workload.image_size
            data = base64.b64encode(png(w, h, 7_000_003 + n)).decode()
            self._images[n] = f"data:image/png;base64,{data}"
        return {"type": "image_url", "image_url": {"url": self._images[n]}}

    def chat(self, n: int, max_tokens: int, stream: bool = False) -> dict[str, Any]:
        text = f"{n}: " + " ".join(WORDS[(n + i) % len(WORDS)]
                                   for i in range(self.workload.input_len))
        content = [self.image(n * 16 + i) for i in range(self.workload.images)]
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": [*content,
                                                      {"type": "text", "text": text}]}]}
        return body

    def encoder(self, n: int) -> dict[str, Any]:
        return {"model": self.model, "stream": False,
                "messages": [{"role": "user", "content": [self.image(n * 16)]}]}


class Http:
    """The HTTP Send: time one request (its tokens, when streamed)."""

    def __init__(self, headers: dict[str, dict[str, str]]) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=600.0)
        self.headers = headers

    async def send(self, url: str, body: dict[str, Any]) -> Timing:
        start = time.perf_counter()
        headers = self.headers.get(url, {})
        if not body.get("stream"):
            reply = await self.client.post(url + CHAT, json=body, headers=headers)
            reply.raise_for_status()
            end = time.perf_counter()
            tokens = (reply.json().get("usage") or {}).get("completion_tokens") or 0
            return Timing(start, end, end, int(tokens))
        times: list[float] = []
        async with self.client.stream("POST", url + CHAT, json=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
        end = time.perf_counter()
        return Timing(start, times[0] if times else end, end, len(times), tuple(times))

    async def post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.client.post(url + CHAT, json=body, headers=self.headers.get(url, {}))
        reply.raise_for_status()
        data: dict[str, Any] = reply.json()
        return data

    async def close(self) -> None:
        await self.client.aclose()


def _headers(spec: SpecModel) -> dict[str, str]:
    key = spec.env.get("VLLM_API_KEY") if spec.is_key_required else None
    return {"authorization": f"Bearer {key}"} if key else {}


def _max_seqs(spec: SpecModel) -> int | None:
    from epdctl.topology.model import flag_value

    value = flag_value(spec.args, "--max-num-seqs")
    return int(value) if value and value.isdigit() else None


@dataclass(frozen=True)
class _Levels:
    """The levels every stage is timed at, and the TPOT limit decoders go on to."""

    levels: Sequence[int]
    tpot_ms: float | None = None


@dataclass
class Measurements:
    """What one probe topology gave: step costs by stage key, and the hand-off costs."""

    stages: dict[str, StepCost] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)
    kv_ms: float | None = None
    """D's time to its first token beyond a decode step, at the workload's prompt."""
    sharing_slowdown: float | None = None
    """How much longer PD's decode steps get while E on its GPU is kept busy."""
    ec_ms: float | None = None
    """The EC hand-off: an E-fed request's time through the proxy beyond E's and PD's own."""


Known = Mapping[str, StepCost | None] | Collection[str]
"""What earlier probes profiled: stage key -> its step cost (None, or a bare collection of
keys: profiled, cost not given), and HANDOFF."""


def known_decode(known: Mapping[str, StepCost | None], tp: int) -> StepCost | None:
    """A decode step profiled at this TP size by an earlier probe, from whichever instance
    it was timed on (a D, a PD fed by E, an aggregated PD): the same model's decode step on
    the same devices, timed over steps that only decode (steady_decode). Profiling it once
    per TP size, not once per kind of instance, took a third off tune's profiling."""
    for key in (stage_key("decode", tp), stage_key("prefill_decode", tp),
                stage_key("prefill_decode", tp, encodes=True)):
        cost = known.get(key)
        if cost is not None:
            return replace(cost, prefill_fixed_ms=None, per_token_ms=0.0, per_image_ms=0.0)
    return None


async def profile_running(state: RunState, shape: Shape, bodies: Bodies, tokens: int,
                          levels: Sequence[int] = LEVELS, known: Known = (),
                          tpot_ms: float | None = None) -> Measurements:
    """Profile each instance of a running probe topology alone (one of each role), but for
    the stage keys in `known` (an earlier probe profiled them: an E in front of every E|PD
    and E|P|D probe is timed once, not in each), and a decode step an earlier probe timed at
    the same TP size (known_decode); and where it has E and PD, unless `known` holds
    HANDOFF, the EC hand-off through its proxy. Decoders are timed up to the batch the TPOT
    limit `tpot_ms` allows (profile_decode)."""
    specs = {s.role: s for s in state.engines}
    proxy = state.proxy
    key = state.proxy_api_key
    http = Http({**{s.url: _headers(s) for s in state.engines},
                 proxy.url: {"authorization": f"Bearer {key}"} if key else {}})
    out = Measurements()
    try:
        costs = known if isinstance(known, Mapping) else dict.fromkeys(known)
        await _profile(http, specs, shape, bodies, tokens, _Levels(levels, tpot_ms), out,
                       costs)
        if {"encode", "prefill_decode"} <= specs.keys() and HANDOFF not in known:
            out.ec_ms, out.series["ec_handoff"] = await _handoff(
                http, proxy.url, specs["encode"].url, specs["prefill_decode"].url, bodies)
    finally:
        await http.close()
    return out


async def _profile(http: Http, specs: dict[str, SpecModel], shape: Shape, bodies: Bodies,
                   tokens: int, at: _Levels, out: Measurements,
                   known: Mapping[str, StepCost | None]) -> None:
    send: Send = http.send
    levels = at.levels
    if "encode" in specs and "encode" not in known:
        e_url = specs["encode"].url
        cost, series = await profile_encode(send, e_url, bodies.encoder, levels)
        out.stages["encode"], out.series["encode"] = cost, series.as_json()
    if "prefill_decode" in specs:
        await _profile_pd(http, specs, shape, bodies, tokens, at, out, known)
    if "prefill" in specs and "decode" in specs:
        p, d = specs["prefill"], specs["decode"]
        p_key, d_key = stage_key("prefill", p.tensor_parallel), stage_key("decode",
                                                                          d.tensor_parallel)
        if p_key not in known:
            p_send = _after_encoder(http, specs["encode"].url) \
                if "encode" in specs else send
            prefill, s1 = await profile_prefill(p_send, p.url, lambda n: bodies.chat(n, 1),
                                                tokens, levels)
            out.stages[p_key], out.series["prefill"] = prefill, s1.as_json()
        if d_key in known:
            return
        e_url = specs["encode"].url if "encode" in specs else None
        d_send = _after_prefill(http, p.url, e_url)
        decode = known_decode(known, d.tensor_parallel)
        if decode is None:
            decode, s2 = await profile_decode(
                send, d.url, lambda n: bodies.chat(20_000 + n, DECODE_TOKENS, True), levels,
                at.tpot_ms, _max_seqs(d), _prefilled(http, p.url, e_url))
            out.series["decode"] = s2.as_json()
        out.stages[d_key] = replace(decode, max_seqs=seqs) if (seqs := _max_seqs(d)) else decode
        one = await d_send(d.url, bodies.chat(30_000, DECODE_TOKENS, True))
        step = decode.ms(0, 0, 1, 0) / 1000
        out.kv_ms = max((one.first - one.start - step) * 1000, 0.0)


async def _profile_pd(http: Http, specs: dict[str, SpecModel], shape: Shape, bodies: Bodies,
                      tokens: int, at: _Levels, out: Measurements,
                      known: Mapping[str, StepCost | None]) -> None:
    """PD's prefill and decode (unless known; its decode, unless known at its TP size), and
    beside a shared GPU's busy E how much slower its decode gets (against its decode alone
    at the top level, timed again then)."""
    spec = specs["prefill_decode"]
    encodes = "encode" not in specs
    key = stage_key("prefill_decode", spec.tensor_parallel, encodes=encodes)
    send = http.send if encodes else _after_encoder(http, specs["encode"].url)
    upstream = None if encodes else _encoded(http, specs["encode"].url)
    decode_body = lambda n: bodies.chat(10_000 + n, DECODE_TOKENS, True)  # noqa: E731
    levels = at.levels
    s2 = None
    if key not in known:
        prefill, s1 = await profile_prefill(send, spec.url, lambda n: bodies.chat(n, 1),
                                            tokens, levels)
        decode = known_decode(known, spec.tensor_parallel)
        series: dict[str, Any] = {"prefill": s1.as_json()}
        if decode is None:
            decode, s2 = await profile_decode(http.send, spec.url, decode_body, levels,
                                              at.tpot_ms, _max_seqs(spec), upstream)
            series["decode"] = s2.as_json()
        out.stages[key] = combine(prefill, decode, _max_seqs(spec))
        out.series[key] = series
    if not shape.shared or encodes:
        return
    if s2 is None:
        _, s2 = await profile_decode(http.send, spec.url, decode_body, levels[-1:],
                                     upstream=upstream)
    top = levels[-1]  # not a level the decode profile went on to (decode_levels)
    alone = s2.values[s2.levels.index(top)]
    assert upstream is not None
    loaded = await _beside_busy_encoder(http.send, specs["encode"].url, bodies, upstream,
                                        spec.url, top)
    out.sharing_slowdown = slowdown(alone, loaded)
    out.series["sharing"] = {"alone_ms": alone * 1000, "loaded_ms": loaded * 1000}


async def _beside_busy_encoder(send: Send, e_url: str, bodies: Bodies, upstream: Upstream,
                               pd_url: str, level: int) -> float:
    """PD's time per output token at `level` in flight while E is kept busy: one level of
    profile_decode (decode_level), as PD alone was timed."""
    stop = asyncio.Event()

    async def keep_busy(w: int) -> None:
        n = 0
        while not stop.is_set():
            await send(e_url, bodies.encoder(50_000 + w * 1000 + n))
            n += 1

    busy = [asyncio.create_task(keep_busy(w)) for w in range(LEVELS[-1])]
    try:
        series = await decode_level(send, pd_url,
                                    lambda n: bodies.chat(40_000 + n, DECODE_TOKENS, True),
                                    level, 0, upstream)
    finally:
        stop.set()
        await asyncio.gather(*busy, return_exceptions=True)
    return series.values[0]


async def _encode(http: Http, e_url: str, body: dict[str, Any]) -> None:
    for part in _images(body):
        await http.post(e_url, _encoder_body(body, part))


def _encoder_body(body: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """What E gets for one image of `body`, as the proxy sends it."""
    return {"model": body.get("model"), "stream": False,
            "messages": [{"role": "user", "content": [part]}]}


async def _handoff(http: Http, proxy_url: str, e_url: str, pd_url: str, bodies: Bodies
                   ) -> tuple[float, dict[str, Any]]:
    """profile_handoff with prefill-only requests (`max_tokens` 1), each with images of its
    own: through the proxy, and by hand (E encodes the request's images, all at once as the
    proxy sends them, then PD prefills)."""
    first = 60_000

    async def through(n: int) -> float:
        return (await http.send(proxy_url, bodies.chat(first + n, 1))).latency

    async def direct(n: int) -> float:
        body = bodies.chat(first + n, 1)
        start = time.perf_counter()
        await asyncio.gather(*(http.post(e_url, _encoder_body(body, part))
                               for part in _images(body)))
        await http.send(pd_url, body)
        return time.perf_counter() - start

    return await profile_handoff(through, direct)


def _images(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in body["messages"][0]["content"] if p.get("type") == "image_url"]


def _encoded(http: Http, e_url: str) -> Upstream:
    """E encodes the request's images first (untimed), as the proxy has it do."""
    async def ready(body: dict[str, Any]) -> dict[str, Any]:
        await _encode(http, e_url, body)
        return body

    return ready


def _prefilled(http: Http, p_url: str, e_url: str | None) -> Upstream:
    """E (where there is one) and P do their part first (untimed), as the proxy has them
    do; the body then carries P's kv_transfer_params for D."""
    from epdctl.proxy.request.shape import PREFILL_KV

    async def ready(body: dict[str, Any]) -> dict[str, Any]:
        if e_url is not None:
            await _encode(http, e_url, body)
        answer = await http.post(p_url, {**body, "stream": False, "max_tokens": 1,
                                         "max_completion_tokens": 1,
                                         "kv_transfer_params": dict(PREFILL_KV)})
        params = answer.get("kv_transfer_params")
        return {**body, "kv_transfer_params": params} if params else body

    return ready


def _after(http: Http, upstream: Upstream) -> Send:
    """A Send that does `upstream`'s work first, then times the request itself."""
    async def send(url: str, body: dict[str, Any]) -> Timing:
        return await http.send(url, await upstream(body))

    return send


def _after_encoder(http: Http, e_url: str) -> Send:
    """A Send that has E encode the request's images first (untimed), as the proxy does."""
    return _after(http, _encoded(http, e_url))


def _after_prefill(http: Http, p_url: str, e_url: str | None) -> Send:
    """A Send to D that has E and P do their part first (untimed), as the proxy does, and
    gives D P's kv_transfer_params."""
    return _after(http, _prefilled(http, p_url, e_url))
