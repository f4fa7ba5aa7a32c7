"""An entry's payload through the process's kept mappings: copied in, copied out, mapped."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from epdctl.cache._format import EntryHeader
from epdctl.cache._maps import MAPPINGS

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Writes an entry's payload into its mapped bytes (a memoryview of exactly its size).
Fill = Callable[[memoryview], None]
# Copies an entry's payload out of its mapped bytes (read-only, exactly its size).
Drain = Callable[[memoryview], None]


def read_into(path: str, header: EntryHeader, out: Buffer | Drain) -> None:
    """Copy the payload of the entry at `path` into `out` (exactly header.nbytes).

    `out`: a writable buffer, or a function that copies out of the mapped payload (a
    read-only memoryview of exactly header.nbytes).
    """
    drain = out if callable(out) else _drain_into(out, header.nbytes)
    with map_entry(path, header) as payload:
        if header.nbytes:
            drain(payload)


def map_entry(path: str, header: EntryHeader, *, write: bool = False) -> memoryview:
    """The payload of the entry at `path`, through its kept mapping: release it when done.

    OSError when the file is shorter than its header says. `write` maps it writable
    (the connector's CUDA path registers such mappings; it never writes through them).
    """
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        end = header.data_offset + header.nbytes
        # The file's size is checked against `end` first: a shorter file is an OSError.
        with MAPPINGS.view(fd, end, write=write) as mapped:
            return mapped[header.data_offset : end]
    finally:
        os.close(fd)


def _checked(buf: Buffer, nbytes: int) -> memoryview:
    view = memoryview(buf).cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"the buffer holds {view.nbytes} bytes, the entry {nbytes}")
    return view


def fill_from(buf: Buffer, nbytes: int) -> Fill:
    """A Fill that copies a plain buffer into the entry (one memcpy)."""
    view = _checked(buf, nbytes)

    def fill(mapped: memoryview) -> None:
        mapped[:] = view

    return fill


def _drain_into(buf: Buffer, nbytes: int) -> Drain:
    """A Drain that copies the entry into a plain writable buffer (one memcpy)."""
    view = _checked(buf, nbytes)

    def drain(mapped: memoryview) -> None:
        view[:] = mapped

    return drain
