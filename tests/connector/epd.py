"""Helpers for the connector's end-to-end tests: an E and a PD instance sharing a store."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdctl.cache import CONNECTOR_MODULE, CONNECTOR_NAME
from epdctl.cache.stats import read_stats
from epdctl.cache.store import Store
from tests.harness import (
    Server,
    image_data_url,
    make_image,
    start_engine,
    stop_marked,
    stop_servers,
    wait_all_ready,
)

NAMESPACE = "e2e-test"
# DEBUG shows vLLM's "Finish execute for mm hash H" (the encoder ran) and our
# "Success load encoder cache for hash H"; unbuffered so the log is current.
DEBUG_ENV = {"VLLM_LOGGING_LEVEL": "DEBUG", "PYTHONUNBUFFERED": "1"}


def ec_config(role: str, store_dir: Path, engine_id: str) -> str:
    return json.dumps(
        {
            "ec_connector": CONNECTOR_NAME,
            "ec_connector_module_path": CONNECTOR_MODULE,
            "ec_role": role,
            "engine_id": engine_id,
            "ec_connector_extra_config": {"store_dir": str(store_dir), "namespace": NAMESPACE},
        }
    )


@dataclass
class EPD:
    """An E (producer) and a PD (consumer) over one store, plus an optional baseline."""

    encoder: Server
    pd: Server
    store_dir: Path
    baseline: Server | None = None

    @property
    def store(self) -> Store:
        return Store(self.store_dir, NAMESPACE)

    def counts(self) -> dict[str, float]:
        return dict(read_stats(self.store.root)[0])

    def wait_counts(self, key: str, at_least: float, timeout_s: float = 10.0) -> float:
        """Stats are flushed about once a second: poll until `key` reaches `at_least`."""
        deadline = time.monotonic() + timeout_s
        while (value := self.counts().get(key, 0)) < at_least and time.monotonic() < deadline:
            time.sleep(0.2)
        return value


@contextmanager
def epd(model: Path, logs: Path, *, baseline: Server | None = None) -> Iterator[EPD]:
    """Start E and PD (beside a baseline that may still be starting); stop them and remove
    the store afterwards (the baseline is the session's: tests/baselines.py)."""
    store_dir = Path(tempfile.mkdtemp(prefix="epdctl-test-", dir="/dev/shm"))
    servers: dict[str, Server] = {}
    try:
        for name, role, engine_id in (("encode", "ec_producer", "t-encode-0"),
                                      ("pd", "ec_consumer", "t-pd-0")):
            servers[name] = start_engine(
                model,
                log_path=logs / f"{name}.log",
                name=name,
                env=DEBUG_ENV,
                args=("--ec-transfer-config", ec_config(role, store_dir, engine_id)),
            )
        wait_all_ready(servers.values(), 300)
        if baseline is not None:
            wait_all_ready([baseline], 300, stop_on_failure=False)
        yield EPD(servers["encode"], servers["pd"], store_dir, baseline)
    finally:
        stop_servers(servers.values())
        stop_marked(logs)  # what a failed start left: E and PD are marked with their log dir
        shutil.rmtree(store_dir, ignore_errors=True)


def image(seed: int, size: int = 56) -> tuple[str, str]:
    """A data URL and its content-derived key (what the proxy sends as `uuid`)."""
    png = make_image(seed, size)
    return image_data_url(png), "img-" + hashlib.sha256(png).hexdigest()[:32]


def body(model: str, parts: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "What is in the image?"}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": False,
    }


def image_parts(*seeds: int, with_uuid: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    parts, keys = [], []
    for seed in seeds:
        url, key = image(seed)
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
        if with_uuid:
            part["uuid"] = key
        parts.append(part)
        keys.append(key)
    return parts, keys


def ec_item(entry: dict[str, Any], modality: str = "image") -> dict[str, Any]:
    """An `ec_transfer_params` item less the `modality` vLLM 0.33 adds (checked when there)."""
    rest = dict(entry)
    assert rest.pop("modality", modality) == modality, entry
    return rest


def post(server: Server, payload: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST /v1/chat/completions; (status, JSON body) for errors too."""
    req = urllib.request.Request(
        f"{server.base_url}/chat/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def text_of(response: dict[str, Any]) -> str:
    return response["choices"][0]["message"]["content"]


def log_has(server: Server, pattern: str) -> bool:
    return re.search(pattern, server.log_path.read_text(errors="replace")) is not None
