"""A symbolic link planted at any file name epdctl writes (in the state dir, a log dir or the
EC store, under its own name or the tmp names it used to use) is never followed: the file
it points to is untouched, and epdctl either replaces the link itself or refuses."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from epdctl.cache.capacity import check_capacity
from epdctl.cache.sidecar import meta_path, write_meta
from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import STATS, Store
from epdctl.cache.store_root import RECORD, record_namespace
from epdctl.errors import StateError
from epdctl.host import private
from epdctl.launch.processes import spawn
from epdctl.launch.spec import LaunchSpec
from epdctl.launch.state import LAST_RUN, StateDir
from epdctl.logs.stamps import stamps_path
from epdctl.proxy.stages.lookup import STATS_WRITER, StoreLookup
from tests.cache.conftest import payload
from tests.launch.test_state import make_state

PRECIOUS = b"precious: not epdctl's to write\n"
OLD = 1_000_000_000.0


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's that a planted link points at."""
    path = tmp_path / "victim"
    path.write_bytes(PRECIOUS)
    os.utime(path, (OLD, OLD))
    return path


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    return root


@pytest.fixture
def store(store_root: Path) -> Store:
    return Store(store_root, "ns-test").create()


def plant(link: Path, victim: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link


def untouched(victim: Path) -> bool:
    """Its bytes, and its times too (a pending mark's deadline is its mtime)."""
    st = victim.lstat()
    return victim.read_bytes() == PRECIOUS and st.st_mtime == OLD and st.st_nlink == 1


def old_tmp(path: Path) -> Path:
    """The tmp name epdctl used before (`.name.<pid>.tmp`): guessable by anyone."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@pytest.mark.parametrize("at", ["state.json", "old-tmp", "record", "last-run"])
def test_state_dir_writes_replace_a_planted_link(tmp_path: Path, victim: Path, at: str) -> None:
    sdir = StateDir(tmp_path / "state" / "demo")
    sdir.make()
    link = {"state.json": sdir.state_file, "old-tmp": old_tmp(sdir.state_file),
            "record": sdir.path / RECORD, "last-run": sdir.path / LAST_RUN}[at]
    plant(link, victim)
    sdir.write(make_state())
    record_namespace(sdir.path, tmp_path / "store", "demo-0123456789ab")
    sdir.retire()
    assert untouched(victim)
    assert not sdir.state_file.is_symlink()


def test_a_link_at_the_lock_is_refused(tmp_path: Path, victim: Path) -> None:
    sdir = StateDir(tmp_path / "state" / "demo")
    sdir.make()
    plant(sdir.lock_file, victim)
    with pytest.raises(StateError, match=r"cannot open .*/lock: it is a symbolic link"):
        sdir.lock()
    assert untouched(victim)


@pytest.mark.parametrize("which", ["log", "stamps"])
def test_a_link_at_a_log_is_refused(tmp_path: Path, victim: Path, which: str) -> None:
    logs = tmp_path / "state" / "demo" / "logs"
    log = logs / "x.log"
    path = log if which == "log" else stamps_path(log)
    plant(path, victim)
    with pytest.raises(OSError, match="symbolic link"):
        private.open_append(path)
    if which == "log":
        spec = LaunchSpec(name="x", role="encode", command=(sys.executable, "-c", "print(1)"),
                          port=1, log_path=log)
        with pytest.raises(OSError, match="symbolic link"):
            spawn(spec, logs.parent)
    assert untouched(victim)


def test_a_log_in_a_directory_others_can_reach_is_refused(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    os.chmod(logs, 0o777)
    with pytest.raises(PermissionError, match="refusing the log dir"):
        private.open_append(logs / "x.log")
    assert not (logs / "x.log").exists()


def _stats(store: Store) -> None:
    stats = StatsWriter(store.root, STATS_WRITER)
    stats.add(hits=1)
    stats.close()


def _sidecar(store: Store) -> None:
    store.publish("k", payload(2), dtype="float32", shape=(2, 8))
    assert write_meta(store, "k", {"metadata": {"a": 1}})


def _publish(store: Store) -> None:
    store.publish("k", payload(2), dtype="float32", shape=(2, 8))


def _pending(store: Store) -> None:
    assert store.mark_pending("k", 1e10) is False  # refused, not followed
    assert store.pending_until("k") is None or Path(store.pending_path("k")).is_symlink()


STORE_WRITES: dict[str, tuple[Callable[[Store], Path], Callable[[Store], None]]] = {
    "stats": (lambda s: s.root / STATS / "proxy.json", _stats),
    "stats-old-tmp": (lambda s: old_tmp(s.root / STATS / "proxy.json"), _stats),
    "sidecar": (lambda s: Path(meta_path(s, "k")), _sidecar),
    "entry": (lambda s: Path(s.entry_path("k")), _publish),
    "pending": (lambda s: Path(s.pending_path("k")), _pending),
}


@pytest.mark.parametrize("at", list(STORE_WRITES))
def test_store_writes_never_follow_a_planted_link(store: Store, victim: Path, at: str) -> None:
    where, write = STORE_WRITES[at]
    plant(where(store), victim)
    write(store)
    assert untouched(victim)


def test_the_capacity_probe_writes_only_a_fresh_file(store_root: Path) -> None:
    check_capacity(store_root, 1)
    assert os.listdir(store_root) == []  # its probe is gone again


def test_a_refused_store_gets_no_writes_from_the_proxy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ns = root / "ns"
    (ns / STATS).mkdir(parents=True)
    os.chmod(root, 0o755)  # others can read it: refused
    lookup = StoreLookup(str(root), "ns")
    assert lookup.store.refused is not None
    lookup.count(1, 0, 1)
    lookup.scan()
    lookup.close()
    assert list(ns.rglob("*")) == [ns / STATS]  # nothing was written, stats/ included
