"""topologies/cpu-demo-example-connector.yaml for real: the LLaVA demo on vLLM's own
ECExampleConnector answers as the aggregated baseline does, PD loads E's files, and `cache`,
`verify`, `logs` and `down` work with it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.topology_run import (
    TopologyRun,
    check_all_ready,
    check_down,
    check_logs,
    topology_with_baseline,
    wait_for,
    write_topology,
)
from tests.vllm_harness import Server, chat, image_data_url, make_image

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
INSTANCES = ("encode-0", "pd-0")


@pytest.fixture(scope="module")
def demo(
    tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """The example-connector demo with free ports, a private store root and DEBUG logs."""
    tmp = tmp_path_factory.mktemp("cpu-demo-example")
    path, cache_dir = write_topology("cpu-demo-example-connector", tmp, tiny_llava,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    with topology_with_baseline(path, cache_dir, tmp / "state", tiny_llava) as servers:
        yield servers


def test_status_all_ready_on_the_example_connector(demo: tuple[TopologyRun, Server]) -> None:
    run, _ = demo
    check_all_ready(run, INSTANCES)
    assert run.state().ec_connector == "ECExampleConnector"


@pytest.mark.parametrize("is_streamed", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", [None, 51], ids=["text", "image"])
def test_outputs_equal_the_baseline(
    demo: tuple[TopologyRun, Server], seed: int | None, is_streamed: bool
) -> None:
    run, baseline = demo
    urls = [image_data_url(make_image(seed))] if seed is not None else []
    mine = chat(run.proxy_url, MODEL, image_urls=urls, stream=is_streamed)
    assert mine and mine == chat(baseline.base_url, baseline.model, image_urls=urls)


def test_pd_loads_the_image_from_es_file(demo: tuple[TopologyRun, Server]) -> None:
    """E saves the embeddings as a safetensors file under the namespace dir; PD loads it and
    never runs the vision tower for it."""
    from epdctl.cache.example_files import item_file
    from epdctl.proxy.media import content_key

    run, baseline = demo
    png = make_image(61)
    key, url = content_key("image", png), image_data_url(png)
    pd_start = len(run.log("pd-0"))
    answer = chat(run.proxy_url, MODEL, image_urls=[url], extra_body={"cache_salt": "one"})
    assert answer and answer == chat(baseline.base_url, baseline.model, image_urls=[url])
    store = Path(run.state().store_dir)
    assert store.parent == run.cache_dir and store.name == run.state().namespace
    assert item_file(store, key).stat().st_size > 0
    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("pd-0")[pd_start:]), run.log("pd-0")[-3000:]
    assert f"Finish execute for mm hash {key}" not in run.log("pd-0")
    assert f"Finish execute for mm hash {key}" in run.log("encode-0")
    doc = run.cli_json("cache", "inspect", "--entries")
    assert doc["connector"] == "ECExampleConnector" and doc["store_dir"] == str(store)
    assert key in [i["key"] for i in doc["items"]]


def test_verify_checks_es_files(demo: tuple[TopologyRun, Server]) -> None:
    run, baseline = demo
    result = run.cli("verify", str(run.path), "--baseline-url", baseline.url, "--json",
                     timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert (doc["ok"], doc["cache_check"], doc["started_topology"]) == (True, "files", False)
    assert all(p["equal"] for p in doc["prompts"])
    with_images = [p for p in doc["prompts"] if p["images"]]
    assert with_images and all(p["cache"]["verdict"] == "saved" for p in with_images)
    assert "whether P/PD loaded them cannot be seen" in result.stderr


def test_logs_show_every_instance(demo: tuple[TopologyRun, Server]) -> None:
    check_logs(demo[0], INSTANCES)


def test_down_removes_the_connectors_files(demo: tuple[TopologyRun, Server]) -> None:
    """Last in the module: no process or group alive, the namespace dir and shm files gone."""
    check_down(demo[0])
