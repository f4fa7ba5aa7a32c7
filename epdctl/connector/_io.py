"""Tensor <-> store copies for the worker side: one write per save, one read per load."""

from __future__ import annotations

import warnings

import torch

from epdctl.cache._format import EntryHeader
from epdctl.cache.store import Store, read_into


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


class HostStaging:
    """A reusable host buffer: pinned for CUDA (fast, async copies), none on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

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
    """Publish `t` under `key`; returns the payload bytes. Raises on failure."""
    src = t.detach() if t.requires_grad else t
    if src.device.type != "cpu":
        host = staging.get(src.numel() * src.element_size())
        # A synchronous copy: the entry must be complete before E answers.
        host.copy_(src.contiguous().reshape(-1).view(torch.uint8))
        src = host.view(src.dtype).view(src.shape)
    dtype, shape = src.dtype, tuple(src.shape)

    def fill(mapped: memoryview) -> None:
        mapped_tensor(mapped, dtype, shape).copy_(src)

    return store.publish(key, fill, dtype=dtype_name(dtype), shape=shape)


def load_tensors(
    items: list[tuple[tuple[str, ...], EntryHeader]],
    device: torch.device,
    staging: HostStaging,
) -> list[torch.Tensor | OSError]:
    """Read each entry into a new tensor on `device`, trying its paths in order."""
    out: list[torch.Tensor | OSError] = []
    host = None if staging.is_cpu else staging.get(sum(h.nbytes for _, h in items))
    offset = 0
    for paths, header in items:
        dtype = getattr(torch, header.dtype)
        if host is None:
            dst = torch.empty(header.shape, dtype=dtype)
        else:
            chunk = host[offset : offset + header.nbytes]
            dst = chunk.view(dtype).view(header.shape)
        error = _read_first(paths, header, dst)
        if error is not None:
            out.append(error)
        elif host is None:
            out.append(dst)
        else:
            t = torch.empty(header.shape, dtype=dtype, device=device)
            t.copy_(dst, non_blocking=True)
            out.append(t)
        offset += header.nbytes
    staging.fence()
    return out


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
