"""`python -m epdctl.bench.replay --trace FILE --speed X ...`: a trace replayed against a
server, where bench runs `vllm bench serve` for other workloads (vLLM's own `timed_trace`
dataset replays text-only token ids, not media).

It takes the arguments bench gives it (epdctl.bench.traced.replay_argv): the trace, the speed
(arrival times divided by it), the server, the seed of the generated prompts and media,
goodput SLOs, where to write the result. Each line becomes its chat request
(epdctl.bench.bodies), sent at its arrival time with no cap on requests in flight; bodies
are built ahead of their time on a thread of their own, so that a large image does not
delay a send. The result file has the keys and figures of `vllm bench serve --save-result
--save-detailed` (epdctl.bench.client) and, per request, its shape class, its scheduled and
actual send offsets; and the trace's source, kind and speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from epdctl.bench import client
from epdctl.bench.bodies import Defaults, body, request_seed
from epdctl.bench.client import Outcome
from epdctl.traces.classes import counts, shape_class
from epdctl.traces.format import TraceError, TraceRequest, cycled, read_trace, scaled

AHEAD = 32
"""Bodies built before their turn (and before the clock starts): enough to ride out a slow
one, few enough to hold (32 videos of 8 frames of 512x512: ~130 MB)."""
LATE_S = 0.05
"""A send later than this after its time is reported (bodies built slower than the trace's
gaps, or a busy machine)."""
REQUEST_TIMEOUT_S = 6 * 60 * 60

Body = TypeVar("Body")


@dataclass
class Replayed:
    outcomes: list[Outcome]
    offsets: list[float]
    """When each request was sent, seconds from the start."""
    duration: float


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m epdctl.bench.replay",
                                description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--limit", type=int, help="refuse a trace of more requests")
    p.add_argument("--num-prompts", type=int,
                   help="the first N requests (a warm-up); more than the trace holds: the "
                        "trace again from its start, back to back (traces.format.cycled)")
    p.add_argument("--base-url", required=True)
    p.add_argument("--endpoint", default="/v1/chat/completions")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", default="512x512", help="WxH of images with no size")
    p.add_argument("--video-frames", type=int, default=Defaults.video_frames)
    p.add_argument("--audio-seconds", type=float, default=Defaults.audio_seconds)
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS")
    p.add_argument("--result-dir", type=Path, default=Path("."))
    p.add_argument("--result-filename")
    args = p.parse_args(list(argv))
    if not args.speed > 0 or args.speed == float("inf"):
        p.error(f"--speed {args.speed:g}: expected a number above 0")
    width, _, height = args.image_size.partition("x")
    if not (width.isdigit() and (height or width).isdigit()):
        p.error(f"--image-size {args.image_size}: expected WxH")
    args.defaults = Defaults((int(width), int(height or width)), args.video_frames,
                             args.audio_seconds)
    args.slo = {}
    for pair in args.goodput:
        name, _, ms = pair.partition(":")
        try:
            args.slo[name] = float(ms)
        except ValueError:
            args.slo[name] = -1.0
        if name not in ("ttft", "tpot", "e2el") or args.slo[name] < 0:
            p.error(f"--goodput {pair}: expected ttft|tpot|e2el:MS")
    return args


async def replay(times: Sequence[float], build: Callable[[int], Body],
                 send: Callable[[Body], Coroutine[Any, Any, Outcome]], *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 ahead: int = AHEAD) -> Replayed:
    """Send request i at times[i] seconds after the start (or at once, if its body was not
    ready then); `build(i)` runs in order on a thread, up to `ahead` requests early."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-bodies") as pool:
        ready = deque(loop.run_in_executor(pool, build, i)
                      for i in range(min(ahead, len(times))))
        if ready:
            await asyncio.wait(list(ready))  # built before the clock starts, as vLLM does
        tasks: list[asyncio.Task[Outcome]] = []
        offsets: list[float] = []
        started = clock()
        for i, at in enumerate(times):
            made = await ready.popleft()
            if i + ahead < len(times):
                ready.append(loop.run_in_executor(pool, build, i + ahead))
            wait = at - (clock() - started)
            if wait > 0:
                await sleep(wait)
            offsets.append(clock() - started)
            tasks.append(asyncio.create_task(send(made)))
        outcomes = list(await asyncio.gather(*tasks))
        return Replayed(outcomes, offsets, clock() - started)


async def run(args: argparse.Namespace, requests: Sequence[TraceRequest],
              times: Sequence[float]) -> Replayed:
    url = args.base_url.rstrip("/") + args.endpoint
    key = os.environ.get("OPENAI_API_KEY")  # what bench sets for a proxy with a key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = args.served_model_name or args.model

    def build(i: int) -> tuple[bytes, bool]:
        made = body(requests[i], request_seed(args.seed, i), model, args.defaults)
        return json.dumps(made).encode(), requests[i].stream

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(made: tuple[bytes, bool]) -> Outcome:
            return await client.send(session, url, made[0], made[1], headers)

        return await replay(times, build, send)


def result(args: argparse.Namespace, source: str, kind: str,
           requests: Sequence[TraceRequest], times: Sequence[float], done: Replayed
           ) -> dict[str, Any]:
    """vLLM's result file, and per request its class and send offsets."""
    span = times[-1] - times[0] if times else 0.0
    head = {"backend": "epdctl-replay", "model_id": args.model, "num_prompts": len(requests),
            # The trace's mean arrival rate at this speed (vLLM's key; `inf`: all at once).
            "request_rate": (len(times) - 1) / span if span > 0 else "inf",
            "max_concurrency": None}
    out = client.result(done.outcomes, done.duration, slo=args.slo, head=head,
                        percentiles=[float(p) for p in args.metric_percentiles.split(",")],
                        input_lens=[r.input_length for r in requests])
    return out | {
        "trace": {"source": source, "kind": kind, "speed": args.speed,
                  "requests": len(requests), "classes": counts(requests)},
        "classes": [shape_class(r) for r in requests],
        "streamed": [r.stream for r in requests],
        "scheduled_offsets": list(times), "send_offsets": done.offsets}


async def replay_trace(args: argparse.Namespace) -> tuple[dict[str, Any], Replayed]:
    """The trace (its first --num-prompts requests, cycled past its end) sent at its times
    over --speed; the result file's contents. SystemExit in one line for a trace that
    cannot be read."""
    try:
        trace = read_trace(args.trace, args.limit)
    except TraceError as exc:
        raise SystemExit(f"replay: {exc}") from None
    requests = cycled(trace.requests, args.num_prompts or len(trace.requests))
    times = scaled(replace(trace, requests=requests), args.speed)
    done = await run(args, requests, times)
    return result(args, trace.source, trace.kind, requests, times, done), done


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    figures, done = asyncio.run(replay_trace(args))
    times = figures["scheduled_offsets"]
    failed = [o.error for o in done.outcomes if o.error]
    print(f"replay: {figures['completed']} completed, {len(failed)} failed in "
          f"{done.duration:.1f} s ({figures['request_throughput']:.2f} req/s)"
          + (f"; first error: {failed[0]}" if failed else ""), flush=True)
    late = [sent - at for sent, at in zip(done.offsets, times, strict=True) if sent - at > LATE_S]
    if late:
        print(f"replay: {len(late)} of {len(times)} requests sent over {LATE_S * 1000:.0f} ms "
              f"late (at most {max(late):.2f} s): their bodies took longer to build than the "
              "trace's gaps, or the machine was busy", flush=True)
    name = args.result_filename or f"replay-{int(time.time())}.json"
    (args.result_dir / name).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
