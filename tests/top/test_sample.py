"""`sample.take` with a fake fetch, a real EC store and fake NVML figures; `top` via the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import Store
from epdctl.host.gpus import GpuInfo
from epdctl.launch.plan import plan
from epdctl.launch.state import Record, RunState, Settings
from epdctl.top import sample as sample_module
from epdctl.top.sample import take
from epdctl.topology.model import parse_topology
from tests.top.test_summary import TEXTS, demo_state

TWO_GIB = 2 << 30


def _store(state: RunState) -> None:
    """The namespace with one entry, and the counters E and PD write (connector/ec.py)."""
    ns_dir = Path(state.store_dir)
    store = Store(ns_dir.parent, state.namespace).create()
    store.publish("k1", bytes(64), dtype="float32", shape=(2, 8))
    for name, side, counts in (("encode-0", "worker0", {"saves": 1, "save_bytes": 64}),
                               ("pd-0", "scheduler", {"hits": 3, "misses": 1}),
                               ("pd-0", "worker0", {"loads": 3, "load_bytes": 192})):
        spec = next(s for s in state.specs if s.name == name)
        engine_id = spec.ec_config["engine_id"]  # type: ignore[index]
        writer = StatsWriter(ns_dir, f"{engine_id}-{side}")
        writer.add(**counts)
        writer.close()


def test_take_reads_every_source(tmp_path: Path) -> None:
    state = demo_state(tmp_path)
    _store(state)
    asked: list[tuple[str, dict]] = []
    urls = {f"{s.url}/metrics": TEXTS[s.name] for s in state.specs if s.name != "encode-0"}

    def fetch(url: str, headers):  # type: ignore[no-untyped-def]
        asked.append((url, dict(headers)))
        return urls.get(url)

    got = take(state, fetch, clock=lambda: 5.0)
    assert got.at == 5.0
    assert got.scrapes["encode-0"] is None and got.scrapes["pd-0"] is not None
    assert sorted(url for url, _ in asked) == sorted(f"{s.url}/metrics" for s in state.specs)
    assert all(headers == {} for _, headers in asked)
    assert got.cache["encode-0"] == {"saves": 1, "save_bytes": 64}
    assert got.cache["pd-0"] == {"hits": 3, "misses": 1, "loads": 3, "load_bytes": 192}
    assert got.store is not None and (got.store.entries, got.store.hits) == (1, 3)
    assert got.gpu_bytes == {} and got.gpus == ()  # a CPU topology asks NVML nothing


def test_take_sends_the_api_key_to_the_proxy_only_and_skips_what_is_not_metrics(
        tmp_path: Path) -> None:
    topology = parse_topology({"name": "k", "model": "m", "device": "cpu",
                               "cache": {"dir": str(tmp_path / "shm")},
                               "proxy": {"api_key": "sekrit"}, "roles": {"prefill_decode": {}}})
    state = RunState.of(plan(topology, tmp_path / "state"), "t.yaml", Settings())
    asked: dict[str, dict] = {}

    def fetch(url: str, headers):  # type: ignore[no-untyped-def]
        asked[url] = dict(headers)
        return "<html>a login page</html>"

    got = take(state, fetch)
    assert asked == {f"{state.proxy.url}/metrics": {"authorization": "Bearer sekrit"},
                     f"{state.engines[0].url}/metrics": {}}
    assert got.scrapes == {"pd-0": None, "proxy": None}


def test_gpu_memory_per_instance_from_its_process_tree(tmp_path: Path) -> None:
    topology = parse_topology({"name": "g", "model": "m", "cache": {"dir": str(tmp_path / "s")},
                               "roles": {"encode": {"gpus": [0]},
                                         "prefill_decode": {"gpus": [1]}}})
    state = RunState.of(plan(topology, tmp_path / "state", visible_gpus=["0", "1", "2"]),
                        "t.yaml", Settings())
    state.records["pd-0"] = Record(name="pd-0", pid=os.getpid(), pgid=os.getpgid(0),
                                   create_time=0.0, started_at=0.0)
    devices = [GpuInfo("0", "H200", 8 * TWO_GIB, 7 * TWO_GIB),
               GpuInfo("1", "H200", 8 * TWO_GIB, TWO_GIB), GpuInfo("2", "H200", 1, 1)]
    got = take(state, lambda url, headers: None, gpu_memory=lambda: {os.getpid(): TWO_GIB, 1: 5},
               gpu_devices=lambda: devices)
    assert got.gpu_bytes == {"pd-0": TWO_GIB}
    from epdctl.top.summary import summarize

    doc = summarize(state, [got])
    assert [(g["id"], g["used_bytes"]) for g in doc["gpus"]] == [("0", TWO_GIB),
                                                                ("1", 7 * TWO_GIB)]
    assert [i["gpu_memory_bytes"] for i in doc["instances"]] == [None, TWO_GIB]


def test_top_once_json(epdctl, state_root: Path, tmp_path: Path, monkeypatch) -> None:
    state = demo_state(tmp_path)
    run_dir = state_root / state.name
    run_dir.mkdir()
    (run_dir / "state.json").write_text(state.model_dump_json())
    texts = {f"{s.url}/metrics": TEXTS[s.name] for s in state.specs}
    monkeypatch.setattr(sample_module, "http_fetch", lambda url, headers: texts.get(url))
    result = epdctl("top", "--once", "--json", "--interval", "0.1")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["proxy"]["requests"] == 13 and doc["proxy"]["encoder_fanout"]["items"] == 9
    assert [i["requests"] for i in doc["instances"]] == [9, 13]
    assert 0.1 <= doc["rate_window_s"] < 5
    screen = epdctl("top", "--once", "--interval", "0.1")
    assert screen.exit_code == 0 and "requests 13 (ok 13, errors 0)" in screen.stdout


def test_another_ec_connector_s_files_are_not_read_as_epdctl_s_store(tmp_path: Path) -> None:
    from rich.console import Console

    from epdctl.top.summary import summarize
    from epdctl.top.view import render

    topology = parse_topology({"name": "x", "model": "m", "device": "cpu",
                               "cache": {"dir": str(tmp_path / "files"),
                                         "connector": "ECExampleConnector"},
                               "roles": {"encode": {}, "prefill_decode": {}}})
    state = RunState.of(plan(topology, tmp_path / "state"), "t.yaml", Settings())
    assert not state.is_our_store
    (Path(state.store_dir) / "stats").mkdir(parents=True)
    (Path(state.store_dir) / "stats" / "x-pd-0-scheduler.json").write_text(
        '{"counts": {"hits": 5}}')
    got = take(state, lambda url, headers: None)
    assert got.store is None and got.cache == {}
    doc = summarize(state, [got])
    assert doc["cache"]["connector"] == "ECExampleConnector" and doc["cache"]["hits"] == 0
    console = Console(width=140, record=True, no_color=True)
    console.print(render(doc))
    assert "EC connector ECExampleConnector: it keeps no counters" in console.export_text()
