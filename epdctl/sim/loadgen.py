"""`vllm bench serve` for the simulated machine: `python -m epdctl.sim.loadgen ARGS...`.

It takes the arguments epdctl's bench gives `vllm bench serve` (epdctl.bench.workload.argv:
the openai-chat backend, the `random` and `random-mm` datasets of images, a Poisson rate or
all at once, a concurrency cap, goodput SLOs) and writes the result file that `--save-result
--save-detailed` writes, with vLLM's figures computed vLLM's way (epdctl.bench.client, which
the trace replayer shares). It starts in well under a second, where `vllm bench serve` imports
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
from pathlib import Path
from typing import Any

import aiohttp

from epdctl.bench import client
from epdctl.bench.client import Outcome
from epdctl.bench.images import png
from epdctl.bench.workload import WORDS


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
                return await client.send(session, url, json.dumps(body).encode(), True,
                                         headers)

        started = time.perf_counter()
        tasks = []
        for n, body in enumerate(requests):
            if n and not math.isinf(args.request_rate):  # Poisson: exponential gaps
                await asyncio.sleep(gaps.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(one(body)))
        outcomes = list(await asyncio.gather(*tasks))
        return outcomes, time.perf_counter() - started


def result(args: argparse.Namespace, outcomes: Sequence[Outcome], duration: float
           ) -> dict[str, Any]:
    """The `--save-result` file (`--save-detailed`'s lists with it where asked)."""
    head = {"backend": args.backend, "model_id": args.model, "num_prompts": args.num_prompts,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "max_concurrency": args.max_concurrency}
    return client.result(outcomes, duration, slo=args.slo, head=head,
                         percentiles=[float(p) for p in args.metric_percentiles.split(",")],
                         input_lens=[args.random_input_len] * len(outcomes),
                         is_detailed=args.save_detailed)


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
