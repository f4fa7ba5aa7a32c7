"""doctor's ec-store check fails on a store root `up` would refuse (shared machine)."""

from __future__ import annotations

import os
from pathlib import Path

from epdctl.doctor import Check
from epdctl.doctor._host import check_ec_store
from tests.doctor.fakes import disk, topology


def test_ec_store_that_others_can_write_to_fails(tmp_path: Path) -> None:
    root = tmp_path / "shm" / "epdctl"
    root.mkdir(parents=True)
    os.chmod(root, 0o777)
    topo = topology(cache={"dir": str(root), "capacity": "1GiB"})
    check = check_ec_store(topo, disk(free_gib=3), lambda p: "tmpfs", lambda p: True)
    assert check == Check(
        "ec-store", "fail", f"{root}: group or others can write to it (mode 0777)",
        f"remove it (epdctl creates it with mode 0700), or `chmod go= {root}` if you trust "
        "what is in it, or set cache.dir to a directory of your own")
    os.chmod(root, 0o700)
    ok = check_ec_store(topo, disk(free_gib=3), lambda p: "tmpfs", lambda p: True)
    assert ok.status == "ok"


def test_a_squatted_default_root_is_a_warning_as_up_uses_a_root_of_its_own(
    tmp_path: Path, monkeypatch
) -> None:
    from epdctl import cache

    monkeypatch.setattr(cache, "STORE_BASE", str(tmp_path))
    root = tmp_path / f"epdctl-{os.geteuid()}"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o755)
    topo = topology(cache={"capacity": "1GiB"})
    assert topo.cache.dir == root
    check = check_ec_store(topo, disk(free_gib=3), lambda p: "tmpfs", lambda p: True)
    assert check == Check(
        "ec-store", "warn", f"{root}: group or others can read it (mode 0755); `up` uses a "
        "fresh private root of its own instead",
        f"`chmod go= {root}`, or remove it (epdctl creates it with mode 0700)")
