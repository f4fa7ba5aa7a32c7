"""Network-side faults through the real proxy: dead or hung instances, auth, hostile bodies.

The proxy process is the real one (`epdctl up` with no EPDCTL_PROXY_COMMAND); the engines are
tests/fake_server.py, stopped, frozen and killed for real. One in-process test drives the
proxy app over fake upstreams, and one fuzzes its request parser.
"""

from __future__ import annotations

import base64
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reliability.helpers import cli_env, edit_topology, epdctl, kill_group, wait_for

pytestmark = pytest.mark.timeout(180)
MODEL = "fake-model"
IMAGE = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really an image").decode()


def chat_body(*, image: bool = False, stream: bool = False) -> dict[str, Any]:
    content: Any = "hi"
    if image:
        content = [{"type": "image_url", "image_url": {"url": IMAGE}},
                   {"type": "text", "text": "what is it?"}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "stream": stream}


class Run:
    """A fake-engine topology brought up by `python -m epdctl up -d` with the real proxy."""

    def __init__(self, env: dict[str, str], run_dir: Path) -> None:
        self.env, self.run_dir = env, run_dir
        self.state = json.loads((run_dir / "state.json").read_text())
        proxy = next(s for s in self.state["specs"] if s["role"] == "proxy")
        self.url = f"http://127.0.0.1:{proxy['port']}"
        self.urls = {s["name"]: f"http://127.0.0.1:{s['port']}" for s in self.state["specs"]}

    def pid(self, name: str) -> int:
        return int(self.state["records"][name]["pid"])

    def health(self) -> dict[str, Any]:
        """The proxy's /health as epdctl's own tools see it (with the run's internal key)."""
        proxy = next(s for s in self.state["specs"] if s["role"] == "proxy")
        key = proxy["env"]["EPDCTL_PROXY_UPSTREAM_KEY"]
        return dict(httpx.get(f"{self.url}/health", timeout=5,
                              headers={"authorization": f"Bearer {key}"}).json())

    def status(self) -> dict[str, Any]:
        result = epdctl(self.env, "status", "--json")
        return dict(json.loads(result.stdout))

    def posts(self, name: str) -> int:
        """Completion requests the fake instance `name` has logged."""
        log = (self.run_dir / "logs" / f"{name}.log").read_text()
        return log.count("POST /v1/chat/completions")


@pytest.fixture
def bring_up(state_root: Path) -> Iterator[Callable[[Path], Run]]:
    env = cli_env(state_root, fake_proxy=False)
    started: list[Run] = []

    def up(topo: Path) -> Run:
        result = epdctl(env, "up", str(topo), "-d", "--timeout", "60")
        assert result.returncode == 0, result.stderr
        run = Run(env, state_root / yaml_name(topo))
        started.append(run)
        return run

    yield up
    if started:  # the state_root fixture then stops anything `down` missed
        epdctl(env, "down", "--timeout", "5")


def yaml_name(topo: Path) -> str:
    import yaml

    return str(yaml.safe_load(topo.read_text())["name"])


def assert_complete(reply: httpx.Response, *, stream: bool) -> None:
    """200 with a whole answer: JSON with a message, or a stream that ends with [DONE]."""
    assert reply.status_code == 200, reply.text
    if stream:
        assert reply.text.rstrip().endswith("data: [DONE]"), reply.text
        assert '"error"' not in reply.text
    else:
        assert reply.json()["choices"][0]["message"]["content"]


def test_a_dead_pd_replica_leaves_the_others_serving(bring_up, fake_topology) -> None:
    """SIGKILL pd-1: every request still answers 200 (retried on pd-0), health says who's out."""
    topo = fake_topology(extra="restart: {policy: on-failure, max_restarts: 1, backoff: 60s}\n")

    def two_pds(data: dict[str, Any]) -> None:
        data["roles"]["prefill_decode"]["replicas"] = 2

    run = bring_up(edit_topology(topo, two_pds))
    assert run.health()["status"] == "ok"
    kill_group(run.pid("pd-1"))
    with httpx.Client(base_url=run.url, timeout=30) as client:
        for n in range(24):
            stream = n % 3 == 0
            assert_complete(client.post("/v1/chat/completions",
                                        json=chat_body(image=n % 2 == 0, stream=stream)),
                            stream=stream)
    health = wait_for(lambda: (h := run.health())["status"] == "degraded" and h, 20)
    assert health, run.health()
    assert health["roles"]["prefill_decode"] == {"in": [run.urls["pd-0"]],
                                                 "out": [run.urls["pd-1"]]}
    status = run.status()
    states = {i["name"]: i["state"] for i in status["instances"]}
    assert states["pd-1"] in ("backoff", "exited") and states["pd-0"] == "ready"
    assert status["ready"] is False
    assert run.posts("pd-0") >= 24


