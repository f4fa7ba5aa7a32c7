"""An out-of-tree EC connector given as `module.path:ClassName` (tests/ec_recording.py) in
the CPU demo: vLLM loads it in E and PD, E saves through it and PD loads through it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import (
    REPO,
    TopologyRun,
    chat,
    image_data_url,
    leftovers,
    make_image,
    topology_up,
    wait_for,
    write_topology,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny-llava"
CONNECTOR = "tests.ec_recording:RecordingECConnector"


@pytest.fixture(scope="module")
def oot(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TopologyRun]:
    """cpu-demo.yaml on the recording connector (its files and record under a temp dir)."""
    tmp = tmp_path_factory.mktemp("cpu-demo-oot")
    # The engines import `tests.ec_recording` from this checkout.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    path, cache_dir = write_topology("cpu-demo", tmp, tiny_llava, env={
        "VLLM_LOGGING_LEVEL": "DEBUG", "PYTHONPATH": pythonpath})
    data = yaml.safe_load(path.read_text())
    data["cache"].update(connector=CONNECTOR, extra_config={
        "shared_storage_path": str(tmp / "files"), "record_path": str(tmp / "record.txt")})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with topology_up(path, cache_dir, tmp / "state") as run:
        yield run


def _record(run: TopologyRun) -> list[str]:
    path = run.path.parent / "record.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_vllm_loads_the_module_in_every_instance(oot: TopologyRun) -> None:
    assert oot.cli("status").returncode == 0
    for instance in ("encode-0", "pd-0"):
        for side in ("scheduler", "worker"):
            assert f"cpu-demo-{instance} {side} init" in _record(oot), _record(oot)


def test_e_saves_and_pd_loads_through_it(oot: TopologyRun) -> None:
    from epdctl.proxy.request.media import content_key

    png = make_image(71)
    key = content_key("image", png)
    assert chat(oot.proxy_url, MODEL, image_urls=[image_data_url(png)])
    assert wait_for(lambda: f"cpu-demo-pd-0 load {key}" in _record(oot)), _record(oot)
    assert f"cpu-demo-encode-0 save {key}" in _record(oot)
    assert f"Finish execute for mm hash {key}" not in oot.log("pd-0")
    assert (oot.path.parent / "files" / key / "encoder_cache.safetensors").is_file()


def test_down_stops_everything(oot: TopologyRun) -> None:
    result = oot.cli("down", timeout_s=90)
    assert result.returncode == 0, result.stderr
    assert leftovers(oot) == []
