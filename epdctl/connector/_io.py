"""Tensor <-> store copies for the worker side: one write per save, one read per load."""

from __future__ import annotations

import torch

from epdctl.cache._format import EntryHeader
from epdctl.cache.store import Store, read_into


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the store's dtype strings)."""
    return str(dtype).removeprefix("torch.")


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


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
    t = t.detach()
    if t.device.type != "cpu":
        host = staging.get(t.numel() * t.element_size())
        # A synchronous copy: the entry must be complete before E answers.
        host.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        data = host.numpy().data
    else:
        data = as_bytes(t.contiguous())
    return store.publish(key, data, dtype=dtype_name(t.dtype), shape=tuple(t.shape))


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
            t = torch.empty(header.shape, dtype=dtype)
            dst = as_bytes(t)
        else:
            chunk = host[offset : offset + header.nbytes]
            dst = chunk.numpy().data
        error = _read_first(paths, header, dst)
        if error is not None:
            out.append(error)
        elif host is None:
            out.append(t)
        else:
            t = torch.empty(header.shape, dtype=dtype, device=device)
            t.reshape(-1).view(torch.uint8).copy_(chunk, non_blocking=True)
            out.append(t)
        offset += header.nbytes
    staging.fence()
    return out


def _read_first(paths: tuple[str, ...], header: EntryHeader, dst: memoryview) -> OSError | None:
    error = OSError("no path to read")
    for path in paths:
        try:
            read_into(path, header, dst)
            return None
        except OSError as exc:
            error = exc
    return error
