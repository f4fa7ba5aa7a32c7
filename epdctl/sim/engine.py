"""The fake engine: `python -m epdctl.sim.engine MODEL --cost-model FILE ...` stands in for
`vllm serve` as E, P, PD or D on a fake GPU (the topology's `engine.command`).

Routes as vLLM's: /health, /metrics, /v1/models, /v1/chat/completions, /v1/completions
(streamed or not, usage in the answer). E answers the proxy's one-image sub-request once the
image is encoded; P answers after its prefill with `kv_transfer_params` for D; D, given
`do_remote_prefill`, pulls the KV (a cost per token) and decodes; PD (or D without P's
params) does it all. Service times come from the cost model (epdctl.sim.costmodel).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

from aiohttp import web

from epdctl.sim.costmodel import CostModel, load_cost_model
from epdctl.sim.options import Options, parse_options
from epdctl.sim.requests import Work, parse_work
from epdctl.sim.scheduler import Job, Scheduler
from epdctl.sim.sharing import GpuShare, sim_dir

KEY_ENV = "VLLM_API_KEY"
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest request body taken (aiohttp's default is 1 MiB: four 512x512 images as a
replayed trace sends them were refused with 413; vLLM takes them, as the proxy's
--max-body-bytes default does)."""
TOKEN_TEXT = "tok "


class OutOfMemory(Exception):
    pass


def kv_capacity(cost: CostModel, opts: Options) -> int | None:
    """KV cache tokens the instance holds (None for E); OutOfMemory when it cannot start."""
    fraction = opts.gpu_memory_utilization or cost.utilization
    budget = int(fraction * cost.gpu.memory * opts.tensor_parallel)
    weights = cost.weights_bytes(opts.role)
    gib = 1 << 30
    if weights > budget:
        raise OutOfMemory(f"CUDA out of memory (simulated): {opts.role} needs "
                          f"{weights / gib:.1f} GiB of weights, has {budget / gib:.1f} GiB")
    if opts.role == "encode":
        return None
    tokens = (budget - weights) // max(cost.model.kv_per_token, 1)
    if tokens < opts.max_model_len:
        raise OutOfMemory(f"CUDA out of memory (simulated): KV cache for {tokens} tokens, "
                          f"less than --max-model-len {opts.max_model_len}")
    return tokens


class Engine:
    """One fake instance: its scheduler and what its answers say."""

    def __init__(self, cost: CostModel, opts: Options, scheduler: Scheduler) -> None:
        self.cost = cost
        self.opts = opts
        self.scheduler = scheduler
        self.ready_at = time.monotonic() + cost.startup_s
        self.engine_id = f"sim-{opts.port}-{uuid.uuid4().hex[:8]}"

    def job(self, work: Work, body: dict[str, Any]) -> Job:
        role, opts = self.opts.role, self.opts
        if role == "encode":
            return Job(mpixels=work.mpixels, prompt_tokens=0, output_tokens=0)
        encodes_here = not opts.is_ec_consumer
        kv = body.get("kv_transfer_params")
        if role == "decode" and isinstance(kv, dict) and kv.get("do_remote_prefill"):
            return Job(prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                       needs_prefill=False)
        output = 1 if role == "prefill" else work.output_tokens
        return Job(mpixels=work.mpixels if encodes_here else [],
                   prompt_tokens=work.prompt_tokens, output_tokens=output)

    async def pull_kv(self, job: Job) -> None:
        """D pulling P's KV before it decodes (per request, not batched)."""
        if not job.needs_prefill:
            ms = self.cost.kv_transfer.per_ktoken_ms * job.prompt_tokens / 1000
            await asyncio.sleep(ms / 1000.0 * self.cost.time_scale)

    def kv_params(self) -> dict[str, Any] | None:
        if self.opts.role != "prefill":
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_block_ids": [0],
                "remote_host": self.opts.host, "remote_port": self.opts.port,
                "tp_size": self.opts.tensor_parallel}

    def metrics(self) -> str:
        s, name = self.scheduler, self.opts.name
        label = f'{{model_name="{name}"}}'
        return "".join([
            f"vllm:num_requests_running{label} {len(s.running)}\n",
            f"vllm:num_requests_waiting{label} {len(s.waiting)}\n",
            f"vllm:prompt_tokens_total{label} {s.tokens_in}\n",
            f"vllm:generation_tokens_total{label} {s.tokens_out}\n",
            f"epdctl_sim_steps_total{label} {s.step_count}\n",
            f"epdctl_sim_busy_seconds_total{label} {s.busy_s:.6f}\n",
        ])


def _json(status: int, body: object) -> web.Response:
    return web.json_response(body, status=status)


def _choice(chat: bool, text: str, finish: str | None, stream: bool) -> dict[str, Any]:
    if chat and stream:
        return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish}


