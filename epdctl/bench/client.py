"""Chat requests sent and timed as `vllm bench serve`'s openai-chat request function times
them, and the result file its `--save-result --save-detailed` writes, with vLLM's figures
computed vLLM's way (vllm/benchmarks/serve.py: TPOT over the tokens after the first, goodput
against every SLO given, percentiles interpolated linearly). Shared by the trace replayer
(epdctl.bench.replay) and the simulated machine's `vllm bench serve` (epdctl.sim.loadgen)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from epdctl.bench import estimates as stats

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Outcome:
    """One request as vLLM's RequestFuncOutput records it (seconds)."""

    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def send(session: aiohttp.ClientSession, url: str, payload: bytes, is_streamed: bool,
               headers: Mapping[str, str]) -> Outcome:
    """One chat request (`payload`: its JSON body). Streamed, it is timed chunk by chunk;
    answered whole, its TTFT is its latency (how vLLM counts a request it cannot see
    stream) and it has no inter-token latencies, hence no TPOT."""
    out = Outcome(start=time.perf_counter())
    try:
        async with session.post(url, data=payload, headers={
                **headers, "content-type": "application/json"}) as reply:
            if reply.status != 200:
                out.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return out
            if is_streamed:
                await _read_stream(reply, out)
            else:
                data = json.loads(await reply.read())
                out.ttft = out.latency = time.perf_counter() - out.start
                out.output_tokens = int((data.get("usage") or {}).get("completion_tokens")
                                        or 0)
        if not out.ttft:
            out.error = "no token in the answer"
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _read_stream(reply: aiohttp.ClientResponse, out: Outcome) -> None:
    last = out.start
    chunks = 0
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        now = time.perf_counter()
        if chunk.get("choices"):  # any choice chunk, the role's too, as vLLM
            if not out.ttft:
                out.ttft = now - out.start
            else:
                out.itl.append(now - last)
            last = now
            chunks += 1
        elif usage := chunk.get("usage"):
            out.output_tokens = int(usage.get("completion_tokens") or 0)
    out.latency = last - out.start
    # Without a usage chunk: a token per chunk after the role's.
    out.output_tokens = out.output_tokens or max(chunks - 1, 0)


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile's default (linear) of `values`; 0 for none (as vLLM's `or 0`)."""
    return stats.percentile(sorted(values), q) if values else 0.0


def result(outcomes: Sequence[Outcome], duration: float, *, slo: Mapping[str, float],
           percentiles: Sequence[float], input_lens: Sequence[int],
           head: Mapping[str, Any] | None = None, is_detailed: bool = True) -> dict[str, Any]:
    """The `--save-result` file's keys epdctl reads and vLLM's others of the same figures
    (`head`: the run's description first); with `is_detailed`, `--save-detailed`'s
    per-request lists. TPOT is taken over the requests that streamed more than one token
    (as epdctl.bench.samples reads them); goodput's rule is vLLM's."""
    done = [o for o in outcomes if not o.error]
    lens = [o.output_tokens or 1 for o in done]
    per: dict[str, list[float]] = {"ttft": [o.ttft for o in done],
                                   "e2el": [o.latency for o in done],
                                   "itl": [x for o in done for x in o.itl], "tpot": []}
    all_tpots = []
    for o, n in zip(done, lens, strict=True):
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1 and o.itl:
            per["tpot"].append(tpot)
        all_tpots.append(tpot)
    good = 0
    if slo:
        measured = {"ttft": per["ttft"], "tpot": all_tpots, "e2el": per["e2el"]}
        for i in range(len(done)):
            good += all(measured[k][i] * 1000 <= ms for k, ms in slo.items())
    out: dict[str, Any] = {
        **(head or {}), "duration": duration,
        "completed": len(done), "failed": len(outcomes) - len(done),
        "total_output_tokens": sum(lens),
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": sum(lens) / duration if duration else 0.0,
        "request_goodput": good / duration if slo and duration else None,
    }
    for metric in METRICS:
        values = per[metric]
        out[f"mean_{metric}_ms"] = sum(values) / len(values) * 1000 if values else 0.0
        out[f"median_{metric}_ms"] = percentile(values, 50) * 1000
        for p in percentiles:
            out[f"p{p:g}_{metric}_ms"] = percentile(values, p) * 1000
    if is_detailed:
        out |= {"input_lens": list(input_lens),
                "output_lens": [o.output_tokens if not o.error else 0 for o in outcomes],
                "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes],
                "latencies": [o.latency for o in outcomes],
                "errors": [o.error for o in outcomes]}
    return out
