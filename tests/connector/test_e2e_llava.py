"""E|PD on real vLLM (CPU) with LLaVA: PD loads what E saved, and survives bad entries."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdctl.cache._format import PAGE_BYTES, decode_header
from tests.baselines import Baselines
from tests.connector.epd import (
    EPD,
    body,
    ec_item,
    epd,
    image_parts,
    log_has,
    post,
    text_of,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def servers(tiny_llava: Path, baselines: Baselines,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[EPD]:
    with epd(tiny_llava, tmp_path_factory.mktemp("epd-llava"),
             baseline=baselines.start(tiny_llava)) as running:
        yield running


def encode(s: EPD, *seeds: int) -> tuple[dict, list[str]]:
    """Send E the request (uuids on every image, non-streaming); the PD body and keys."""
    parts, keys = image_parts(*seeds)
    status, response = post(s.encoder, body(s.encoder.model, parts))
    assert status == 200, response
    assert response["usage"]["completion_tokens"] == 0
    # LLaVA has no placeholder metadata: the proxy keeps the image for PD.
    assert {k: ec_item(v) for k, v in response["ec_transfer_params"].items()} == {
        k: {"item_indices": [i], "metadata": {}} for i, k in enumerate(keys)
    }
    return body(s.pd.model, parts), keys


def reference(s: EPD, *seeds: int) -> str:
    assert s.baseline is not None
    parts, _ = image_parts(*seeds, with_uuid=False)
    status, response = post(s.baseline, body(s.baseline.model, parts))
    assert status == 200, response
    return text_of(response)


def loaded(s: EPD, key: str) -> bool:
    """PD's log: loaded from the store, and its own vision tower never ran for `key`."""
    return log_has(s.pd, f"Success load encoder cache for hash {key}") and not log_has(
        s.pd, f"Finish execute for mm hash {key}"
    )


def test_pd_uses_the_entries_and_matches_the_aggregated_server(servers: EPD) -> None:
    before = servers.counts()
    cases = [(1,), (2,), (3,), (4, 5)]
    for seeds in cases:
        pd_body, keys = encode(servers, *seeds)
        assert all(servers.store.has_entry(k) for k in keys)
        status, response = post(servers.pd, pd_body)
        assert status == 200, response
        assert text_of(response) == reference(servers, *seeds)
        assert all(loaded(servers, k) for k in keys), keys
    assert servers.wait_counts("loads", before.get("loads", 0) + 5) >= before.get("loads", 0) + 5
    # E's counters flush on their own clock (about once a second): wait for them too.
    assert servers.wait_counts("saves", before.get("saves", 0) + 5) >= before.get("saves", 0) + 5
    outputs = {text_of(post(servers.pd, encode(servers, s)[0])[1]) for s in (1, 2, 3)}
    assert len(outputs) == 3  # the images matter: not one constant answer


def test_swapped_entry_changes_the_output(servers: EPD) -> None:
    """Proof that PD takes the embeddings from the store: give image 6 the bytes of image 7."""
    _, (key7,) = encode(servers, 7)
    pd_body, (key6,) = encode(servers, 6)
    data = Path(servers.store.entry_path(key7)).read_bytes()
    header = decode_header(data[:PAGE_BYTES])
    servers.store.publish(key6, data[header.data_offset :], dtype=header.dtype, shape=header.shape)
    status, response = post(servers.pd, pd_body)
    assert status == 200, response
    assert text_of(response) == reference(servers, 7) != reference(servers, 6)


def test_deleted_entry_is_recomputed_locally(servers: EPD) -> None:
    pd_body, (key,) = encode(servers, 8)
    os.unlink(servers.store.entry_path(key))
    status, response = post(servers.pd, pd_body)
    assert status == 200, response
    assert text_of(response) == reference(servers, 8)
    assert log_has(servers.pd, f"Finish execute for mm hash {key}")
    assert servers.pd.healthy()


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_damaged_entry_is_not_used(servers: EPD, damage: str) -> None:
    seed = 9 if damage == "truncated" else 10
    pd_body, (key,) = encode(servers, seed)
    path = servers.store.entry_path(key)
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 64)
    else:
        with open(path, "r+b") as f:
            f.write(b"NOTOURS!")
    before = servers.counts().get("invalid", 0)
    status, response = post(servers.pd, pd_body)
    assert status == 200, response
    assert text_of(response) == reference(servers, seed)
    assert log_has(servers.pd, f"Finish execute for mm hash {key}")
    assert servers.wait_counts("invalid", before + 1) == before + 1