def test_a_hung_encoder_is_ejected_then_readmitted(bring_up, fake_topology) -> None:
    """SIGSTOP encode-0: image requests still succeed (PD encodes); once the proxy ejects it
    they no longer wait for it; after SIGCONT it is re-admitted and used again."""
    topo = fake_topology()

    def short_encode_timeout(data: dict[str, Any]) -> None:
        data["proxy"]["encode_timeout"] = 4

    run = bring_up(edit_topology(topo, short_encode_timeout))
    with httpx.Client(base_url=run.url, timeout=30) as client:
        assert_complete(client.post("/v1/chat/completions", json=chat_body(image=True)),
                        stream=False)
        assert run.posts("encode-0") == 1
        kill_group(run.pid("encode-0"), signal.SIGSTOP)
        try:
            begin = time.monotonic()
            assert_complete(client.post("/v1/chat/completions", json=chat_body(image=True)),
                            stream=False)
            assert time.monotonic() - begin >= 4  # it did wait for the hung encoder
            assert wait_for(lambda: run.health()["roles"]["encode"]["out"], 20)
            for n in range(6):
                begin = time.monotonic()
                assert_complete(client.post("/v1/chat/completions",
                                            json=chat_body(image=True, stream=n % 2 == 1)),
                                stream=n % 2 == 1)
                assert time.monotonic() - begin < 3, "waited for an ejected encoder"
            health = run.health()
            assert health["status"] == "degraded"
            assert health["roles"]["encode"]["out"] == [run.urls["encode-0"]]
            assert wait_for(lambda: {i["name"]: i["state"] for i in run.status()["instances"]}
                            ["encode-0"] == "unhealthy", 20)
        finally:
            kill_group(run.pid("encode-0"), signal.SIGCONT)
        assert wait_for(lambda: run.health()["status"] == "ok", 20), run.health()
        before = run.posts("encode-0")
        assert_complete(client.post("/v1/chat/completions", json=chat_body(image=True)),
                        stream=False)
        assert wait_for(lambda: run.posts("encode-0") > before, 5)
    metrics = httpx.get(f"{run.url}/metrics").text
    assert 'epdctl_proxy_fallbacks_total{reason="encoder"} 7.0' in metrics


