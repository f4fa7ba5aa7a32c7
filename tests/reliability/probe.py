"""What the reliability suite does to and asks of a running CPU topology (tests/harness starts
it): a broken store, requests, and probes of its state, health and logs."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.harness import TopologyRun, image_data_url, make_image, wait_for


@contextmanager
def broken_store(run: TopologyRun) -> Iterator[None]:
    """E cannot save while inside: its tmpfs is full (a real ENOSPC) when store_root() could
    mount one, else the namespace's tmp/ is a file (ENOTDIR); and its pool of spare files
    (pre-allocated: a save into one needs no room) is a file too. Healed on the way out."""
    from epdctl.cache.store import Store

    store = Store(run.cache_dir, run.state().namespace)
    is_small = run.cache_dir.name == "small-shm"
    undo: list[Callable[[], None]] = []

    def aside(path: Path) -> None:
        """`path` renamed aside (its files keep their pages) and an empty file in its place
        (an inode, no page: it fits a full tmpfs)."""
        os.rename(path, path.with_name(f"{path.name}.aside"))
        undo.append(lambda: os.rename(path.with_name(f"{path.name}.aside"), path))
        path.touch()
        undo.append(path.unlink)

    try:
        # The pool first: a spare the writer is still making cannot land there after.
        aside(store.free)
        if is_small:
            filler = run.cache_dir / "filler"
            block = b"\0" * (256 << 10)
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            undo.append(filler.unlink)
            try:
                while True:  # unbuffered: a short write, then ENOSPC, and nothing to flush
                    os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
            finally:
                os.close(fd)
        else:
            aside(store.tmp)
        yield
    finally:
        for step in reversed(undo):
            step()


def debug_logs(data: dict[str, Any]) -> None:
    """DEBUG engine logs: vLLM's `Finish execute for mm hash H` and the connector's lines."""
    engine = data.setdefault("engine", {})
    engine["env"] = {**engine.get("env", {}), "VLLM_LOGGING_LEVEL": "DEBUG"}


def image(seed: int) -> tuple[str, str]:
    """The proxy's (and so E's and PD's) cache key for image `seed`, and its data URL."""
    from epdctl.proxy.request.media import content_key

    png = make_image(seed)
    return content_key("image", png), image_data_url(png)


def body(model: str, *, urls: tuple[str, ...] = (), uuid_: str | None = None,
         text: str = "What is in the image?", **extra: Any) -> dict[str, Any]:
    """A chat request at temperature 0 (images first, each with `uuid_` when given)."""
    parts: list[dict[str, Any]] = []
    for url in urls:
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
        if uuid_ is not None:
            part["uuid"] = uuid_
        parts.append(part)
    content: Any = [*parts, {"type": "text", "text": text}] if parts else text
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "temperature": 0.0, "max_tokens": 16, **extra}


def answer(base: str, request: dict[str, Any], timeout_s: float = 120,
           key: str | None = None) -> str:
    """POST to base's chat route (with `key`: an instance wants the run's internal key); the
    text of a 200 answer (anything else fails the test)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    reply = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=timeout_s,
                       headers=headers)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["message"]["content"]
    assert text
    return str(text)


def streamed(base: str, request: dict[str, Any], timeout_s: float = 120) -> str:
    """The text of a 200 stream that ends with [DONE] and has no error event."""
    pieces = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**request, "stream": True},
                      timeout=timeout_s) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        for choice in event["choices"]:
            pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


class Probe:
    """What a running topology shows: URLs, `status --json`, proxy /health, log offsets."""

    def __init__(self, run: TopologyRun) -> None:
        self.run = run
        specs = run.state().specs
        self.urls = {s.name: f"http://127.0.0.1:{s.port}" for s in specs}
        self.proxy = run.proxy_url

    def status(self) -> dict[str, dict[str, Any]]:
        result = self.run.cli("status", "--json")
        assert result.stdout, result.stderr  # exit 1 while one is not ready; an error: none
        return {i["name"]: i for i in json.loads(result.stdout)["instances"]}

    def health(self) -> tuple[int, dict[str, Any]]:
        try:
            reply = httpx.get(f"{self.proxy}/health", timeout=5,  # as epdctl's tools see it
                              headers={"authorization": f"Bearer {self.key}"})
        except httpx.HTTPError:
            return 0, {}
        return reply.status_code, reply.json()

    @property
    def key(self) -> str:
        """The run's internal key: what an instance asks of a request sent straight to it."""
        return str(self.run.state().internal_key)

    def encoders_out(self) -> list[str]:
        return list(self.health()[1].get("roles", {}).get("encode", {}).get("out", []))

    def pid(self, name: str) -> int:
        return int(self.run.state().records[name].pid)

    def mark(self, name: str) -> int:
        """The current length of an instance's log: later checks look past it."""
        return len(self.run.log(name))

    def logged(self, name: str, since: int, text: str) -> bool:
        return text in self.run.log(name)[since:]

    def wait_logged(self, name: str, since: int, text: str, timeout_s: float = 10) -> bool:
        return bool(wait_for(lambda: self.logged(name, since, text), timeout_s))

    def tree_rss(self) -> dict[str, int]:
        """Resident memory of each recorded process tree (engine workers included)."""
        out = {}
        for name, record in self.run.state().records.items():
            try:
                root = psutil.Process(record.pid)
                procs = [root, *root.children(recursive=True)]
                out[name] = sum(p.memory_info().rss for p in procs)
            except psutil.Error:
                out[name] = 0
        return out


_REFERENCES: dict[tuple[str, int], str] = {}


def reference(probe: Probe, seed: int, model: str = "tiny-llava") -> str:
    """PD's own answer for image `seed` under a private uuid (nothing from the store),
    computed once per PD URL (temperature 0: a restarted PD answers the same)."""
    pd = probe.urls["pd-0"]
    if (pd, seed) not in _REFERENCES:
        key, url = image(seed)
        _REFERENCES[pd, seed] = answer(pd, body(model, urls=(url,), uuid_=f"ref-{key}"),
                                       key=probe.key)
    return _REFERENCES[pd, seed]
