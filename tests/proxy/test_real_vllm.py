"""Real vLLM (CPU build, tiny LLaVA, our EC connector): E + PD through the proxy process.

Outputs equal an aggregated baseline's, text and image, streamed and not, through the
official openai client; PD loaded E's encoding from the store instead of encoding itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdctl.proxy.request.media import content_key
from tests.baselines import Baselines
from tests.connector.epd import epd
from tests.harness import (
    chat,
    image_data_url,
    make_image,
    process_up,
    proxy_spec,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
PROXY_READY_S = 30


@pytest.fixture(scope="module")
def stack(
    tiny_llava: Path, baselines: Baselines, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, object, Path]]:
    """E, PD and a baseline (real vLLM) plus `python -m epdctl.proxy` in front of E and PD."""
    model = tiny_llava
    logs = tmp_path_factory.mktemp("proxy-real")
    with epd(model, logs, baseline=baselines.start(model)) as servers:
        spec = proxy_spec("proxy", logs / "proxy.log", ("--model", str(model), "--encode",
                          servers.encoder.url, "--prefill-decode", servers.pd.url))
        with process_up(spec, logs, PROXY_READY_S) as proxy:
            yield proxy.url, servers, proxy.log_path


@pytest.mark.parametrize("is_streamed", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", [None, 31], ids=["text", "image"])
def test_outputs_equal_the_baseline(stack, seed, is_streamed):
    url, servers, _ = stack
    urls = [image_data_url(make_image(seed))] if seed is not None else []
    mine = chat(url, str(servers.pd.model), image_urls=urls, stream=is_streamed)
    theirs = chat(servers.baseline.base_url, servers.baseline.model, image_urls=urls)
    assert mine and mine == theirs


def test_pd_loads_what_e_encoded_under_the_proxy_key(stack):
    url, servers, log = stack
    png = make_image(57)
    key = content_key("image", png)
    pd_start = len(servers.pd.log_text())
    out = chat(url, str(servers.pd.model), image_urls=[image_data_url(png)])
    assert out == chat(servers.baseline.base_url, servers.baseline.model,
                       image_urls=[image_data_url(png)])
    deadline = time.monotonic() + 10
    loaded = f"Success load encoder cache for hash {key}"
    while loaded not in servers.pd.log_text()[pd_start:]:
        assert time.monotonic() < deadline, servers.pd.log_tail(60)
        time.sleep(0.2)
    assert f"Finish execute for mm hash {key}" in servers.encoder.log_text()
    assert f"Finish execute for mm hash {key}" not in servers.pd.log_text()
    deadline = time.monotonic() + 10  # the proxy writes its request lines in 0.1 s batches
    while not (lines := [line for line in log.read_text().splitlines() if "status=200" in line
                         and "items=1" in line]):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    assert "encode_ms=" in lines[-1] and "fallbacks" not in lines[-1]
