"""Tensor <-> store copies for the worker side: one write per save, one read per load."""

from __future__ import annotations

import logging
import threading
import warnings

import torch

from epdctl.cache.store import MAPPINGS, EntryHeader, Store, map_entry, read_into

logger = logging.getLogger(f"vllm.{__name__}")

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not just this one


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the store's dtype strings)."""
    return str(dtype).removeprefix("torch.")


_quiet = False


def mapped_tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over an entry's mapped payload (no copy): copy into or out of it.

    torch copies with its thread pool (one memcpy thread cannot fill the memory
    bandwidth), and few torch calls: right after a big copy every call runs cold.
    """
    global _quiet
    if not _quiet:
        # Readers map entries read-only; torch.frombuffer warns about that (it only reads
        # here), once per process: the first call hides that one warning.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(memoryview(b"\0"), dtype=torch.uint8)
        _quiet = True
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class CudaRegistry:
    """Kept mappings of store files, registered with CUDA: entries DMA to and from the GPU.

    A registered (page-locked in place) mapping moves at the copy engine's speed with no
    host copy; through pinned staging a load or save runs at 0.23-0.40 of it (H200,
    benchmarks/connector_cuda.py). Registering costs milliseconds (0.8-15 ms for 9-64 MiB
    there), more than one copy saves, so a mapping is registered when it is used a second
    time: a recycled entry file, the steady state at capacity.
    The registration goes before its mapping does (MAPPINGS.on_drop).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = True
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._registered: dict[int, tuple[int, memoryview]] = {}

    def ready(self, payload: memoryview) -> bool:
        """Whether `payload`'s mapping is registered now (it may register it)."""
        mm = payload.obj
        key = id(mm)
        with self._lock:
            if key in self._registered:
                return True
            first = key not in self._seen
            self._seen.add(key)
        if first:
            # Forget it with the mapping (an id may come back for another mapping).
            if not MAPPINGS.on_drop(mm, lambda: self._forget(key)):
                self._seen.discard(key)
            return False
        if not self.enabled:
            return False
        whole = memoryview(mm)  # type: ignore[arg-type]  # held: the mapping stays while registered
        base = torch.frombuffer(whole, dtype=torch.uint8).data_ptr()
        rc = torch.cuda.cudart().cudaHostRegister(base, whole.nbytes, CUDA_HOST_REGISTER_PORTABLE)
        if int(rc) != 0:
            whole.release()
            self.enabled = False
            _clear_cuda_error()
            logger.warning("EC store: cudaHostRegister failed (%s); loading through staging", rc)
            return False
        with self._lock:
            self._registered[key] = (base, whole)
        return True

    def _forget(self, key: int) -> None:
        with self._lock:
            self._seen.discard(key)
            entry = self._registered.pop(key, None)
        if entry is not None:
            base, whole = entry
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(base)
            whole.release()


def _clear_cuda_error() -> None:
    """Reset CUDA's last error, so torch's next launch check does not raise it."""
    get_last_error = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return
    import ctypes

    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libcudart" in path:
            ctypes.CDLL(path).cudaGetLastError()
            return


