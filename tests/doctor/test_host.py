"""The machine checks (GPUs, memory, placement, EC store, ports) against fakes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from epdctl.doctor import Check
from epdctl.doctor import _host as host
from epdctl.doctor._host import (
    check_ec_store,
    check_gpu_memory,
    check_gpus,
    check_placement,
    check_ports,
    filesystem_type,
)
from epdctl.errors import PlanError
from epdctl.host.gpus import GpuInfo
from epdctl.launch.plan import Plan, plan
from epdctl.launch.ports import check_plan_ports
from tests.doctor.fakes import disk, gpu, topology

NO_GPU = PlanError("no NVIDIA GPU found (NVML: Driver Not Loaded); for a CPU-only machine ...")
CPU = {"device": "cpu", "roles": {"encode": {}, "prefill_decode": {}}}


def _plan(topo, tmp_path: Path, gpus: tuple[str, ...] = ("0", "1"), cpus: int = 2) -> Plan:
    return plan(topo, tmp_path / "state", visible_gpus=list(gpus), cpu_count=cpus)


def test_gpus() -> None:
    gpus = [gpu("0", 70.5), GpuInfo("MIG-abc", "MIG device")]
    assert check_gpus("cuda", gpus) == Check(
        "gpus", "ok", "2 visible: 0 NVIDIA H100 (70.5 GiB free of 80.0 GiB), MIG-abc MIG device")
    assert check_gpus("cuda", NO_GPU) == Check("gpus", "fail", str(NO_GPU))
    assert check_gpus(None, NO_GPU).status == "warn"  # no topology: a CPU machine is fine
    assert check_gpus("cpu", NO_GPU) == Check("gpus", "skip", "`device: cpu`: no GPU needed")


def test_gpu_memory_fits(tmp_path: Path) -> None:
    topo = topology()
    check = check_gpu_memory(topo, _plan(topo, tmp_path), [gpu("0", 75), gpu("1", 74)])
    assert check == Check("gpu-memory", "ok",
                          "GPU 0: 73.6 GiB of 75.0 GiB free; GPU 1: 73.6 GiB of 74.0 GiB free")


def test_gpu_memory_short_names_who_needs_it(tmp_path: Path) -> None:
    topo = topology(roles={"encode": {"gpus": [0], "gpu_memory_utilization": 0.3},
                           "prefill_decode": {"gpus": [0], "gpu_memory_utilization": 0.6}})
    check = check_gpu_memory(topo, _plan(topo, tmp_path, ["0"]), [gpu("0", free_gib=40)])
    assert check.status == "fail"
    assert check.detail == ("GPU 0 (NVIDIA H100): `encode-0`, `pd-0` need 0.90 x 80.0 GiB = "
                            "72.0 GiB, 40.0 GiB free")
    assert "nvidia-smi" in check.fix


def test_gpu_memory_skips(tmp_path: Path) -> None:
    assert check_gpu_memory(topology(**CPU), None, NO_GPU).status == "skip"
    assert check_gpu_memory(topology(), None, NO_GPU).status == "skip"


def test_placement(tmp_path: Path) -> None:
    topo = topology()
    assert check_placement(topo, _plan(topo, tmp_path), [gpu("0"), gpu("1")], 2) == Check(
        "placement", "ok", "encode-0 on GPU 0, pd-0 on GPU 1")
    error = PlanError("roles -> prefill_decode -> gpus: GPU 1 does not exist; 1 GPU is "
                      "visible (index 0)\nsecond problem")
    check = check_placement(topo, error, [gpu("0")], 2)
    assert check.status == "fail"
    assert check.detail == ("roles -> prefill_decode -> gpus: GPU 1 does not exist; 1 GPU is "
                            "visible (index 0); second problem")
    assert check_placement(topo, error, NO_GPU, 2).status == "skip"


def test_placement_on_cpu_shows_the_cores(tmp_path: Path) -> None:
    topo = topology(**CPU)
    assert check_placement(topo, _plan(topo, tmp_path), NO_GPU, 2) == Check(
        "placement", "ok", "encode-0 on CPU 0, pd-0 on CPU 1")
    crowded = topology(device="cpu", roles={"encode": {"replicas": 2}, "prefill_decode": {}})
    check = check_placement(crowded, _plan(crowded, tmp_path, cpus=2), NO_GPU, 2)
    assert check.status == "warn"
    assert check.detail == ("3 instances on 2 CPU(s) share cores: encode-0 on CPU 0, "
                            "encode-1 on CPU 1, pd-0 on CPU 0")


def _store(tmp_path: Path, capacity: str = "1GiB") -> dict:
    return {"cache": {"dir": str(tmp_path / "shm" / "epdctl"), "capacity": capacity}}


def test_ec_store_fits(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    usage = disk(free_gib=3)
    check = check_ec_store(topology(**_store(tmp_path)), usage, lambda p: "tmpfs",
                           lambda p: True)
    assert check == Check("ec-store", "ok", f"{tmp_path}/shm/epdctl: tmpfs, 3.0 GiB free for "
                          "a 1.0 GiB budget")
    assert set(usage.seen) == {tmp_path / "shm"}  # the store does not exist yet: its parent


def test_ec_store_too_small(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    check = check_ec_store(topology(**_store(tmp_path, "8GiB")), disk(free_gib=2, total_gib=4),
                           lambda p: "tmpfs", lambda p: True)
    assert check == Check(
        "ec-store", "fail", f"the EC store `{tmp_path}/shm/epdctl` has 2.0 GiB available "
        "(filesystem size 4.0 GiB) but the cache capacity is 8.0 GiB; lower cache.capacity "
        "or enlarge the filesystem (Docker: --shm-size)")
    assert not (tmp_path / "shm" / "epdctl").exists()  # doctor creates nothing


def test_ec_store_not_tmpfs_or_not_writable(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    topo = topology(**_store(tmp_path))
    slow = check_ec_store(topo, disk(free_gib=9), lambda p: "ext4", lambda p: True)
    assert slow.status == "warn" and "not tmpfs" in slow.detail
    locked = check_ec_store(topo, disk(free_gib=9), lambda p: "tmpfs", lambda p: False)
    assert locked.status == "fail"
    assert locked.detail == (f"{tmp_path}/shm is not a directory this user can write to "
                             f"(the store goes to {tmp_path}/shm/epdctl)")


def test_ec_store_without_an_encoder_or_topology(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pd_only = topology(roles={"prefill_decode": {"gpus": [0]}})
    assert check_ec_store(pd_only, disk(1), lambda p: "tmpfs", lambda p: True).status == "skip"
    monkeypatch.setattr(host, "SHM", tmp_path)
    assert check_ec_store(None, disk(free_gib=1.5, total_gib=2), lambda p: "tmpfs",
                          lambda p: True) == Check(
        "ec-store", "ok", f"{tmp_path}: tmpfs, 1.5 GiB free of 2.0 GiB")
    monkeypatch.setattr(host, "SHM", tmp_path / "missing")
    missing = check_ec_store(None, disk(1), lambda p: "tmpfs", lambda p: True)
    assert (missing.status, missing.detail) == ("fail", f"{tmp_path}/missing does not exist")


def test_filesystem_type() -> None:
    assert filesystem_type(Path("/proc/self")) == "proc"
    assert filesystem_type(Path("/")) is not None


def test_ports_with_a_fake_binder(tmp_path: Path) -> None:
    topo = topology(ports={"base": 9100, "side_channel_base": 9600},
                    roles={"encode": {"gpus": [0]}, "prefill": {"gpus": [1]},
                           "decode": {"gpus": [2]}})
    placed = _plan(topo, tmp_path, ["0", "1", "2"])
    assert check_ports(placed, lambda p: None) == Check(
        "ports", "ok", "6 free: 9100, 9101, 9102, 9600, 9601, 8000")

    def taken(_: Plan) -> None:
        raise PlanError("port 9101 for `prefill-0` is already in use\nport 8000 for `proxy` "
                        "is already in use")

    check = check_ports(placed, taken)
    assert check.status == "fail"
    assert check.detail == ("port 9101 for `prefill-0` is already in use; port 8000 for "
                            "`proxy` is already in use")
    assert check_ports(None, taken).status == "skip"


def test_ports_really_bound(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        topo = topology(**CPU, proxy={"port": port}, ports={"base": port + 1})
        placed = _plan(topo, tmp_path)
        check = check_ports(placed, check_plan_ports)
        assert check.detail.startswith(f"port {port} for `proxy` is already in use")
        (tmp_path / "state").mkdir()
        (tmp_path / "state" / "state.json").write_text("{}")
        again = check_ports(placed, check_plan_ports)
        assert again.fix.startswith("it may be `t` itself: `epdctl status --name t`")
    assert check_ports(placed, check_plan_ports).status == "ok"
