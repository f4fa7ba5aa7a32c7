"""Several processes writing and reading one key: every read is one whole version."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from epdctl.cache.janitor import enforce
from epdctl.cache.store import Pin, Store, read_into, unpin
from tests.cache.conftest import payload

ROWS = 512  # 16 KiB per version: large enough that a torn write would show


def _writer(root: str, seed: int, times: int) -> None:
    store = Store(root, "ns-test")
    for _ in range(times):
        store.publish("shared", payload(ROWS, seed=seed), dtype="float32", shape=(ROWS, 8))


def _reader(root: str, stop: Any, bad: Any, good: Any) -> None:
    """Pin and read until told to stop, counting whole versions and torn ones."""
    store = Store(root, "ns-test")
    valid = {payload(ROWS, seed=s) for s in range(4)}
    i = 0
    while not stop.is_set():
        i += 1
        p = store.pin("shared", engine="pd", request=f"r{i}", index=0, rows=ROWS)
        if not isinstance(p, Pin):
            continue
        out = bytearray(p.header.nbytes)
        read_into(p.paths[0], p.header, out)
        unpin(p.paths)
        counter = good if bytes(out) in valid else bad
        with counter.get_lock():
            counter.value += 1


def _evictor(root: str, times: int) -> None:
    for _ in range(times):
        enforce(Path(root), capacity_bytes=0, ttl_s=0, grace_s=0)


def test_concurrent_writers_readers_and_evictions(store_root: Path) -> None:
    store = Store(store_root, "ns-test").create()
    ctx = mp.get_context("spawn")
    stop, bad, good = ctx.Event(), ctx.Value("i", 0), ctx.Value("i", 0)
    busy = [ctx.Process(target=_writer, args=(str(store_root), s, 60)) for s in range(4)]
    busy.append(ctx.Process(target=_evictor, args=(str(store_root), 100)))
    readers = [ctx.Process(target=_reader, args=(str(store_root), stop, bad, good))
               for _ in range(2)]
    for p in (*readers, *busy):
        p.start()
    try:
        for p in busy:
            p.join(timeout=120)
            assert p.exitcode == 0
        # One more version once the evictor is done, so the readers surely read one whole.
        _writer(str(store_root), 3, 1)
        deadline = time.monotonic() + 60
        while good.value == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for p in readers:
            p.join(timeout=60)
    assert [p.exitcode for p in readers] == [0, 0]
    assert bad.value == 0
    assert good.value > 0
    # The last rename won; no half-written file and no tmp file remains.
    assert os.listdir(store.tmp) == [] and os.listdir(store.pins) == []
    p = store.pin("shared", engine="pd", request="last", index=0, rows=ROWS)
    assert isinstance(p, Pin)
    unpin(p.paths)
