"""The pool stocked ahead: pre-faulted spare files within the capacity, claimed by saves,
mapped ahead by readers, given back when entries need the room, gone after `down`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from epdctl.cache import _maps, _recycle
from epdctl.cache._maps import MAPPINGS, prefault
from epdctl.cache._prefault import Premapper, entries_bytes
from epdctl.cache.janitor import enforce
from epdctl.cache.store import Pin, Store, read_into, unpin
from epdctl.launch.run import stop
from epdctl.launch.state import Record, RunState, SpecModel, StateDir
from tests.cache.conftest import payload
from tests.waits import WAIT_S, until_sync

ROOT = Path(__file__).parent.parent.parent
ROWS, COLS = 64, 256  # float32: 64 KiB of payload
TOTAL = 4096 + ROWS * COLS * 4  # an entry file: its header page and the payload


def save(store: Store, key: str, rows: int = ROWS, seed: int = 0) -> bytes:
    data = payload(rows, COLS, seed=seed)
    store.publish(key, data, dtype="float32", shape=(rows, COLS))
    if store.stocker is not None:
        assert store.stocker.settled(WAIT_S)
    return data


def read(store: Store, key: str) -> bytes:
    p = store.pin(key, engine="pd", request="r", index=0)
    assert isinstance(p, Pin), p
    out = bytearray(p.header.nbytes)
    read_into(p.paths[0], p.header, out)
    unpin(p.paths)
    return bytes(out)


def pooled(store: Store) -> dict[int, str]:
    """The pool's files by inode."""
    return {os.stat(path).st_ino: path for path, _ in _recycle.pool_files(store.free)}


def usage(store: Store) -> tuple[int, int]:
    """(entries, pool) bytes."""
    return entries_bytes(store.entries), _recycle.pool_usage(store.free)[1]


