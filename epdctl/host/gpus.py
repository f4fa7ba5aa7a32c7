"""visible_gpus(): the NVIDIA GPUs epdctl may hand out, found through NVML."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from epdctl.errors import PlanError

CPU_HINT = "for a CPU-only machine use `device: cpu`, see topologies/cpu-demo.yaml"
# The simulated machine (epdctl.sim): this many fake GPUs instead of NVML's, for plans only;
# the engines that run on them are epdctl.sim's fake engine. Read here and nowhere else.
FAKE_GPUS_ENV = "EPDCTL_FAKE_GPUS"
FAKE_GPU_MEMORY_ENV = "EPDCTL_FAKE_GPU_MEMORY"
FAKE_GPU_NAME = "epdctl-sim fake GPU"
FAKE_GPU_MEMORY = 80 << 30


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML describes it; memory is None where NVML cannot tell (MIG)."""

    id: str
    """The device id as written into CUDA_VISIBLE_DEVICES (an index or a UUID)."""
    name: str
    total_bytes: int | None = None
    free_bytes: int | None = None


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """The pynvml module between nvmlInit and nvmlShutdown; PlanError when NVML is absent."""
    try:
        import pynvml
    except ImportError:
        raise PlanError(
            f"no NVIDIA GPU found (NVML: nvidia-ml-py is not installed); {CPU_HINT}"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise PlanError(f"no NVIDIA GPU found (NVML: {exc}); {CPU_HINT}") from None
    try:
        yield pynvml
    except pynvml.NVMLError as exc:
        raise PlanError(f"NVML cannot list the GPUs: {exc}") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_devices() -> list[str]:
    """The UUID of every GPU NVML sees, by NVML index (PCI bus order, as nvidia-smi)."""
    with _nvml() as nvml:
        return [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))
                for index in range(nvml.nvmlDeviceGetCount())]


def fake_gpu_count(environ: Mapping[str, str] | None = None) -> int | None:
    """$EPDCTL_FAKE_GPUS as a count (None: unset, real GPUs); PlanError when not a count."""
    value = (os.environ if environ is None else environ).get(FAKE_GPUS_ENV)
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise PlanError(f"{FAKE_GPUS_ENV}={value!r}: expected a number of fake GPUs (1 or more)")
    return int(value)


def _fake_memory(environ: Mapping[str, str]) -> int:
    from epdctl.topology.sections import parse_size

    value = environ.get(FAKE_GPU_MEMORY_ENV)
    if value is None:
        return FAKE_GPU_MEMORY
    try:
        return parse_size(value)
    except ValueError as exc:
        raise PlanError(f"{FAKE_GPU_MEMORY_ENV}={value!r}: {exc}") from None


def _matches(entry: str, uuids: list[str]) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES entry names a GPU (an index or a UUID prefix)."""
    if entry.isdigit():
        return int(entry) < len(uuids)
    if entry.startswith("MIG-"):
        return True  # MIG instances are not listed by index; let CUDA judge
    return entry.startswith("GPU-") and sum(u.startswith(entry) for u in uuids) == 1


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """Device ids to write into each instance's CUDA_VISIBLE_DEVICES, in visible order.

    Without an outer CUDA_VISIBLE_DEVICES these are NVML indices ("0", "1", ...). With one,
    they are its entries as written (indices or GPU-UUIDs): the instances get the same
    devices the user let epdctl see, and a role's `gpus: [0]` means the first of them.
    """
    environ = os.environ if environ is None else environ
    fake = fake_gpu_count(environ)
    if fake is not None:  # the simulated machine: an outer CUDA_VISIBLE_DEVICES is not read
        return [str(i) for i in range(fake)]
    uuids = _nvml_devices()
    if not uuids:
        raise PlanError(f"no NVIDIA GPU found (NVML: 0 devices); {CPU_HINT}")
    outer = environ.get("CUDA_VISIBLE_DEVICES")
    if outer is None:
        return [str(i) for i in range(len(uuids))]
    entries = [e.strip() for e in outer.split(",")] if outer.strip() else []
    if not entries or not _matches(entries[0], uuids):
        raise PlanError(
            f"no NVIDIA GPU visible: CUDA_VISIBLE_DEVICES={outer!r} hides all {len(uuids)}; "
            f"unset it, or {CPU_HINT}"
        )
    for entry in entries:
        if not _matches(entry, uuids):
            # CUDA would silently drop this entry and every one after it.
            raise PlanError(
                f"CUDA_VISIBLE_DEVICES={outer!r}: {entry!r} is not a GPU of this machine "
                f"(NVML shows {len(uuids)}: indices 0 to {len(uuids) - 1})"
            )
    if len(set(entries)) != len(entries):
        raise PlanError(f"CUDA_VISIBLE_DEVICES={outer!r} lists a GPU twice")
    return entries


def _describe(nvml: Any, index: int, device_id: str) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(handle))
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    except nvml.NVMLError:
        return GpuInfo(device_id, name)  # e.g. not supported on this device
    return GpuInfo(device_id, name, int(memory.total), int(memory.free))


def describe_gpus(environ: Mapping[str, str] | None = None) -> list[GpuInfo]:
    """visible_gpus() with each GPU's name and memory now; PlanError as visible_gpus."""
    environ = os.environ if environ is None else environ
    ids = visible_gpus(environ)
    if fake_gpu_count(environ) is not None:
        memory = _fake_memory(environ)
        return [GpuInfo(i, FAKE_GPU_NAME, memory, memory) for i in ids]
    with _nvml() as nvml:
        uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))
                 for index in range(nvml.nvmlDeviceGetCount())]
        gpus = []
        for device_id in ids:
            if device_id.isdigit():
                gpus.append(_describe(nvml, int(device_id), device_id))
            elif device_id.startswith("MIG-"):
                gpus.append(GpuInfo(device_id, "MIG device"))
            else:
                index = next(i for i, u in enumerate(uuids) if u.startswith(device_id))
                gpus.append(_describe(nvml, index, device_id))
        return gpus


def gpu_names() -> list[str]:
    """The NVML name of every GPU, by NVML index (for reports: `bench` records them)."""
    fake = fake_gpu_count()
    if fake is not None:
        return [FAKE_GPU_NAME] * fake
    with _nvml() as nvml:
        return [_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index)))
                for index in range(nvml.nvmlDeviceGetCount())]


def process_memory() -> dict[int, int]:
    """GPU memory in use per process id, over every GPU NVML sees ({} without NVML)."""
    used: dict[int, int] = {}
    try:
        with _nvml() as nvml:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except nvml.NVMLError:
                    continue  # e.g. not supported on this device
                for proc in procs:
                    if proc.usedGpuMemory is not None:  # None where the driver hides it
                        used[proc.pid] = used.get(proc.pid, 0) + int(proc.usedGpuMemory)
    except PlanError:
        return {}
    return used
