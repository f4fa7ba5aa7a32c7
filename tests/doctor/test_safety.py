"""doctor's `safety` line: the engines' key, the store, who may use the proxy; a warning for a
literal key in a file others can read, a failure for a key that cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdctl.doctor._safety import check_safety
from epdctl.topology.model import parse_topology

BASE = {"name": "demo", "model": "m/vl", "device": "cpu", "roles": {"prefill_decode": {}}}
STORE = "store private at /dev/shm/epdctl-0/demo-0123 (mode 0700, yours)"


def _topology(path: Path, mode: int, **proxy: str):
    path.write_text("name: demo\n")
    path.chmod(mode)
    return parse_topology({**BASE, "proxy": proxy})


def test_an_open_proxy_is_said_plainly(tmp_path: Path) -> None:
    check = check_safety(_topology(tmp_path / "t.yaml", 0o644), tmp_path / "t.yaml", STORE)
    assert (check.status, check.detail) == ("ok", f"engines keyed (a fresh key every run); "
                                            f"{STORE}; proxy open to local users "
                                            "(no proxy.api_key)")


def test_a_literal_key_in_a_file_others_can_read_is_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    check = check_safety(_topology(path, 0o644, api_key="k3y"), path, STORE)
    assert check.status == "warn"
    assert check.detail.endswith(f"proxy.api_key is written in {path}, which others can read")
    assert "proxy.api_key_file: PATH" in check.fix and "${VAR}" in check.fix
    assert "k3y" not in check.detail + check.fix
    assert check_safety(_topology(path, 0o600, api_key="k3y"), path, STORE).status == "ok"


def test_a_key_from_the_environment_is_ok_and_a_missing_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "t.yaml"
    topology = _topology(path, 0o644, api_key="${PROXY_KEY}", host="0.0.0.0")
    monkeypatch.setenv("PROXY_KEY", "k")
    check = check_safety(topology, path, STORE)
    assert check.status == "ok" and check.detail.endswith("proxy keyed ($PROXY_KEY)")
    monkeypatch.delenv("PROXY_KEY")
    check = check_safety(topology, path, STORE)
    assert check.status == "fail" and "${PROXY_KEY}, which is not set here" in check.detail