def test_the_pool_never_holds_more_than_the_capacity_allows(store_root: Path) -> None:
    capacity = 24 * TOTAL  # the pool's share: 3 files
    store = Store(store_root, "ns-test", capacity_bytes=capacity).create()
    most = 0
    try:
        for i in range(30):  # past the capacity: no janitor runs here
            save(store, f"k{i}", seed=i)
            entries, pool = usage(store)
            assert pool <= min(capacity // _recycle.POOL_SHARE, max(0, capacity - entries)), i
            most = max(most, pool)
    finally:
        store.close()
    assert most == 3 * TOTAL  # it was stocked while there was room
    assert usage(store)[1] == 0  # and holds nothing once the entries take it all


def test_an_entry_written_into_a_pooled_file_reads_back_exactly(store_root: Path) -> None:
    store = Store(store_root, "ns-test", capacity_bytes=1 << 30).create()
    try:
        save(store, "first", seed=1)
        spare = pooled(store)
        assert len(spare) == _recycle.FREE_MAX_FILES  # stocked off the critical path
        # ... through mappings the writer keeps, and that a reader makes ahead:
        assert all(MAPPINGS.is_mapped(os.stat(path), write=True) for path in spare.values())
        assert Premapper(store.free).scan() == len(spare)
        for key, rows, seed in (("same-size", ROWS, 2), ("smaller", 3, 3)):
            data = payload(rows, COLS, seed=seed)
            store.publish(key, data, dtype="float32", shape=(rows, COLS))
            st = os.stat(store.entry_path(key))
            assert st.st_ino in spare and st.st_size == 4096 + len(data)  # a pooled file, trimmed
            assert MAPPINGS.is_mapped(st, write=False)  # the read maps nothing new
            assert read(store, key) == data
        assert read(store, "first") == payload(ROWS, COLS, seed=1)
    finally:
        store.close()


def test_a_broken_pool_is_passed_by_and_a_fresh_file_saved(store_root: Path) -> None:
    """The pool's directory replaced by a file: the save writes a fresh file, the stocker
    and a reader's premapper go on without it."""
    store = Store(store_root, "ns-test", capacity_bytes=1 << 30).create()
    try:
        save(store, "first", seed=1)
        hint = next(iter(pooled(store).values()))
        os.rename(store.free, store.root / "free.aside")
        store.free.write_bytes(b"not a directory")
        assert _recycle.claim(store.free, f"{store.tmp}/t", TOTAL, hint) is None
        assert Premapper(store.free).scan() == 0
        assert save(store, "second", seed=2) == read(store, "second")
        assert os.stat(store.entry_path("second")).st_ino not in {
            os.stat(p).st_ino for p, _ in _recycle.pool_files(store.root / "free.aside")}
    finally:
        store.close()


def test_a_reader_maps_the_pool_in_the_background(store_root: Path) -> None:
    writer = Store(store_root, "ns-test", capacity_bytes=1 << 30).create()
    reader = Store(store_root, "ns-test")
    reader.watch_pool()
    try:
        save(writer, "first")
        stats = [os.stat(path) for path in pooled(writer).values()]
        until_sync(lambda: all(MAPPINGS.is_mapped(st, write=False) for st in stats),
                   "the reader mapped every pooled file")
        data = save(writer, "second", seed=5)
        assert MAPPINGS.is_mapped(os.stat(writer.entry_path("second")), write=False)
        assert read(reader, "second") == data
    finally:
        writer.close()
        reader.close()


def test_the_pool_drains_when_the_store_needs_the_room(store_root: Path) -> None:
    capacity = 64 * TOTAL
    store = Store(store_root, "ns-test", capacity_bytes=capacity).create()
    try:
        save(store, "first")
    finally:
        store.close()
    assert usage(store)[1] == _recycle.FREE_MAX_FILES * TOTAL
    # Entries too large for the pooled files (written fresh) fill the store; young ones,
    # so that the janitor may not evict them: only the pool can give the room back.
    for i in range(30):
        save(store, f"big{i}", rows=2 * ROWS)
    entries, pool = usage(store)
    assert entries + pool > capacity
    report = enforce(store_root, capacity_bytes=capacity, ttl_s=1e6, grace_s=1e6)
    assert report.removed == [] and report.kept_young == 31
    entries, pool = usage(store)
    assert entries + pool <= capacity and 0 < pool < _recycle.FREE_MAX_FILES * TOTAL


def test_at_capacity_evicted_files_wait_in_the_pool_within_the_capacity(
    store_root: Path,
) -> None:
    capacity = 64 * TOTAL
    store = Store(store_root, "ns-test").create()  # no stocking: only the janitor feeds it
    for i in range(70):
        save(store, f"k{i}")
    enforce(store_root, capacity_bytes=capacity, ttl_s=1e6, grace_s=0)
    entries, pool = usage(store)
    assert entries + pool <= capacity
    assert pool == _recycle.pool_reserve(capacity, TOTAL) == _recycle.FREE_MAX_FILES * TOTAL
    before = set(pooled(store))
    save(store, "next")
    assert os.stat(store.entry_path("next")).st_ino in before  # recycled, not made anew


def test_the_stocker_never_makes_a_removed_namespace_again(store_root: Path) -> None:
    store = Store(store_root, "ns-test", capacity_bytes=1 << 30).create()
    try:
        save(store, "first")
        shutil.rmtree(store.root)  # `down` or `cache clean --all`
        assert store.stocker is not None
        store.stocker.wrote(TOTAL)
        assert store.stocker.settled(WAIT_S)
        assert store.stocker.stock() == 0
    finally:
        store.close()
    assert not store.root.exists()


WRITER = """
import itertools, os, sys
from epdctl.cache.store import Store
store = Store(sys.argv[1], "ns-test", capacity_bytes=1 << 30)
for i in itertools.count():  # saving (and restocking) until stopped
    store.publish(f"k{i % 16}", bytes(NBYTES), dtype="float32", shape=(ROWS, COLS))
    if i == 0:
        store.stocker.settled(10)
        print(len(os.listdir(store.free)), flush=True)
""".replace("NBYTES", str(ROWS * COLS * 4)).replace("ROWS", str(ROWS)).replace("COLS", str(COLS))


def test_nothing_of_the_store_is_left_after_down(tmp_path: Path, store_root: Path) -> None:
    store = Store(store_root, "ns-test").create()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store_root)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert int(proc.stdout.readline()) > 0  # E's spare files are there while it runs
        spec = SpecModel(name="encode-0", role="encode", command=["x"], env={}, port=1,
                         log_path="/l")
        state = RunState(name="demo", topology_path="/t.yaml", created_at=1.0, mode="e-pd",
                         namespace="ns-test", store_dir=str(store.root), model_name="m",
                         specs=[spec])
        state.records["encode-0"] = Record(
            name="encode-0", pid=proc.pid, pgid=proc.pid, started_at=time.time(),
            create_time=psutil.Process(proc.pid).create_time())
        sdir = StateDir(tmp_path / "demo")
        sdir.write(state)
        result = stop(sdir, state, timeout_s=WAIT_S)
        assert result.stopped == ["encode-0"] and proc.wait(WAIT_S) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not store.root.exists() and not store_root.exists()


class _OldKernelMap(bytearray):
    """A mapping whose madvise knows no MADV_POPULATE_* (Linux before 5.14)."""

    def madvise(self, option: int, start: int, length: int) -> None:
        raise OSError(22, "Invalid argument")


@pytest.mark.parametrize("write", [True, False])
def test_prefaulting_without_madv_populate_touches_every_page_and_keeps_the_bytes(
    write: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_maps, "_madvise", lambda address, length, option: False)  # EINVAL
    data = bytes(range(1, 256)) * 65  # 4 pages and a bit, no page starting with a zero
    mm = _OldKernelMap(data)
    prefault(mm, write=write)  # type: ignore[arg-type]
    assert bytes(mm) == data
