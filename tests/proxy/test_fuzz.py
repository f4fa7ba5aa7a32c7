"""Random JSON bodies never make the proxy itself answer 500."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy.fakes import MODEL, TRANSPORTS, Fakes, rig_on_a_loop

KEYS = ["model", "messages", "stream", "content", "role", "type", "text", "image_url", "url",
        "uuid", "audio_url", "input_audio", "video_url", "data", "format", "prompt",
        "mm_processor_kwargs", "media_io_kwargs", "stream_options", "max_tokens",
        "kv_transfer_params", "ec_transfer_params"]
STRINGS = st.sampled_from([MODEL, "user", "image_url", "audio_url", "input_audio", "video_url",
                           "text", "data:image/png;base64," + base64.b64encode(b"png").decode(),
                           "data:image/png;base64,%%", "data:,x", "file:///x", "",
                           "http://img.invalid/x.png"]) | st.text(max_size=8)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | STRINGS
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=5),
    max_leaves=25,
)


def media_message() -> st.SearchStrategy:
    part = st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", "input_audio",
                                                            "video_url"])},
                                 optional={"image_url": JSON, "video_url": JSON,
                                           "input_audio": JSON, "text": JSON, "uuid": JSON})
    return st.fixed_dictionaries({"role": st.just("user"),
                                  "content": st.lists(part, max_size=3) | JSON})


BODIES = JSON | st.fixed_dictionaries(
    {"messages": st.lists(media_message(), max_size=3)},
    optional={"model": st.sampled_from([MODEL, "other"]) | JSON, "stream": st.booleans() | JSON,
              "mm_processor_kwargs": JSON, "media_io_kwargs": JSON, "prompt": JSON})


class Offline(Fakes):
    """The fakes; every `.invalid` host refuses (no network in tests)."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.host.endswith(".invalid"):
            raise httpx.ConnectError("no network in tests", request=request)
        return await super().handle(request)


@pytest.fixture(scope="module", params=TRANSPORTS)
def proxy(request):
    """One rig for every example, on each transport."""
    fakes = Offline(encoder_metadata={"image_grid_thw": [1, 2, 2]})
    with rig_on_a_loop(request.param, fakes, encode=("http://e0",), prefill=("http://p0",),
                       decode=("http://d0",)) as (loop, rig):
        yield loop, rig.client


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_bodies_never_cause_a_proxy_500(proxy, body, path):
    loop, client = proxy
    r = loop.run_until_complete(client.post(path, content=json.dumps(body).encode()))
    assert r.status_code < 500, (r.status_code, r.text)
    if r.headers["content-type"].startswith("application/json"):
        json.loads(r.content)