class HostStaging:
    """A reusable host buffer: pinned for CUDA (fast, async copies), none on CPU."""

    def __init__(self, device: torch.device, *, register: bool = True) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        is_cuda = device.type == "cuda" and torch.cuda.is_available()
        self.registry = CudaRegistry(device) if register and is_cuda else None

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def get(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` of pinned memory, once the copies out of it have finished."""
        if self._event is not None:
            # The previous step's non-blocking copies may still read the buffer.
            self._event.synchronize()
            self._event = None
        if self._buf is None or self._buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self._buf is None else self._buf.numel()))
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self._buf[:nbytes]

    def fence(self) -> None:
        """Record that copies out of the buffer were queued on the current stream."""
        if not self.is_cpu and torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record()


def save_tensor(store: Store, key: str, t: torch.Tensor, staging: HostStaging) -> int:
    """Publish `t` under `key`; returns the payload bytes. Raises on failure.

    Every copy here is synchronous: the entry must be complete before E answers.
    """
    src = t.detach() if t.requires_grad else t
    dtype, shape = src.dtype, tuple(src.shape)
    registry = staging.registry if src.device.type != "cpu" else None

    def fill(mapped: memoryview) -> None:
        dst = mapped_tensor(mapped, dtype, shape)
        if src.device.type == "cpu" or (registry is not None and registry.ready(mapped)):
            dst.copy_(src)  # on a GPU: a DMA straight into the entry's registered mapping
            return
        host = staging.get(src.numel() * src.element_size())
        host.copy_(src.contiguous().reshape(-1).view(torch.uint8))
        dst.copy_(host.view(dtype).view(shape))

    return store.publish(key, fill, dtype=dtype_name(dtype), shape=shape)


def load_tensors(
    items: list[tuple[tuple[str, ...], EntryHeader]],
    device: torch.device,
    staging: HostStaging,
) -> list[torch.Tensor | OSError]:
    """Read each entry into a new tensor on `device`, trying its paths in order."""
    out: list[torch.Tensor | OSError | None] = [None] * len(items)
    held: list[memoryview] = []
    if staging.registry is not None:
        for i, (paths, header) in enumerate(items):
            loaded = _load_registered(paths, header, device, staging.registry, held)
            if loaded is not None:
                out[i] = loaded
    todo = [i for i, t in enumerate(out) if t is None]
    host = None if staging.is_cpu else staging.get(sum(items[i][1].nbytes for i in todo))
    offset = 0
    for i in todo:
        paths, header = items[i]
        dtype = getattr(torch, header.dtype)
        if host is None:
            dst = torch.empty(header.shape, dtype=dtype)
        else:
            chunk = host[offset : offset + header.nbytes]
            dst = chunk.view(dtype).view(header.shape)
        error = _read_first(paths, header, dst)
        if error is not None:
            out[i] = error
        elif host is None:
            out[i] = dst
        else:
            t = torch.empty(header.shape, dtype=dtype, device=device)
            t.copy_(dst, non_blocking=True)
            out[i] = t
        offset += header.nbytes
    staging.fence()
    if held:
        # The DMAs read the store's pages: done before the caller unpins (and the file
        # may be recycled).
        torch.cuda.current_stream(device).synchronize()
        for payload in held:
            payload.release()
    return [t for t in out if t is not None]


def _load_registered(
    paths: tuple[str, ...],
    header: EntryHeader,
    device: torch.device,
    registry: CudaRegistry,
    held: list[memoryview],
) -> torch.Tensor | None:
    """Queue a DMA of the entry from its registered mapping; None: load it otherwise."""
    if not header.nbytes:
        return None
    for path in paths:
        try:
            payload = map_entry(path, header, write=True)
        except OSError:
            continue
        if not registry.ready(payload):
            payload.release()
            return None
        dtype = getattr(torch, header.dtype)
        t = torch.empty(header.shape, dtype=dtype, device=device)
        t.copy_(mapped_tensor(payload, dtype, tuple(header.shape)), non_blocking=True)
        held.append(payload)
        return t
    return None  # the staging path reports the error


def read_tensor(path: str, header: EntryHeader, dst: torch.Tensor) -> None:
    """Copy the entry at `path` into `dst` (a CPU tensor of the entry's dtype and shape)."""
    dtype, shape = dst.dtype, tuple(dst.shape)

    def drain(mapped: memoryview) -> None:
        dst.copy_(mapped_tensor(mapped, dtype, shape))

    read_into(path, header, drain)


def _read_first(paths: tuple[str, ...], header: EntryHeader, dst: torch.Tensor) -> OSError | None:
    error = OSError("no path to read")
    for path in paths:
        try:
            read_tensor(path, header, dst)
            return None
        except OSError as exc:
            error = exc
    return error
