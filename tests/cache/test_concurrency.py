"""Several processes writing and reading one key: every read is one whole version."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from epdctl.cache.janitor import enforce
from epdctl.cache.store import Pin, Store, read_into, unpin
from tests.cache.conftest import payload

ROWS = 512  # 16 KiB per version: large enough that a torn write would show


def _writer(root: str, seed: int, times: int) -> None:
    store = Store(root, "ns-test")
    for _ in range(times):
        store.publish("shared", payload(ROWS, seed=seed), dtype="float32", shape=(ROWS, 8))


def _reader(root: str, times: int, bad: mp.Queue, good: mp.Queue) -> None:
    store = Store(root, "ns-test")
    valid = {payload(ROWS, seed=s) for s in range(4)}
    for i in range(times):
        p = store.pin("shared", engine="pd", request=f"r{i}", index=0, rows=ROWS)
        if not isinstance(p, Pin):
            continue
        out = bytearray(p.header.nbytes)
        read_into(p.paths[0], p.header, out)
        unpin(p.paths)
        if bytes(out) not in valid:
            bad.put(i)
        else:
            good.put(i)


def _evictor(root: str, times: int) -> None:
    for _ in range(times):
        enforce(Path(root), capacity_bytes=0, ttl_s=0, grace_s=0)


def test_concurrent_writers_readers_and_evictions(store_root: Path) -> None:
    store = Store(store_root, "ns-test").create()
    ctx = mp.get_context("spawn")
    bad, good = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(store_root), s, 60)) for s in range(4)]
    procs += [ctx.Process(target=_reader, args=(str(store_root), 200, bad, good)) for _ in range(2)]
    procs.append(ctx.Process(target=_evictor, args=(str(store_root), 100)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert bad.empty()
    assert not good.empty()  # the readers did read while writers and the evictor ran
    # The last rename won; no half-written file and no tmp file remains.
    assert os.listdir(store.tmp) == [] and os.listdir(store.pins) == []
    _writer(str(store_root), 3, 1)
    p = store.pin("shared", engine="pd", request="last", index=0, rows=ROWS)
    assert isinstance(p, Pin)
    unpin(p.paths)
