"""topologies/cpu-qwen2vl.yaml (E|PD, tiny Qwen2-VL, metadata rewrite) for real.

With the rewrite, the proxy sends PD E's `image_grid_thw` instead of the image, so PD
neither fetches nor preprocesses it. vLLM's logs cannot show that, so a test-only probe
(tests/e2e/probe/sitecustomize.py, put on PD's and E's PYTHONPATH) records every media
load and HF-processor call of each instance in a file of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdctl.proxy.config import UPSTREAM_KEY_ENV
from tests.baselines import QWEN2VL_ARGS, Baselines
from tests.harness import (
    Server,
    TopologyRun,
    chat,
    check_all_ready,
    check_down,
    check_logs,
    check_verify,
    encoder_posts,
    image_data_url,
    make_image,
    process_up,
    proxy_counters,
    proxy_spec,
    store_counters,
    topology_with_baseline,
    wait_for,
    write_topology,
)

MEDIA_PROBE = Path(__file__).parent / "probe"
"""A sitecustomize that logs the media loads and HF processor calls of PD's processes."""

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-qwen2vl"
INSTANCES = ("encode-0", "pd-0")


def probe_env(path: Path) -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(MEDIA_PROBE), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath, "EPDCTL_PROBE_FILE": str(path)}


@pytest.fixture(scope="module")
def qwen(
    tiny_qwen2vl: Path, baselines: Baselines, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """cpu-qwen2vl.yaml with free ports, a private store, DEBUG logs and the probe."""
    tmp = tmp_path_factory.mktemp("cpu-qwen2vl")
    path, cache_dir = write_topology(
        "cpu-qwen2vl", tmp, tiny_qwen2vl, env={"VLLM_LOGGING_LEVEL": "DEBUG"},
        role_env={"encode": probe_env(tmp / "probe-encode.txt"),
                  "prefill_decode": probe_env(tmp / "probe-pd.txt")},
    )
    with topology_with_baseline(path, cache_dir, tmp / "state", baselines, tiny_qwen2vl,
                                QWEN2VL_ARGS) as servers:
        yield servers


@pytest.fixture(scope="module")
def plain_proxy(qwen: tuple[TopologyRun, Server]) -> Iterator[str]:
    """A second proxy before the same E and PD, with the metadata rewrite off."""
    run, _ = qwen
    specs = {s.name: s.spec() for s in run.state().specs}
    spec = proxy_spec("plain-proxy", run.run_dir / "logs" / "plain-proxy.log",
                      ("--model", MODEL, "--encode", specs["encode-0"].url,
                       "--prefill-decode", specs["pd-0"].url, "--no-metadata-rewrite"),
                      env={UPSTREAM_KEY_ENV: run.state().internal_key})
    with process_up(spec, run.run_dir) as proxy:
        yield proxy.url


class Probe:
    """Lines one instance's probe appended since this object was made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = path.stat().st_size if path.exists() else 0

    def calls(self, kind: str) -> list[str]:
        data = self.path.read_text() if self.path.exists() else ""
        lines = data[self.start:].splitlines()
        return [line for line in lines if line.split(" ")[2:3] == [kind]]

    def image_calls(self) -> list[str]:
        """Media loads, and HF-processor calls that were handed images."""
        return self.calls("media") + [
            line for line in self.calls("hf_processor") if "images=0 " not in line]


def probes(run: TopologyRun) -> tuple[Probe, Probe]:
    tmp = run.path.parent
    return Probe(tmp / "probe-encode.txt"), Probe(tmp / "probe-pd.txt")


def test_status_all_ready(qwen: tuple[TopologyRun, Server]) -> None:
    check_all_ready(qwen[0], INSTANCES)


def test_probe_is_loaded_in_both_instances(qwen: tuple[TopologyRun, Server]) -> None:
    """Guards the probe tests: both instances patched the media and processor modules."""
    for name in ("encode", "pd"):
        text = (qwen[0].path.parent / f"probe-{name}.txt").read_text()
        assert " patched vllm.multimodal.media.connector" in text, name
        assert " patched vllm.multimodal.processing.context" in text, name


@pytest.mark.parametrize("is_streamed", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seeds", [(), (24,), (25, 26)], ids=["text", "image", "two-images"])
def test_outputs_equal_the_baseline(
    qwen: tuple[TopologyRun, Server], seeds: tuple[int, ...], is_streamed: bool
) -> None:
    run, baseline = qwen
    urls = [image_data_url(make_image(seed)) for seed in seeds]
    mine = chat(run.proxy_url, MODEL, image_urls=urls, stream=is_streamed)
    theirs = chat(baseline.base_url, baseline.model, image_urls=urls)
    assert mine and mine == theirs


def test_rewritten_request_never_touches_the_image_on_pd(
    qwen: tuple[TopologyRun, Server],
) -> None:
    from epdctl.proxy.request.media import content_key

    run, baseline = qwen
    png = make_image(43)
    url = image_data_url(png)
    encode, pd = probes(run)
    answer = chat(run.proxy_url, MODEL, image_urls=[url])
    assert answer == chat(baseline.base_url, baseline.model, image_urls=[url])
    assert encode.calls("media") and [c for c in encode.calls("hf_processor") if "images=1" in c]
    assert pd.image_calls() == []
    key = content_key("image", png)
    assert wait_for(lambda: f"Success load encoder cache for hash {key}" in run.log("pd-0"))
    assert f"Finish execute for mm hash {key}" not in run.log("pd-0")


def test_a_repeated_image_is_rewritten_from_the_store_without_e(
    qwen: tuple[TopologyRun, Server],
) -> None:
    """The repeat makes no E request: the proxy finds the entry, and E's `image_grid_thw`
    kept beside it, so PD still gets metadata only; answers equal the baseline."""
    from epdctl.cache.sidecar import read_meta
    from epdctl.cache.store import Store
    from epdctl.proxy.request.media import content_key

    run, baseline = qwen
    png = make_image(45)
    key, url = content_key("image", png), image_data_url(png)
    expected = chat(baseline.base_url, baseline.model, image_urls=[url])
    pd_start = len(run.log("pd-0"))
    assert chat(run.proxy_url, MODEL, image_urls=[url]) == expected
    # The proxy writes it beside the entry at its next scan of the store (every second).
    kept = wait_for(lambda: read_meta(Store(run.cache_dir, run.state().namespace), key))
    assert kept and kept["metadata"]["image_grid_thw"], kept
    encode, pd = probes(run)
    e_mark, counted, looked = len(run.log("encode-0")), proxy_counters(run), store_counters(run)
    assert chat(run.proxy_url, MODEL, image_urls=[url], stream=True) == expected
    assert encoder_posts(run.log("encode-0")[e_mark:]) == 0 and encode.image_calls() == []
    assert pd.image_calls() == []  # rewritten: PD neither fetched nor preprocessed it
    # PD loaded it from the store (for the repeat its worker may still hold the tensor).
    assert wait_for(lambda: f"Success load encoder cache for hash {key}"
                    in run.log("pd-0")[pd_start:])
    assert f"Finish execute for mm hash {key}" not in run.log("pd-0")
    now = proxy_counters(run)
    assert {k: now[k] - counted[k] for k in now} == {"lookups": 1, "skipped": 1, "sent": 0,
                                                     "overlapped": 0}
    row = wait_for(lambda: (r := store_counters(run))["lookups"] > looked["lookups"] and r)
    assert row, store_counters(run)
    assert (row["lookups"] - looked["lookups"], row["skipped"] - looked["skipped"]) == (1, 1)


def test_without_the_rewrite_pd_preprocesses_the_image(
    qwen: tuple[TopologyRun, Server], plain_proxy: str
) -> None:
    """The probe does see PD's work when the proxy passes the image through."""
    run, baseline = qwen
    url = image_data_url(make_image(44))
    _, pd = probes(run)
    answer = chat(plain_proxy, MODEL, image_urls=[url])
    assert answer == chat(baseline.base_url, baseline.model, image_urls=[url])
    assert pd.calls("media")
    assert [c for c in pd.calls("hf_processor") if "images=1" in c]


def test_logs_show_every_instance(qwen: tuple[TopologyRun, Server]) -> None:
    check_logs(qwen[0], INSTANCES)


def test_verify_passes(qwen: tuple[TopologyRun, Server]) -> None:
    run, baseline = qwen
    _, pd = probes(run)
    check_verify(run, baseline)
    assert pd.image_calls() == [], "verify's image requests reached PD's preprocessing"


def test_down_leaves_nothing(qwen: tuple[TopologyRun, Server]) -> None:
    """Last in the module: no recorded process or group alive, no store or shm files."""
    check_down(qwen[0])
