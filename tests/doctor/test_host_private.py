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