def make_app(engine: Engine) -> web.Application:
    key = os.environ.get(KEY_ENV)

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if key is not None and request.path != "/health" and \
                request.headers.get("authorization") != f"Bearer {key}":
            return _json(401, {"error": "Unauthorized"})
        response: web.StreamResponse = await handler(request)
        return response

    async def health(_: web.Request) -> web.Response:
        if time.monotonic() < engine.ready_at:
            return _json(503, {"error": "starting"})
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return _json(200, {"object": "list", "data": [
            {"id": engine.opts.name, "object": "model", "owned_by": "epdctl-sim",
             "max_model_len": engine.opts.max_model_len}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine.metrics(), content_type="text/plain")

    async def complete(request: web.Request) -> web.StreamResponse:
        return await _complete(request, engine)

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


async def _complete(request: web.Request, engine: Engine) -> web.StreamResponse:
    """/v1/chat/completions and /v1/completions: the request scheduled as a job (a decoder's
    after pulling its KV), then streamed or answered whole."""
    chat = request.path == "/v1/chat/completions"
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        return _json(400, {"error": {"message": "body is not JSON", "code": 400}})
    if not isinstance(body, dict):
        return _json(400, {"error": {"message": "body must be an object", "code": 400}})
    work = parse_work(body, chat, engine.cost.model)
    job = engine.job(work, body)
    if job.prompt_tokens + job.output_tokens > engine.opts.max_model_len:
        return _json(400, {"error": {"message": f"{job.prompt_tokens} prompt tokens + "
                                     f"{job.output_tokens} exceed max_model_len "
                                     f"{engine.opts.max_model_len}", "code": 400}})
    await engine.pull_kv(job)
    engine.scheduler.submit(job)
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()),
            "model": engine.opts.name}
    usage = {"prompt_tokens": job.prompt_tokens}
    if body.get("stream"):
        return await _stream(request, engine, job, chat, head, usage, body)
    return await _whole(engine, job, chat, head, usage)


async def _whole(engine: Engine, job: Job, chat: bool, head: dict[str, Any],
                 usage: dict[str, int]) -> web.Response:
    """The answer in one body, once the job has generated all its tokens."""
    try:
        while await job.events.get():
            pass
    except asyncio.CancelledError:
        job.is_aborted = True
        raise
    n = job.generated
    answer = {**head, "object": "chat.completion" if chat else "text_completion",
              "choices": [_choice(chat, TOKEN_TEXT * n, "length", False)],
              "usage": {**usage, "completion_tokens": n,
                        "total_tokens": job.prompt_tokens + n}}
    if (params := engine.kv_params()) is not None:
        answer["kv_transfer_params"] = params
    return _json(200, answer)


async def _stream(request: web.Request, engine: Engine, job: Job, chat: bool,
                  head: dict[str, Any], usage: dict[str, int], body: dict[str, Any]
                  ) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    kind = "chat.completion.chunk" if chat else "text_completion"

    async def send(chunk: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps({**head, 'object': kind, **chunk})}\n\n"
                             .encode())

    try:
        is_first = True
        while await job.events.get():
            if chat and is_first:  # as vLLM: the role chunk comes with the first token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                         "finish_reason": None}]})
            is_first = False
            last = job.generated >= job.output_tokens
            await send({"choices": [_choice(chat, TOKEN_TEXT, "length" if last else None,
                                            True)]})
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await send({"choices": [], "usage": {
                **usage, "completion_tokens": job.generated,
                "total_tokens": job.prompt_tokens + job.generated}})
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionError, asyncio.CancelledError):
        job.is_aborted = True
        raise
    await response.write_eof()
    return response


def build(opts: Options) -> Engine:
    """The engine for these options (its scheduler not started); exits on a bad setup."""
    if not opts.cost_model:
        raise SystemExit("epdctl.sim.engine: no cost model: give --cost-model FILE "
                         "(or $EPDCTL_SIM_COST_MODEL)")
    from epdctl.errors import EpdctlError

    try:
        cost = load_cost_model(opts.cost_model)
    except EpdctlError as exc:
        raise SystemExit(f"epdctl.sim.engine: {exc}") from None
    try:
        kv_tokens = kv_capacity(cost, opts)
    except OutOfMemory as exc:
        raise SystemExit(f"torch.OutOfMemoryError: {exc}") from None
    share = GpuShare(sim_dir(), opts.gpus) if opts.gpus else None
    scheduler = Scheduler(cost, tp=opts.tensor_parallel, max_seqs=opts.max_num_seqs,
                          kv_tokens=kv_tokens, share=share)
    return Engine(cost, opts, scheduler)


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(sys.argv[1:] if argv is None else argv)
    engine = build(opts)
    app = make_app(engine)

    async def start_scheduler(app: web.Application) -> Any:
        task = asyncio.create_task(engine.scheduler.run())
        yield
        task.cancel()

    app.cleanup_ctx.append(start_scheduler)
    print(f"epdctl-sim: {opts.role} serving {opts.name} on {opts.host}:{opts.port} "
          f"gpus {','.join(opts.gpus) or '-'} tp {opts.tensor_parallel} pid {os.getpid()}",
          flush=True)
    web.run_app(app, host=opts.host, port=opts.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
