"""`up`, `status`, `cache`, `verify` and `down` with another EC connector (fake engines):
ECExampleConnector's files are shown, cleaned and checked; any other connector is named."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from epdctl.verifier import probes as core
from epdctl.verifier import prompts

pytestmark = pytest.mark.timeout(120)
OOT = "tests.ec_recording:RecordingECConnector"


def _state(state_root: Path) -> dict:
    return json.loads((state_root / "fake" / "state.json").read_text())


def _item(store: Path, key: str, size: int = 100, age_s: float = 0.0) -> Path:
    """A file where ECExampleConnector's E would have saved item `key`."""
    path = store / key / "encoder_cache.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(size))
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


def _verify_keys() -> list[str]:
    # The fake topology takes images only: verify sends it those prompts.
    return sorted({k for p in prompts.prompts_for({"image"}) for k in core.media_keys(p)})


def test_dry_run_notes_what_the_connector_changes(epdctl, fake_topology) -> None:
    result = epdctl("up", str(fake_topology(cache="connector: ECExampleConnector")),
                    "--dry-run")
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("# note: ")]
    assert len(notes) == 1 and notes[0].startswith(
        "# note: EC transfer: ECExampleConnector, one safetensors file per item under ")
    assert '"ec_connector":"ECExampleConnector"' in result.stdout


def test_example_connector_files_are_shown_cleaned_verified_and_removed_by_down(
        epdctl, fake_topology, state_root) -> None:
    topo = fake_topology(cache="connector: ECExampleConnector")
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    state = _state(state_root)
    store = Path(state["store_dir"])
    assert state["ec_connector"] == "ECExampleConnector"
    assert epdctl("status").exit_code == 0

    empty = epdctl("cache", "inspect")
    assert (empty.exit_code, empty.stdout) == (0, "")
    assert empty.stderr == (f"`fake` runs ECExampleConnector, not epdctl's store: its files "
                            f"are in {store}\nIt holds no item yet.\n")

    for key in _verify_keys():
        _item(store, key, age_s=60)
    old = _item(store, "old", size=3000, age_s=2 * 3600)
    listed = epdctl("cache", "inspect", "--entries")
    assert listed.exit_code == 0
    lines = listed.stdout.splitlines()
    assert re.fullmatch(r"5 items, 3\.3 KiB, saved 1m0\ds to 2h00m ago \(no hit counts: the "
                        r"connector keeps none\)", lines[0]), lines[0]
    assert lines[1].split() == ["KEY", "SIZE", "AGE"] and lines[-1].split()[0] == "old"
    doc = json.loads(epdctl("cache", "inspect", "--json").stdout)
    assert {k: doc[k] for k in ("connector", "store_dir", "entries", "size_bytes")} == {
        "connector": "ECExampleConnector", "store_dir": str(store), "entries": 5,
        "size_bytes": 3400}

    result = epdctl("verify", str(topo), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["ok"], doc["ec_connector"], doc["cache_check"]) == (
        True, "ECExampleConnector", "files")
    assert [p["cache"] for p in doc["prompts"]][:3] == [
        None, {"verdict": "saved", "keys": 1, "saved": 1},
        {"verdict": "saved", "keys": 2, "saved": 2}]
    assert result.stderr.rstrip().endswith(
        "6 prompts equal to the baseline; 5 of 5 with images found in ECExampleConnector's "
        "files (whether P/PD loaded them cannot be seen: the connector records no loads)")

    dry = epdctl("cache", "clean", "--older-than", "1h", "--dry-run")
    assert dry.stdout == f"Would remove 1 item (2.9 KiB) from {store}\n" and old.exists()
    cleaned = epdctl("cache", "clean", "--older-than", "1h")
    assert cleaned.stdout == f"Removed 1 item (2.9 KiB) from {store}\n"
    assert "warning: ECExampleConnector pins nothing" in cleaned.stderr
    assert not old.parent.exists() and len(os.listdir(store)) == 4
    wrong = epdctl("cache", "clean", "--all", "--namespace", "other")
    assert wrong.exit_code == 1 and wrong.stderr == (
        f"Error: `fake` runs ECExampleConnector in namespace `{state['namespace']}`, not "
        "`other`\n")

    # E's file of the first image is gone: the prompts that send it count as encoded twice.
    (store / sorted(core.media_keys(core.PROMPTS[1]))[0]).rename(store / "elsewhere")
    failed = epdctl("verify", str(topo))
    assert failed.exit_code == 1
    assert failed.stderr.endswith("Error: 3 of 6 prompts failed: one image, repeated image, "
                                  "repeated image, streamed\n")
    assert failed.stdout.splitlines()[2].split()[2:5] == ["equal", "missing", "0/1"]

    assert epdctl("down").exit_code == 0
    assert not store.exists(), "down removes ECExampleConnector's files"


def test_a_connector_epdctl_cannot_read_is_named_plainly(epdctl, fake_topology,
                                                          state_root) -> None:
    topo = fake_topology(cache=f"connector: '{OOT}'")
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    line = (f"`fake` runs {OOT}, not epdctl's store: epdctl cannot see what it holds "
            "(--store-dir DIR looks at an epdctl store)")
    inspect = epdctl("cache", "inspect")
    assert (inspect.exit_code, inspect.stdout, inspect.stderr) == (0, "", line + "\n")
    clean = epdctl("cache", "clean", "--all")
    assert (clean.exit_code, clean.stderr) == (0, f"{line}; nothing for `cache clean` to "
                                                  "remove\n")
    assert json.loads(epdctl("cache", "inspect", "--json").stdout)["store_dir"] is None

    result = epdctl("verify", str(topo), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["ok"], doc["cache_check"]) == (True, "none")
    assert all(p["cache"] is None and p["equal"] for p in doc["prompts"])
    assert f"EC cache use not verified: {OOT} keeps nothing epdctl can read" in result.stderr
    assert epdctl("status").exit_code == 0
    assert epdctl("down").exit_code == 0


def test_file_use_verdicts_and_what_verify_can_read(tmp_path: Path) -> None:
    assert (core.FileUse(2, 2).verdict, core.FileUse(2, 2).is_ok) == ("saved", True)
    assert (core.FileUse(2, 1).verdict, core.FileUse(2, 1).is_ok) == ("missing", False)
    saved = core.Result(core.PROMPTS[1], core.ChatAnswer("a", 0.1), core.ChatAnswer("a", 0.1),
                        core.FileUse(1, 1))
    assert core.is_passed([saved]) and saved.cache is not None and saved.cache.shown == \
        "saved 1/1"
    assert isinstance(core.probe_for("EpdctlShmECConnector", tmp_path), core.StoreProbe)
    probe = core.probe_for("ECExampleConnector", tmp_path)
    assert isinstance(probe, core.FileProbe)
    _item(tmp_path, "k1")
    assert probe.use(probe.snapshot(), {"k1", "k2"}) == core.FileUse(2, 1)
    assert core.probe_for("ECMooncakeConnector", tmp_path) is None
    assert core.probe_for(OOT, tmp_path) is None
