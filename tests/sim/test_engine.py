"""The fake engine over HTTP (in-process aiohttp server): routes, roles, streams, usage."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from epdctl.bench.images import png
from epdctl.sim.costmodel import CostModel, load_cost_model
from epdctl.sim.engine import Engine, OutOfMemory, kv_capacity, make_app
from epdctl.sim.options import Options, parse_options
from epdctl.sim.requests import DEFAULT_PIXELS, image_pixels, parse_work
from epdctl.sim.scheduler import Scheduler

FAST = CostModel.model_validate({"time_scale": 0.001})
IMAGE = "data:image/png;base64," + base64.b64encode(png(64, 32, 1)).decode()


def chat(max_tokens: int = 3, image: bool = True, **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "x" * 40}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": IMAGE}})
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}], **extra}


def serve(opts: Options, test: Callable[[TestClient, Engine], Awaitable[None]],
          cost: CostModel = FAST) -> None:
    async def main() -> None:
        engine = Engine(cost, opts, Scheduler(cost, tp=opts.tensor_parallel,
                                              kv_tokens=kv_capacity(cost, opts)))
        task = asyncio.create_task(engine.scheduler.run())
        async with TestClient(TestServer(make_app(engine))) as client:
            await test(client, engine)
        task.cancel()

    asyncio.run(main())


def test_options_pick_the_role_from_the_transfer_configs() -> None:
    argv = ["m", "--host", "127.0.0.1", "--port", "9", "--served-model-name", "s",
            "--enforce-eager", "--limit-mm-per-prompt", '{"image": 2}']
    assert parse_options(argv, {}).role == "prefill_decode"
    assert parse_options(argv, {}).name == "s"
    ec = ["--ec-transfer-config", json.dumps({"ec_role": "ec_producer"})]
    assert parse_options([*argv, *ec], {}).role == "encode"
    kv = json.dumps({"kv_role": "kv_consumer"})
    opts = parse_options([*argv, f"--kv-transfer-config={kv}", "--tensor-parallel-size", "2"],
                         {"CUDA_VISIBLE_DEVICES": "2,3", "EPDCTL_SIM_COST_MODEL": "c.yaml"})
    assert (opts.role, opts.tensor_parallel, opts.gpus, opts.cost_model) == (
        "decode", 2, ("2", "3"), "c.yaml")


def test_work_of_a_request() -> None:
    assert image_pixels(IMAGE) == 64 * 32
    assert image_pixels("https://example.com/a.png") == DEFAULT_PIXELS
    work = parse_work(chat(max_tokens=7), True, FAST.model)
    assert work.mpixels == [64 * 32 / 1e6]
    assert work.output_tokens == 7
    assert work.prompt_tokens == 10 + round(64 * 32 / 1e6 * 1275)
    assert parse_work({"prompt": [1, 2, 3], "max_tokens": 2}, False, FAST.model).prompt_tokens == 3


def test_jpeg_size_is_read() -> None:
    pil = pytest.importorskip("PIL.Image")
    import io

    buf = io.BytesIO()
    pil.new("RGB", (120, 80)).save(buf, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    assert image_pixels(url) == 120 * 80


def test_pd_answers_with_usage_and_streams() -> None:
    async def test(client: TestClient, engine: Engine) -> None:
        assert (await client.get("/health")).status == 200
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "m"
        reply = await client.post("/v1/chat/completions", json=chat(max_tokens=3))
        data = await reply.json()
        assert data["usage"]["completion_tokens"] == 3
        assert data["choices"][0]["message"]["content"] == "tok tok tok "
        stream = await client.post("/v1/chat/completions", json=chat(
            max_tokens=4, stream=True, stream_options={"include_usage": True}))
        events = [line for line in (await stream.text()).split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert contents == ["", "tok ", "tok ", "tok ", "tok "]
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        text = await (await client.post("/v1/completions", json={
            "prompt": "hello", "max_tokens": 2})).json()
        assert text["choices"][0]["text"] == "tok tok "
        metrics = await (await client.get("/metrics")).text()
        assert "vllm:generation_tokens_total" in metrics
        # aggregated PD encodes its images itself
        assert engine.scheduler.step_count > 0

    serve(parse_options(["m"], {}), test)


def test_encoder_prefill_and_decode_hand_off() -> None:
    async def encoder(client: TestClient, engine: Engine) -> None:
        reply = await client.post("/v1/chat/completions", json=chat(max_tokens=None))
        data = await reply.json()
        assert reply.status == 200 and data["usage"]["completion_tokens"] == 0

    producer = json.dumps({"ec_role": "ec_producer"})
    serve(parse_options(["m", "--ec-transfer-config", producer], {}), encoder)

    params: dict[str, Any] = {}

    async def prefill(client: TestClient, engine: Engine) -> None:
        body = chat(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        data = await (await client.post("/v1/chat/completions", json=body)).json()
        assert data["usage"]["completion_tokens"] == 1
        params.update(data["kv_transfer_params"])
        assert params["do_remote_prefill"] is True

    serve(parse_options(["m", "--kv-transfer-config", '{"kv_role": "kv_producer"}'], {}),
          prefill)

    async def decode(client: TestClient, engine: Engine) -> None:
        body = chat(max_tokens=5, kv_transfer_params=params)
        data = await (await client.post("/v1/chat/completions", json=body)).json()
        assert data["usage"]["completion_tokens"] == 5
        assert engine.scheduler.tokens_in == 0  # no prefill here: the KV came from P

    serve(parse_options(["m", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'], {}),
          decode)


def test_api_key_guards_every_route_but_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "k")

    async def test(client: TestClient, engine: Engine) -> None:
        assert (await client.get("/health")).status == 200
        assert (await client.get("/v1/models")).status == 401
        ok = await client.get("/v1/models", headers={"authorization": "Bearer k"})
        assert ok.status == 200

    serve(parse_options(["m"], {}), test)


def test_a_request_of_several_large_images_is_taken() -> None:
    """Four noisy 512x512 images (~3 MiB of base64, as a replayed trace sends an album):
    over aiohttp's default body limit of 1 MiB, which answered 413."""
    big = "data:image/png;base64," + base64.b64encode(png(512, 512, 7)).decode()
    body = chat(max_tokens=2)
    body["messages"][0]["content"][:1] = [{"type": "image_url", "image_url": {"url": big}}] * 4

    async def test(client: TestClient, engine: Engine) -> None:
        assert len(json.dumps(body)) > 1 << 20
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status == 200, await reply.text()
        assert (await reply.json())["usage"]["completion_tokens"] == 2

    serve(parse_options(["m"], {}), test)


