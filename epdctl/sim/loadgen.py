"""`vllm bench serve` for the simulated machine: `python -m epdctl.sim.loadgen ARGS...`.

It takes the arguments epdctl's bench gives `vllm bench serve` (epdctl.bench.workload.argv:
the openai-chat backend, the `random` and `random-mm` datasets of images, a Poisson rate or
all at once, a concurrency cap, goodput SLOs) and writes the result file that `--save-result
--save-detailed` writes, with vLLM's figures computed vLLM's way (vllm/benchmarks/serve.py:
TPOT over the tokens after the first, goodput against every SLO given, percentiles
interpolated linearly). It starts in well under a second, where `vllm bench serve` imports
vLLM, torch and a tokenizer each time (~10-20 s on two cores, once per load point: most of
a sweep's time on the simulated machine). Its requests are shaped as tune's probes shape
them (epdctl.tune.probes.Bodies: the workload's words and PNG images), so what tune
profiles and what it confirms are the same requests. There is no model or tokenizer here:
output tokens are those the answer's usage counts. Nothing else of vLLM's CLI is taken: an
option it does not know is refused in one line.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import base64
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from epdctl.bench import estimates as stats
from epdctl.bench.workload import WORDS, png

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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m epdctl.sim.loadgen",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="openai-chat", choices=["openai-chat"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--endpoint", default="/v1/chat/completions")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--dataset-name", default="random", choices=["random", "random-mm"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    p.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0)
    p.add_argument("--random-mm-limit-mm-per-prompt", default="{}")
    p.add_argument("--random-mm-bucket-config", default="{(256, 256, 1): 1.0}")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--goodput", nargs="*", default=[])
    args = p.parse_args(list(argv))
    args.image_size = _image_size(args) if args.dataset_name == "random-mm" else None
    args.slo = _slo(p, args.goodput)
    return args


def _image_size(args: argparse.Namespace) -> tuple[int, int]:
    """(width, height) of the one image bucket (bench writes one; video is not simulated)."""
    try:
        buckets = ast.literal_eval(args.random_mm_bucket_config)
        (height, width, frames), = (key for key, share in buckets.items() if share)
    except (ValueError, SyntaxError, TypeError, AttributeError):
        raise SystemExit(f"loadgen: --random-mm-bucket-config {args.random_mm_bucket_config}:"
                         " expected one image bucket {(H, W, 1): 1.0}") from None
    if frames != 1:
        raise SystemExit("loadgen: the simulated machine sends images only, not video")
    return int(width), int(height)


def _slo(p: argparse.ArgumentParser, pairs: Sequence[str]) -> dict[str, float]:
    slo = {}
    for pair in pairs:
        name, _, ms = pair.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            p.error(f"--goodput {pair}: expected ttft|tpot|e2el:MS")
        try:
            slo[name] = float(ms)
        except ValueError:
            p.error(f"--goodput {pair}: expected ttft|tpot|e2el:MS")
    return slo


def bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each request's body, made before the clock starts (as vLLM samples its dataset)."""
    rng = random.Random(args.seed)
    items = args.random_mm_base_items_per_request if args.image_size else 0
    out = []
    for n in range(args.num_prompts):
        start = rng.randrange(len(WORDS))
        text = f"{rng.randrange(10 ** 9)}: " + " ".join(
            WORDS[(start + i) % len(WORDS)] for i in range(args.random_input_len))
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for i in range(items):
            width, height = args.image_size
            data = base64.b64encode(png(width, height, args.seed * 100_003 + n * 16 + i))
            content.append({"type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{data.decode()}"}})
        out.append({"model": args.served_model_name or args.model,
                    "messages": [{"role": "user", "content": content}],
                    "temperature": args.temperature,
                    "max_completion_tokens": args.random_output_len, "stream": True,
                    "stream_options": {"include_usage": True},
                    **({"ignore_eos": True} if args.ignore_eos else {})})
    return out


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> Outcome:
    """One streamed chat request, timed as vLLM's openai-chat request function times it."""
    out = Outcome(start=time.perf_counter())
    last = out.start
    try:
        async with session.post(url, json=body, headers=headers) as reply:
            if reply.status != 200:
                out.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return out
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
                elif usage := chunk.get("usage"):
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.latency = last - out.start
        if not out.ttft:
            out.error = "no token in the answer"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run(args: argparse.Namespace, requests: list[dict[str, Any]]) -> tuple[
        list[Outcome], float]:
    url = args.base_url.rstrip("/") + args.endpoint
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    gaps = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(body: dict[str, Any]) -> Outcome:
            async with limit:
                return await send(session, url, body, headers)

        started = time.perf_counter()
        tasks = []
        for n, body in enumerate(requests):
            if n and not math.isinf(args.request_rate):  # Poisson: exponential gaps
                await asyncio.sleep(gaps.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(one(body)))
        outcomes = list(await asyncio.gather(*tasks))
        return outcomes, time.perf_counter() - started


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile's default (linear) of `values`; 0 for none (as vLLM's `or 0`)."""
    return stats.percentile(sorted(values), q) if values else 0.0


def result(args: argparse.Namespace, outcomes: Sequence[Outcome], duration: float
           ) -> dict[str, Any]:
    """The `--save-result --save-detailed` file's keys epdctl reads, and vLLM's others of
    the same figures."""
    done = [o for o in outcomes if not o.error]
    lens = [o.output_tokens or 1 for o in done]
    per: dict[str, list[float]] = {"ttft": [o.ttft for o in done],
                                   "e2el": [o.latency for o in done],
                                   "itl": [x for o in done for x in o.itl], "tpot": []}
    all_tpots = []
    for o, n in zip(done, lens, strict=True):
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            per["tpot"].append(tpot)
        all_tpots.append(tpot)
    good = 0
    if args.slo:
        measured = {"ttft": per["ttft"], "tpot": all_tpots, "e2el": per["e2el"]}
        for i in range(len(done)):
            good += all(measured[k][i] * 1000 <= ms for k, ms in args.slo.items())
    out: dict[str, Any] = {
        "backend": args.backend, "model_id": args.model, "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency, "duration": duration,
        "completed": len(done), "failed": len(outcomes) - len(done),
        "total_output_tokens": sum(lens),
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": sum(lens) / duration if duration else 0.0,
        "request_goodput": good / duration if args.slo and duration else None,
    }
    wanted = [float(p) for p in args.metric_percentiles.split(",")]
    for metric in METRICS:
        values = per[metric]
        out[f"mean_{metric}_ms"] = sum(values) / len(values) * 1000 if values else 0.0
        out[f"median_{metric}_ms"] = percentile(values, 50) * 1000
        for p in wanted:
            out[f"p{p:g}_{metric}_ms"] = percentile(values, p) * 1000
    if args.save_detailed:
        out |= {"input_lens": [args.random_input_len] * len(outcomes),
                "output_lens": [o.output_tokens if not o.error else 0 for o in outcomes],
                "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes],
                "latencies": [o.latency for o in outcomes],
                "errors": [o.error for o in outcomes]}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    requests = bodies(args)
    outcomes, duration = asyncio.run(run(args, requests))
    figures = result(args, outcomes, duration)
    failed = [o.error for o in outcomes if o.error]
    print(f"loadgen: {figures['completed']} completed, {len(failed)} failed in "
          f"{duration:.1f} s ({figures['request_throughput']:.2f} req/s)"
          + (f"; first error: {failed[0]}" if failed else ""), flush=True)
    if args.save_result:
        name = args.result_filename or f"loadgen-{int(time.time())}.json"
        path = Path(args.result_dir) / name
        path.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
