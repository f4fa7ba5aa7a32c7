"""Drain before stop and restart one instance, as a user runs them: `epdctl down --drain`,
Ctrl+C on a foreground `up`, `epdctl restart pd-0`; epdctl's real proxy in front of fake
engines (tests/fake_server.py) that take 3 s an answer, so requests are in flight when the
command acts.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.helpers import cli_env, epdctl, finish, marked_pids, spawn_epdctl
from tests.waits import until_sync

pytestmark = pytest.mark.timeout(240)
ANSWER_S = "3"
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def env(state_root: Path) -> Iterator[dict[str, str]]:
    yield cli_env(state_root, fake_proxy=False)  # epdctl's own proxy: it drains


def proxy_url(state_root: Path, name: str = "fake") -> str:
    doc = json.loads((state_root / name / "state.json").read_text())
    proxy = next(s for s in doc["specs"] if s["role"] == "proxy")
    return f"http://127.0.0.1:{proxy['port']}"


def health(url: str) -> dict[str, Any]:
    try:
        return httpx.get(f"{url}/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


class Clients:
    """Requests sent in threads, plain and streamed; what each got back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str]] = []
        self.threads: list[threading.Thread] = []

    def send(self, n: int, *, stream: bool) -> None:
        for _ in range(n):
            thread = threading.Thread(target=self._one, args=(stream,))
            thread.start()
            self.threads.append(thread)

    def _one(self, stream: bool) -> None:
        try:
            reply = httpx.post(f"{self.url}/v1/chat/completions",
                               json={**BODY, "stream": stream}, timeout=60)
            self.answers.append((reply.status_code, reply.text))
        except httpx.HTTPError as exc:
            self.answers.append((0, repr(exc)))

    def join(self) -> list[tuple[int, str]]:
        for thread in self.threads:
            thread.join(60)
        return self.answers


def is_whole(answer: tuple[int, str], stream: bool) -> bool:
    status, text = answer
    if status != 200:
        return False
    if text.startswith("data:") != stream:
        return False
    if stream:
        return text.rstrip().endswith("data: [DONE]") and "hello" in text
    return json.loads(text)["choices"][0]["message"]["content"] == "hello from fake"


def test_down_drains_what_is_in_flight_and_refuses_what_comes(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    topo = fake_topology(encode_args=None, pd_args=("--answer-after", ANSWER_S))
    up = epdctl(env, "up", str(topo), "-d", "--timeout", "60")
    assert up.returncode == 0, up.stderr
    url = proxy_url(state_root)
    clients = Clients(url)
    clients.send(3, stream=False)
    clients.send(3, stream=True)
    until_sync(lambda: health(url).get("inflight") == 6, "six requests in flight")

    down = spawn_epdctl(env, "down", "--drain", "60")
    until_sync(lambda: health(url).get("status") == "draining", "the proxy draining")
    refused = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "draining" in refused.json()["error"]["message"]

    code, _, err = finish(down, 120)
    assert code == 0, err
    answers = clients.join()
    assert len(answers) == 6
    assert sum(is_whole(a, stream=False) for a in answers) == 3, answers
    assert sum(is_whole(a, stream=True) for a in answers) == 3, answers
    assert "Drained fake: 6 request(s) finished." in err, err
    assert marked_pids(state_root / "fake") == set()


def test_down_no_drain_cuts_what_is_in_flight(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    topo = fake_topology(encode_args=None, pd_args=("--answer-after", ANSWER_S))
    assert epdctl(env, "up", str(topo), "-d", "--timeout", "60").returncode == 0
    url = proxy_url(state_root)
    clients = Clients(url)
    clients.send(2, stream=False)
    until_sync(lambda: health(url).get("inflight") == 2, "two requests in flight")
    down = epdctl(env, "down", "--no-drain", "--timeout", "5")
    assert down.returncode == 0, down.stderr
    assert "Drained" not in down.stderr
    assert not any(is_whole(a, stream=False) for a in clients.join())


def test_ctrl_c_on_a_foreground_up_drains_then_stops(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    topo = fake_topology(encode_args=None, pd_args=("--answer-after", ANSWER_S))
    up = spawn_epdctl(env, "up", str(topo), "--timeout", "60")
    try:
        until_sync(lambda: (state_root / "fake" / "state.json").exists()
                   and json.loads((state_root / "fake" / "state.json").read_text())["phase"]
                   == "running", "the topology running", timeout_s=60)
        url = proxy_url(state_root)
        clients = Clients(url)
        clients.send(4, stream=True)
        until_sync(lambda: health(url).get("inflight") == 4, "four requests in flight")
        up.send_signal(signal.SIGINT)
        code, _, err = finish(up, 120)
    finally:
        up.kill()
    assert code == 130, err
    answers = clients.join()
    assert sum(is_whole(a, stream=True) for a in answers) == 4, answers
    assert "draining: 4 request(s) in flight finish first" in err, err
    assert "Drained fake: 4 request(s) finished." in err, err
    assert marked_pids(state_root / "fake") == set()


def test_restart_one_pd_while_the_other_serves_loses_nothing(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    topo = fake_topology(encode_args=None, pd_args=("--answer-after", "1"))
    text = topo.read_text().replace("prefill_decode: {", "prefill_decode: {replicas: 2, ")
    topo.write_text(text)
    assert epdctl(env, "up", str(topo), "-d", "--timeout", "60").returncode == 0
    run_dir = state_root / "fake"
    before = json.loads((run_dir / "state.json").read_text())["records"]
    url = proxy_url(state_root)
    stop = threading.Event()
    answers: list[int] = []

    def load() -> None:  # a client that keeps asking, one request after another
        while not stop.is_set():
            try:
                answers.append(httpx.post(f"{url}/v1/chat/completions", json=BODY,
                                          timeout=60).status_code)
            except httpx.HTTPError:
                answers.append(0)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        until_sync(lambda: len(answers) >= 4, "the load under way")
        restart = epdctl(env, "restart", "pd-0", "--drain", "30", "--json", timeout_s=120)
        assert restart.returncode == 0, restart.stderr
        done = json.loads(restart.stdout)["restarted"][0]
        count = len(answers)
        until_sync(lambda: len(answers) >= count + 8, "more answers after the restart")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    after = json.loads((run_dir / "state.json").read_text())["records"]
    assert done["name"] == "pd-0" and done["cut"] == 0
    assert after["pd-0"]["pid"] != before["pd-0"]["pid"]
    assert after["pd-0"]["restarts"] == before["pd-0"]["restarts"]  # asked for: no crash
    assert after["pd-1"]["pid"] == before["pd-1"]["pid"]
    assert answers and set(answers) == {200}, answers
    assert health(url)["roles"]["prefill_decode"]["in"] == 2
    assert epdctl(env, "down").returncode == 0


def test_restart_refuses_the_proxy_and_unknown_names(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    assert epdctl(env, "up", str(fake_topology(encode_args=None)), "-d").returncode == 0
    try:
        proxy = epdctl(env, "restart", "proxy")
        assert proxy.returncode == 1 and "is the proxy" in proxy.stderr
        assert len(proxy.stderr.strip().splitlines()) == 1
        unknown = epdctl(env, "restart", "pd-7")
        assert unknown.returncode == 1 and "no instance `pd-7`" in unknown.stderr
        assert "pd-0" in unknown.stderr
    finally:
        assert epdctl(env, "down").returncode == 0