def test_too_long_a_request_is_refused() -> None:
    async def test(client: TestClient, engine: Engine) -> None:
        reply = await client.post("/v1/completions", json={"prompt": [1] * 60,
                                                           "max_tokens": 10})
        assert reply.status == 400

    serve(parse_options(["m", "--max-model-len", "64"], {}), test)


def test_memory_decides_whether_an_instance_starts() -> None:
    small = CostModel.model_validate({"gpu": {"memory": "20GiB"},
                                      "model": {"weights": "16GiB", "kv_per_token": "1MiB"}})
    assert kv_capacity(small, parse_options(["m", "--ec-transfer-config",
                                             '{"ec_role": "ec_producer"}'], {})) is None
    with pytest.raises(OutOfMemory, match="KV cache"):  # 18 GiB - 17 GiB: 1024 tokens
        kv_capacity(small, parse_options(["m"], {}))
    tp2 = kv_capacity(small, parse_options(["m", "--tensor-parallel-size", "2"], {}))
    assert tp2 == (int(0.9 * 40 * (1 << 30)) - (17 << 30)) // (1 << 20)
    with pytest.raises(OutOfMemory, match="weights"):
        kv_capacity(small, parse_options(["m", "--gpu-memory-utilization", "0.5"], {}))


def test_cost_model_file(tmp_path: Path) -> None:
    from epdctl.errors import TopologyError

    path = tmp_path / "c.yaml"
    path.write_text("name: x\ntime_scale: 0.1\nencode: {fixed_ms: 3}\ngpu: {memory: 24GiB}\n")
    model = load_cost_model(path)
    assert (model.encode.fixed_ms, model.gpu.memory) == (3.0, 24 << 30)
    path.write_text("encode: {fixed_ms: -1, bogus: 2}\n")
    with pytest.raises(TopologyError, match="encode -> fixed_ms"):
        load_cost_model(path)
