"""topologies/cpu-demo-example-connector.yaml for real: the LLaVA demo on vLLM's own
ECExampleConnector answers as the aggregated baseline does, PD loads E's files, and `cache`,
`verify`, `logs`, a supervisor's restart and `down` work with it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.baselines import Baselines
from tests.harness import (
    Server,
    TopologyRun,
    chat,
    check_all_ready,
    check_down,
    check_logs,
    image_data_url,
    make_image,
    topology_with_baseline,
    wait_for,
    write_topology,
)
from tests.reliability.helpers import kill_group

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
INSTANCES = ("encode-0", "pd-0")


@pytest.fixture(scope="module")
def demo(
    tiny_llava: Path, baselines: Baselines, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """The example-connector demo with free ports, a private store root and DEBUG logs."""
    tmp = tmp_path_factory.mktemp("cpu-demo-example")
    path, cache_dir = write_topology("cpu-demo-example-connector", tmp, tiny_llava,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    data = yaml.safe_load(path.read_text())
    data["restart"] = {"policy": "on-failure", "max_restarts": 1, "backoff": "1s"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with topology_with_baseline(path, cache_dir, tmp / "state", baselines,
                                tiny_llava) as servers:
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
    from epdctl.proxy.request.media import content_key

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


def test_a_restarted_pd_loads_es_file_and_answers_as_before(
        demo: tuple[TopologyRun, Server]) -> None:
    """SIGKILL PD's process group: the supervisor starts it again (restart: on-failure), the
    proxy takes it back, and the same image request gets the same answer, PD loading the
    image from E's file."""
    from epdctl.proxy.request.media import content_key

    run, _ = demo
    png = make_image(71)
    key, url = content_key("image", png), image_data_url(png)
    before = chat(run.proxy_url, MODEL, image_urls=[url], extra_body={"cache_salt": "restart"})
    assert before
    old = run.state().records["pd-0"].pid
    restarts = _pd(run)["restarts"]
    kill_group(old)
    back = wait_for(lambda: (row := _pd(run))["state"] == "ready" and (
        row["restarts"] == restarts + 1) and row, timeout_s=300, interval_s=1.0)
    assert back and back["pid"] != old, _pd(run)
    assert wait_for(lambda: _proxy_health(run) == "ok", timeout_s=60), _proxy_health(run)
    pd_start = len(run.log("pd-0"))
    after = chat(run.proxy_url, MODEL, image_urls=[url], extra_body={"cache_salt": "restart"})
    assert after == before
    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("pd-0")[pd_start:]), run.log("pd-0")[-3000:]
    assert {r["name"]: r["restarts"] for r in run.cli_json("status")["instances"]
            if r["name"] != "pd-0"} == {"encode-0": 0, "proxy": 0}  # only what was killed


def _pd(run: TopologyRun) -> dict:
    """pd-0's row of `status --json` (which exits 1 while an instance is not ready)."""
    doc = json.loads(run.cli("status", "--json").stdout)
    return next(r for r in doc["instances"] if r["name"] == "pd-0")


def _proxy_health(run: TopologyRun) -> str | None:
    try:
        return httpx.get(f"{run.proxy_url}/health", timeout=5).json().get("status")
    except (httpx.HTTPError, ValueError):
        return None


def test_down_removes_the_connectors_files(demo: tuple[TopologyRun, Server]) -> None:
    """Last in the module: no process or group alive, the namespace dir and shm files gone."""
    check_down(demo[0])
