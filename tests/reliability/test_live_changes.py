"""Live changes as a user runs them (`epdctl scale`, `switch`, `apply`), under a steady stream
of requests (plain and streamed): epdctl's real proxy and supervisor in front of fake engines
(tests/fake_server.py, 0.5 s an answer), so that requests are in flight at every step. Every
request is answered whole, `status` agrees with what runs after each step, and what cannot
change is refused in one line with nothing changed."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.helpers import cli_env, epdctl, marked_pids
from tests.reliability.test_drain import BODY, health, is_whole, proxy_url
from tests.waits import until_sync

pytestmark = pytest.mark.timeout(300)


class Load:
    """Clients that keep asking, one request after another, streamed every other time."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url, self.stop = url, threading.Event()
        self.answers: list[tuple[bool, tuple[int, str]]] = []
        self.threads = [threading.Thread(target=self._loop, args=(i % 2 == 1,))
                        for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _loop(self, stream: bool) -> None:
        while not self.stop.is_set():
            try:
                reply = httpx.post(f"{self.url}/v1/chat/completions",
                                   json={**BODY, "stream": stream}, timeout=60)
                self.answers.append((stream, (reply.status_code, reply.text)))
            except httpx.HTTPError as exc:
                self.answers.append((stream, (0, repr(exc))))

    def more(self, n: int, what: str) -> None:
        count = len(self.answers)
        until_sync(lambda: len(self.answers) >= count + n, what, timeout_s=60)

    def end(self) -> list[tuple[bool, tuple[int, str]]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        return self.answers


@pytest.fixture
def env(state_root: Path) -> Iterator[dict[str, str]]:
    yield cli_env(state_root, fake_proxy=False)


def _status(env: dict[str, str]) -> dict[str, str]:
    """`epdctl status --json`: each engine's state, by name."""
    result = epdctl(env, "status", "--json")
    assert result.returncode == 0, result.stderr
    return {i["name"]: i["state"] for i in json.loads(result.stdout)["instances"]
            if i["role"] != "proxy"}


def _requests(state_root: Path, name: str) -> int:
    """Completions the fake engine `name` has answered (its log, this run and earlier)."""
    log = state_root / "fake" / "logs" / f"{name}.log"
    return log.read_text().count("fake: POST /v1/chat/completions")


def _change(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    result = epdctl(env, *args, "--drain", "30", "--timeout", "60", "--json", timeout_s=180)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["steps"]


def test_scale_switch_and_apply_while_serving_lose_nothing(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    topo = fake_topology(pd_args=("--answer-after", "0.5"))
    assert epdctl(env, "up", str(topo), "-d", "--timeout", "60").returncode == 0
    url = proxy_url(state_root)
    load = Load(url)
    try:
        load.more(4, "the load under way")
        steps = _change(env, "scale", "pd=2")
        assert [(s["step"], s["name"]) for s in steps] == [("add", "pd-1")]
        assert _status(env) == {"encode-0": "ready", "pd-0": "ready", "pd-1": "ready"}
        assert health(url)["roles"]["prefill_decode"]["in"] == 2
        until_sync(lambda: _requests(state_root, "pd-1") >= 2, "pd-1 answering", timeout_s=60)

        steps = _change(env, "switch", "pd-1", "encode")
        assert [(s["step"], s["name"]) for s in steps] == [("switch", "encode-1")]
        assert _status(env) == {"encode-0": "ready", "pd-0": "ready", "encode-1": "ready"}
        roles = health(url)["roles"]
        assert (roles["encode"]["in"], roles["prefill_decode"]["in"]) == (2, 1)
        load.more(8, "answers with two encoders")
        steps = _change(env, "switch", "encode-1", "pd")
        assert [(s["step"], s["name"]) for s in steps] == [("switch", "pd-1")]
        load.more(8, "answers with two PDs again")

        edited = topo.with_name("edited.yaml")  # pd answers faster; one PD again
        edited.write_text(topo.read_text().replace(
            "prefill_decode: {args: ['--answer-after', '0.5']}",
            "prefill_decode: {args: ['--answer-after', '0.2']}"))
        plan = epdctl(env, "apply", str(edited), "--dry-run")
        assert plan.returncode == 0 and plan.stdout.splitlines() == [
            "remove pd-1 (prefill_decode)", "restart pd-0 as the file now defines it"]
        steps = _change(env, "apply", str(edited))
        assert [(s["step"], s["name"]) for s in steps] == [("remove", "pd-1"),
                                                          ("replace", "pd-0")]
        assert _status(env) == {"encode-0": "ready", "pd-0": "ready"}
        state = json.loads((state_root / "fake" / "state.json").read_text())
        pd = next(s for s in state["specs"] if s["name"] == "pd-0")
        assert pd["args"][-1] == "0.2" and state["topology_path"] == str(edited)
        again = epdctl(env, "apply", str(edited))
        assert again.returncode == 0 and "Nothing to change" in again.stderr
        load.more(8, "answers after apply")
    finally:
        answers = load.end()
    assert answers and all(is_whole(a, stream) for stream, a in answers), [
        a for stream, a in answers if not is_whole(a, stream)][:3]
    log = [json.loads(line) for line in
           (state_root / "fake" / "changes.jsonl").read_text().splitlines()]
    assert [e["reason"].split(":")[0] for e in log if "reason" in e] == [
        "scale pd=2", "switch pd-1 encode", "switch encode-1 prefill_decode",
        f"apply {edited}", f"apply {edited}"]
    removed = epdctl(env, "logs", "encode-1", "-n", "3")  # its log outlives it
    assert removed.returncode == 0 and "encode-1" in removed.stdout, removed.stderr
    assert epdctl(env, "down").returncode == 0
    assert marked_pids(state_root / "fake") == set()


@pytest.mark.parametrize(("args", "message"), [
    (["scale", "pd=0"], "keeps at least one instance"),
    (["scale", "x=2"], "no role 'x'"),
    (["scale", "pd"], "expected ROLE=N"),
    (["scale", "p=2"], "has no prefill role"),
    (["switch", "pd-0", "encode"], "the only prefill_decode instance"),
    (["switch", "pd-7", "encode"], "no instance `pd-7`"),
    (["switch", "encode-0", "e"], "already an instance of encode"),
])
def test_what_cannot_change_is_refused_in_one_line(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path,
        args: list[str], message: str) -> None:
    assert epdctl(env, "up", str(fake_topology()), "-d", "--timeout", "60").returncode == 0
    try:
        before = (state_root / "fake" / "state.json").read_text()
        result = epdctl(env, *args)
        assert result.returncode == 1 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
        assert json.loads((state_root / "fake" / "state.json").read_text())["specs"] == \
            json.loads(before)["specs"]
    finally:
        assert epdctl(env, "down").returncode == 0


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("model: fake-model", "model: other-model"), "namespace differs"),
    (lambda t: t.replace("  encode: {args: []}\n", ""), "the roles differ"),
    (lambda t: t.replace("name: fake", "name: other"), "the name differs"),
    (lambda t: t.replace("proxy: {port:", "proxy: {max_inflight: 7, port:"),
     "the proxy's settings differ"),
])
def test_apply_refuses_what_a_running_topology_cannot_change(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path,
        edit: Callable[[str], str], message: str) -> None:
    topo = fake_topology()
    assert epdctl(env, "up", str(topo), "-d", "--timeout", "60").returncode == 0
    try:
        edited = topo.with_name("edited.yaml")
        edited.write_text(edit(topo.read_text()))
        result = epdctl(env, "apply", str(edited))
        assert result.returncode == 1 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        scale = epdctl(env, "scale", "pd=2", "--dry-run")  # the run's own file still rules
        assert scale.returncode == 0 and scale.stdout.strip() == "add pd-1 (prefill_decode)"
    finally:
        assert epdctl(env, "down").returncode == 0


def test_an_instance_that_does_not_come_up_is_undone_and_the_old_one_serves(
        env: dict[str, str], fake_topology: Callable[..., Path], state_root: Path) -> None:
    """apply's new pd-0 dies while starting: the command fails in one line saying so, the
    old pd-0 is started again as it was, and the requests sent meanwhile are all answered
    (they wait for it within the proxy's replay_wait)."""
    topo = fake_topology(encode_args=None, pd_args=("--answer-after", "0.2"))
    assert epdctl(env, "up", str(topo), "-d", "--timeout", "60").returncode == 0
    url = proxy_url(state_root)
    load = Load(url, clients=2)
    try:
        load.more(2, "the load under way")
        edited = topo.with_name("broken.yaml")
        edited.write_text(topo.read_text().replace(
            "['--answer-after', '0.2']", "['--ready-after', '30', '--exit-after', '0.5']"))
        result = epdctl(env, "apply", str(edited), "--timeout", "60", timeout_s=180)
        assert result.returncode == 1, result.stderr
        assert "exited with code 1 while starting" in result.stderr, result.stderr
        assert "`pd-0` is back as it was" in result.stderr
        assert _status(env) == {"pd-0": "ready"}
        state = json.loads((state_root / "fake" / "state.json").read_text())
        pd = next(s for s in state["specs"] if s["name"] == "pd-0")
        assert pd["args"][-2:] == ["--answer-after", "0.2"]
        assert state["topology_path"] == str(topo.absolute())
        load.more(4, "answers from the old pd-0")
    finally:
        answers = load.end()
    assert answers and all(is_whole(a, stream) for stream, a in answers), [
        a for stream, a in answers if not is_whole(a, stream)][:3]
    errors = [json.loads(line) for line in
              (state_root / "fake" / "changes.jsonl").read_text().splitlines()]
    assert any("exited with code 1 while starting" in e.get("error", "") for e in errors)
    assert epdctl(env, "down").returncode == 0
    assert marked_pids(state_root / "fake") == set()
