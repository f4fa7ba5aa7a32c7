"""visible_gpus() against a fake pynvml module (no driver needed)."""

from __future__ import annotations

import sys
import types

import pytest

from epdctl.errors import PlanError
from epdctl.host.gpus import visible_gpus

HINT = "for a CPU-only machine use `device: cpu`, see topologies/cpu-demo.yaml"
UUIDS = ["GPU-11111111-aaaa", "GPU-22222222-bbbb", "GPU-33333333-cccc", "GPU-44444444-dddd"]


class NVMLError(Exception):
    pass


def _fake_nvml(monkeypatch: pytest.MonkeyPatch, uuids: list[str] | None = None,
               init_error: str | None = None, as_bytes: bool = True) -> list[str]:
    """Install a fake pynvml; returns the call log."""
    calls: list[str] = []
    module = types.ModuleType("pynvml")

    def init() -> None:
        calls.append("init")
        if init_error:
            raise NVMLError(init_error)

    def uuid(handle: int) -> bytes | str:
        value = (uuids or [])[handle]
        return value.encode() if as_bytes else value

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(uuids or [])  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = uuid  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return calls


def test_all_gpus_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvml(monkeypatch, UUIDS)
    assert visible_gpus({}) == ["0", "1", "2", "3"]
    assert calls == ["init", "shutdown"]


def test_str_uuids_work_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(monkeypatch, UUIDS, as_bytes=False)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-2222"}) == ["GPU-2222"]


@pytest.mark.parametrize(("outer", "expected"), [
    ("2,3", ["2", "3"]),
    (" 3 , 1 ", ["3", "1"]),
    ("GPU-33333333,GPU-11111111-aaaa", ["GPU-33333333", "GPU-11111111-aaaa"]),
    ("MIG-abcdef", ["MIG-abcdef"]),
])
def test_outer_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, outer: str,
                                    expected: list[str]) -> None:
    _fake_nvml(monkeypatch, UUIDS)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": outer}) == expected


def test_environ_defaults_to_the_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(monkeypatch, UUIDS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpus() == ["1"]


@pytest.mark.parametrize("outer", ["", "-1", "7", "GPU-99"])
def test_outer_value_hiding_everything(monkeypatch: pytest.MonkeyPatch, outer: str) -> None:
    _fake_nvml(monkeypatch, UUIDS)
    with pytest.raises(PlanError) as info:
        visible_gpus({"CUDA_VISIBLE_DEVICES": outer})
    assert str(info.value) == (
        f"no NVIDIA GPU visible: CUDA_VISIBLE_DEVICES={outer!r} hides all 4; unset it, or {HINT}"
    )


def test_outer_value_with_a_bad_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(monkeypatch, UUIDS)
    with pytest.raises(PlanError) as info:
        visible_gpus({"CUDA_VISIBLE_DEVICES": "0,9"})
    assert str(info.value) == (
        "CUDA_VISIBLE_DEVICES='0,9': '9' is not a GPU of this machine "
        "(NVML shows 4: indices 0 to 3)"
    )
    with pytest.raises(PlanError, match="lists a GPU twice"):
        visible_gpus({"CUDA_VISIBLE_DEVICES": "1,1"})
    with pytest.raises(PlanError, match="'GPU-' is not a GPU"):  # ambiguous prefix
        visible_gpus({"CUDA_VISIBLE_DEVICES": "0,GPU-"})


def test_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvml(monkeypatch, init_error="NVML Shared Library Not Found")
    with pytest.raises(PlanError) as info:
        visible_gpus({})
    assert str(info.value) == f"no NVIDIA GPU found (NVML: NVML Shared Library Not Found); {HINT}"
    assert calls == ["init"]


def test_zero_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvml(monkeypatch, [])
    with pytest.raises(PlanError) as info:
        visible_gpus({})
    assert str(info.value) == f"no NVIDIA GPU found (NVML: 0 devices); {HINT}"
    assert calls == ["init", "shutdown"]


def test_no_nvml_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(PlanError) as info:
        visible_gpus({})
    assert str(info.value) == f"no NVIDIA GPU found (NVML: nvidia-ml-py is not installed); {HINT}"


def test_nvml_failing_mid_listing_still_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvml(monkeypatch, UUIDS)

    def broken(handle: int) -> bytes:
        raise NVMLError("GPU is lost")

    monkeypatch.setattr(sys.modules["pynvml"], "nvmlDeviceGetUUID", broken)
    with pytest.raises(PlanError) as info:
        visible_gpus({})
    assert str(info.value) == "NVML cannot list the GPUs: GPU is lost"
    assert calls == ["init", "shutdown"]


def test_describe_gpus_names_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from epdctl.host.gpus import GpuInfo, describe_gpus

    calls = _fake_nvml(monkeypatch, UUIDS)
    module = sys.modules["pynvml"]

    def memory(handle: int) -> SimpleNamespace:
        if handle == 3:
            raise NVMLError("Not Supported")
        return SimpleNamespace(total=80 << 30, free=(70 + handle) << 30)

    module.nvmlDeviceGetName = lambda h: f"GPU model {h}".encode()  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    assert describe_gpus({}) == [
        GpuInfo("0", "GPU model 0", 80 << 30, 70 << 30),
        GpuInfo("1", "GPU model 1", 80 << 30, 71 << 30),
        GpuInfo("2", "GPU model 2", 80 << 30, 72 << 30),
        GpuInfo("3", "GPU model 3"),
    ]
    assert calls == ["init", "shutdown"] * 2
    outer = {"CUDA_VISIBLE_DEVICES": "GPU-3333,MIG-abc"}
    assert describe_gpus(outer) == [GpuInfo("GPU-3333", "GPU model 2", 80 << 30, 72 << 30),
                                    GpuInfo("MIG-abc", "MIG device")]
    with pytest.raises(PlanError, match="hides all 4"):
        describe_gpus({"CUDA_VISIBLE_DEVICES": ""})


def test_gpu_names_for_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    from epdctl.host.gpus import gpu_names

    calls = _fake_nvml(monkeypatch, UUIDS[:2])
    names = {0: b"NVIDIA H200", 1: "NVIDIA H200"}  # bytes from old bindings, str from new
    monkeypatch.setattr(sys.modules["pynvml"], "nvmlDeviceGetName", names.__getitem__,
                        raising=False)
    assert gpu_names() == ["NVIDIA H200", "NVIDIA H200"]
    assert calls == ["init", "shutdown"]
    _fake_nvml(monkeypatch, init_error="driver not loaded")
    with pytest.raises(PlanError, match="NVML: driver not loaded"):
        gpu_names()


def test_fake_gpus_replace_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    from epdctl.host.gpus import FAKE_GPU_NAME, describe_gpus

    calls = _fake_nvml(monkeypatch, UUIDS)
    env = {"EPDCTL_FAKE_GPUS": "3", "EPDCTL_FAKE_GPU_MEMORY": "24GiB",
           "CUDA_VISIBLE_DEVICES": "7"}
    assert visible_gpus(env) == ["0", "1", "2"]
    infos = describe_gpus(env)
    assert [(g.id, g.name, g.total_bytes) for g in infos] == [
        (str(i), FAKE_GPU_NAME, 24 << 30) for i in range(3)]
    assert calls == []  # NVML is never asked


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_fake_gpus_bad_count(value: str) -> None:
    with pytest.raises(PlanError, match="EPDCTL_FAKE_GPUS"):
        visible_gpus({"EPDCTL_FAKE_GPUS": value})