def test_api_key_end_to_end(bring_up, fake_topology) -> None:
    """proxy.api_key reaches the proxy by env (not argv); 401 without it on all but /health.
    The instances require the run's internal key, which only the proxy presents: a request
    straight to one is refused, and no output shows either key."""
    key = "s3cret-key-for-tests"
    topo = fake_topology()

    def with_key(data: dict[str, Any]) -> None:
        data["proxy"]["api_key"] = key

    run = bring_up(edit_topology(topo, with_key))
    proxy = run.state["specs"][-1]
    internal = proxy["env"]["EPDCTL_PROXY_UPSTREAM_KEY"]
    assert proxy["env"] == {"EPDCTL_PROXY_API_KEY": key, "EPDCTL_PROXY_UPSTREAM_KEY": internal}
    assert len(internal) >= 40 and internal != key
    import psutil

    for name in ("encode-0", "pd-0", "proxy"):
        process = psutil.Process(run.pid(name))
        assert key not in " ".join(process.cmdline()) and internal not in " ".join(
            process.cmdline())
    assert psutil.Process(run.pid("proxy")).environ()["EPDCTL_PROXY_API_KEY"] == key
    for name in ("encode-0", "pd-0"):
        assert psutil.Process(run.pid(name)).environ()["VLLM_API_KEY"] == internal
    # The default bind is loopback only.
    process = psutil.Process(run.pid("proxy"))
    listening = {c.laddr.ip for c in process.net_connections("tcp") if c.status == "LISTEN"}
    assert listening == {"127.0.0.1"}

    good = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=run.url, timeout=30) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": key}):
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                 ("GET", "/v1/models"), ("GET", "/metrics")):
                body = chat_body() if "chat" in path else {"model": MODEL, "prompt": "hi"}
                reply = client.request(method, path, headers=headers,
                                       json=body if method == "POST" else None)
                assert reply.status_code == 401, (path, headers, reply.text)
                assert reply.content == b'{"error":"Unauthorized"}', reply.text
        assert client.get("/health").status_code == 200
        assert_complete(client.post("/v1/chat/completions", json=chat_body(image=True),
                                    headers=good), stream=False)
        assert_complete(client.post("/v1/chat/completions", json=chat_body(stream=True),
                                    headers=good), stream=True)
        assert client.get("/v1/models", headers=good).json()["data"][0]["id"] == MODEL
    assert run.posts("pd-0") == 2  # refused requests never reached an instance
    # Straight to an instance: without the internal key (the proxy's key is not it), 401.
    for name in ("encode-0", "pd-0"):
        for headers in ({}, good, {"authorization": "Bearer wrong"}):
            reply = httpx.post(f"{run.urls[name]}/v1/chat/completions", json=chat_body(),
                               headers=headers, timeout=10)
            assert reply.status_code == 401, (name, headers)
        assert httpx.get(f"{run.urls[name]}/health", timeout=10).status_code == 200
    assert run.posts("pd-0") == 2
    assert epdctl(run.env, "status").returncode == 0  # the supervisor's probes need no key
    shown = [epdctl(run.env, *args) for args in (("status",), ("status", "--json"),
                                                 ("logs", "-n", "200"),
                                                 ("up", str(topo), "--dry-run"))]
    assert all(r.returncode == 0 for r in shown), [r.stderr for r in shown]
    logs = [p.read_text() for p in (run.run_dir / "logs").iterdir()]
    for text in [r.stdout + r.stderr for r in shown] + logs:
        assert key not in text and internal not in text
    assert "VLLM_API_KEY=<internal>" in shown[-1].stdout


@pytest.mark.anyio
async def test_sole_encoder_ejected_is_skipped_until_readmitted(rig_factory) -> None:
    """In process: with every encoder out, E gets nothing and PD gets the raw media."""
    from tests.proxy.fakes import Fakes, image_part

    fakes = Fakes(encoder_metadata={"image_grid_thw": [1, 2, 2]})
    rig = rig_factory(fakes, encode=("http://e0",), eject_after=2)
    fakes.down.add("e0")
    for _ in range(2):
        await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    for _ in range(3):
        assert (await rig.chat([image_part()])).status_code == 200
    assert fakes.posts("e0") == []
    assert [p.body["messages"][0]["content"][0]["type"] for p in fakes.posts("pd")] == [
        "image_url"] * 3
    fakes.down.clear()
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    assert (await rig.chat([image_part()])).status_code == 200
    assert len(fakes.posts("e0")) == 1
    assert fakes.posts("pd")[-1].body["messages"][0]["content"][0]["type"] == "image_embeds"


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "messages", "stream", "prompt", "content", "role", "type",
                         "image_url", "url", "uuid", "mm_processor_kwargs"]) | st.text(max_size=3),
        inner, max_size=4),
    max_leaves=12,
)
RAW = st.binary(max_size=64) | JSONISH.map(lambda v: json.dumps(v).encode()) | st.builds(
    lambda v, cut: json.dumps(v).encode()[:cut], JSONISH, st.integers(0, 40))


@settings(max_examples=400, deadline=None)
@given(raw=RAW, route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_parse_body_accepts_or_refuses_with_a_4xx(raw: bytes, route: str) -> None:
    """Any bytes at all: a dict back, or a ProxyError with a 4xx and an OpenAI error body."""
    from epdctl.proxy.errors import ProxyError
    from epdctl.proxy.request.parse import find_media, parse_body

    try:
        body = parse_body(raw, route, (MODEL,))
    except ProxyError as exc:
        assert 400 <= exc.status < 500
        assert json.loads(exc.body())["error"]["message"] == exc.message
        return
    assert isinstance(body, dict)
    if route == "/v1/chat/completions":
        find_media(body)  # what parse_body accepted, media extraction must handle
