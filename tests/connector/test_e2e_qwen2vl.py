"""E|PD on real vLLM (CPU) with Qwen2-VL: metadata-only requests, served or failed alone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connector.epd import EPD, body, epd, image_parts, log_has, post, text_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def servers(tiny_qwen2vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EPD]:
    logs = tmp_path_factory.mktemp("epd-qwen2vl")
    with epd(tiny_qwen2vl, logs) as running:
        yield running


def encode(s: EPD, seed: int) -> tuple[dict, dict, str]:
    """E encodes one image; returns the raw PD body, the metadata-only PD body and the key."""
    parts, (key,) = image_parts(seed)
    status, response = post(s.encoder, body(s.encoder.model, parts))
    assert status == 200, response
    (item,) = response["ec_transfer_params"].values()
    assert list(response["ec_transfer_params"]) == [key]
    assert item["metadata"] == {"image_grid_thw": [1, 4, 4]}  # 56 px, patch 14
    embeds = {"type": "image_embeds", "image_embeds": item["metadata"], "uuid": key}
    return body(s.pd.model, parts), body(s.pd.model, [embeds]), key


def test_metadata_only_request_is_served_from_the_store(servers: EPD) -> None:
    raw, meta_only, key = encode(servers, 1)
    status, response = post(servers.pd, meta_only)
    assert status == 200, response
    assert log_has(servers.pd, f"Success load encoder cache for hash {key}")
    assert not log_has(servers.pd, f"Finish execute for mm hash {key}")
    # The same answer as with the image itself (computed locally under another key).
    raw["messages"][0]["content"][0]["uuid"] = "local-" + key
    status, local = post(servers.pd, raw)
    assert status == 200, local
    assert text_of(response) == text_of(local)
    assert log_has(servers.pd, f"Finish execute for mm hash local-{key}")
    _, other, _ = encode(servers, 2)
    assert text_of(post(servers.pd, other)[1]) != text_of(response)


def test_missing_entry_fails_only_that_request(servers: EPD) -> None:
    raw, meta_only, key = encode(servers, 3)
    os.unlink(servers.store.entry_path(key))
    before = servers.counts().get("misses", 0)
    status, response = post(servers.pd, meta_only)
    assert status == 500, response
    assert response["error"]["code"] == 500
    assert servers.wait_counts("misses", before + 1) >= before + 1
    assert log_has(servers.pd, f"EC store miss for {key} .* has no media to encode")
    # The engine survived: the same request with its image works, and so does the next one.
    assert servers.pd.alive() and servers.pd.healthy()
    status, response = post(servers.pd, raw)
    assert status == 200, response
    _, meta_only, _ = encode(servers, 4)
    status, response = post(servers.pd, meta_only)
    assert status == 200, response
