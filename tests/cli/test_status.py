from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import is_running, run_pids

pytestmark = pytest.mark.timeout(60)


def test_status_json_then_table_then_exited(epdctl, fake_topology, state_root, tmp_path) -> None:
    topo = fake_topology()
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    pids = run_pids(state_root)
    result = epdctl("status", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert list(doc) == ["name", "phase", "mode", "model", "topology", "state_dir", "proxy_url",
                         "supervisor", "ready", "error", "instances", "cache", "safety"]
    # Every run keys its engines, and the store is epdctl's alone; this proxy has no key.
    assert doc["safety"] == {"engines_keyed": True, "store_dir": _store_dir(state_root),
                             "store_private": True, "store_problem": None,
                             "store_is_fresh_root": False, "proxy_keyed": False,
                             "proxy_host": "127.0.0.1"}
    assert (doc["name"], doc["phase"], doc["mode"], doc["ready"]) == ("fake", "running", "e-pd",
                                                                      True)
    assert doc["topology"] == str(topo) and doc["supervisor"] == {"pid": pids["supervisor"],
                                                                  "alive": True}
    first = doc["instances"][0]
    assert list(first) == ["name", "role", "gpus", "port", "url", "pid", "state", "uptime_s",
                           "rss_bytes", "restarts", "exit_code", "log", "error"]
    assert [(i["name"], i["role"], i["state"], i["pid"]) for i in doc["instances"]] == [
        ("encode-0", "encode", "ready", pids["encode-0"]),
        ("pd-0", "prefill_decode", "ready", pids["pd-0"]),
        ("proxy", "proxy", "ready", pids["proxy"]),
    ]
    assert all(i["rss_bytes"] > 1 << 20 for i in doc["instances"])
    assert first["url"] == f"http://127.0.0.1:{first['port']}"

    table = epdctl("status")
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["INSTANCE", "ROLE", "GPUS", "PORT", "PID", "STATE", "UPTIME",
                                "RSS"]
    assert lines[2].split()[:6] == ["pd-0", "prefill_decode", "-", str(doc["instances"][1]["port"]),
                                    str(pids["pd-0"]), "ready"]
    assert len(lines) == 5 and lines[-1].startswith("safety: engines keyed")  # no cache line yet

    # No restart policy: the supervisor stops everything when pd-0 dies.
    os.killpg(pids["pd-0"], signal.SIGKILL)
    end = time.monotonic() + 15
    while is_running(pids["supervisor"]) and time.monotonic() < end:
        time.sleep(0.1)
    after = epdctl("status", "--json")
    assert after.exit_code == 1
    doc = json.loads(after.stdout)
    assert doc["phase"] == "exited" and doc["supervisor"]["alive"] is False
    assert doc["error"].startswith("`pd-0` was killed by SIGKILL while serving;")
    assert [i["state"] for i in doc["instances"]] == ["exited"] * 3
    assert epdctl("down").stderr.startswith("Nothing of fake was running; removed its state.")


def test_status_shows_the_proxys_store_hit_ratio(epdctl, fake_topology, state_root) -> None:
    """The proxy's counters in the running topology's namespace, as `cache inspect` reads
    them (the fake topology's proxy is a fake: the counters are written here)."""
    from epdctl.cache.stats import StatsWriter
    from epdctl.proxy.stages.lookup import STATS_WRITER

    assert epdctl("up", str(fake_topology()), "-d", "--timeout", "20").exit_code == 0
    doc = json.loads(epdctl("status", "--json").stdout)
    assert doc["cache"]["lookups"] == 0 and doc["cache"]["hit_ratio"] is None
    (Path(_store_dir(state_root)) / "stats").mkdir(mode=0o700)  # up made the namespace
    stats = StatsWriter(_store_dir(state_root), STATS_WRITER)
    stats.add(lookups=4, skipped=3, sent=1)
    stats.close()
    doc = json.loads(epdctl("status", "--json").stdout)
    assert doc["cache"] == {"namespace": doc["cache"]["namespace"], "lookups": 4,
                            "skipped": 3, "sent": 1, "waits": 0, "expired": 0, "wait_s": 0.0,
                            "hit_ratio": 0.75}
    assert doc["cache"]["namespace"].startswith("fake-")
    lines = epdctl("status").stdout.splitlines()
    assert lines[-1] == (f"safety: engines keyed; store private at {_store_dir(state_root)}; "
                         "proxy open to local users (no proxy.api_key)")
    assert lines[-2] == ("encoder cache: 75% hit (3 of 4 media items were in the store and "
                         "skipped the encoder)")
    pd = StatsWriter(_store_dir(state_root), "pd-0-scheduler")  # PD's waits (overlap)
    pd.add(waits=2, wait_s=0.05, expired=1)
    pd.close()
    assert json.loads(epdctl("status", "--json").stdout)["cache"]["waits"] == 2
    lines = epdctl("status").stdout.splitlines()
    assert lines[-2] == ("overlap: PD waited for 2 items E was still encoding (mean 25 ms; 1 "
                         "encoded by PD itself after E failed or ran late)")
    assert epdctl("down").exit_code == 0


def _store_dir(state_root) -> str:
    (run,) = [p for p in state_root.iterdir() if (p / "state.json").exists()]
    return json.loads((run / "state.json").read_text())["store_dir"]


def test_status_when_nothing_runs(epdctl, state_root) -> None:
    result = epdctl("status")
    assert result.exit_code == 1
    assert result.stderr == f"Error: nothing is running (no topology under {state_root})\n"
