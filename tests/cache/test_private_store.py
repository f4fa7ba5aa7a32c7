"""A shared machine: the store is private to its user, and another user's (or a world-writable)
root or namespace directory is refused, so nothing planted in it is ever read."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from epdctl import cache
from epdctl.cache import _recycle
from epdctl.cache.capacity import check_capacity
from epdctl.cache.janitor import clean, enforce, keep_topology_store
from epdctl.cache.listing import inspect
from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import Pin, Store, unpin
from epdctl.errors import CacheError
from epdctl.topology.sections import Cache
from tests.cache.conftest import payload

NS = "ns-test"
OTHER = 65534  # nobody
IS_ROOT = os.geteuid() == 0


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def pin(store: Store, key: str) -> Pin | object:
    return store.pin(key, engine="pd-0", request="r1", index=0, rows=2, dtype="float32")


def test_the_default_root_is_per_user() -> None:
    assert cache.default_store_root() == f"/dev/shm/epdctl-{os.geteuid()}"
    assert cache.default_store_root(1234) == "/dev/shm/epdctl-1234"
    assert Cache().dir == Path(f"/dev/shm/epdctl-{os.geteuid()}")


def test_created_paths_are_private(store_root: Path) -> None:
    store = Store(store_root / "root", NS).create()
    for path in (store.root.parent, store.root, store.entries, store.pins, store.tmp,
                 store.free, store.root / "stats"):
        assert mode(path) == 0o700, path
    store.publish("k", payload(2), dtype="float32", shape=(2, 8))
    assert mode(store.entry_path("k")) == 0o600
    p = pin(store, "k")
    assert isinstance(p, Pin) and mode(p.paths[0]) == 0o600
    unpin(p.paths)
    stats = StatsWriter(store.root, "pd-0-scheduler")
    stats.add(hits=1)
    stats.close()
    assert mode(stats.path) == 0o600
    check_capacity(store_root / "other-root", 1)
    assert mode(store_root / "other-root") == 0o700


def test_a_recycled_file_of_an_older_epdctl_becomes_private(store: Store) -> None:
    old = store.free / f"{1 << 20}.old"
    old.write_bytes(b"x" * (1 << 20))
    os.chmod(old, 0o644)
    store.publish("k", payload(2), dtype="float32", shape=(2, 8))
    assert not old.exists() and mode(store.entry_path("k")) == 0o600
    assert _recycle.claim(store.free, str(store.tmp / "t"), 1) is None  # the pool is empty


def plant(root: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A namespace dir holding a valid entry `k`, then made another user's or world-writable
    (other-uid, without root: what lstat says of it and in it names another owner)."""
    planted = Store(root, NS).create()
    planted.publish("k", payload(2), dtype="float32", shape=(2, 8))
    if how == "other-uid":
        real = os.lstat

        def lstat(path: str | os.PathLike[str], *args: object, **kw: object) -> os.stat_result:
            st = real(path, *args, **kw)  # type: ignore[arg-type]
            if not os.fspath(path).startswith(str(planted.root)):
                return st
            fields = list(st)
            fields[stat.ST_UID] = OTHER
            return os.stat_result(fields)

        monkeypatch.setattr(os, "lstat", lstat)
    elif how == "other-owner":
        for dirpath, _, files in os.walk(planted.root):
            os.chown(dirpath, OTHER, OTHER)
            for name in files:
                os.chown(os.path.join(dirpath, name), OTHER, OTHER)
    else:
        os.chmod(planted.root, 0o777)
    return planted


HOWS = [pytest.param("other-owner", marks=pytest.mark.skipif(
    not IS_ROOT, reason="chown to another uid needs root")), "world-writable", "other-uid"]
ME = os.geteuid()


@pytest.mark.parametrize("how", HOWS)
def test_a_planted_entry_is_never_loaded(store_root: Path, how: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    planted = plant(store_root, how, monkeypatch)
    with pytest.raises(CacheError) as err:
        Store(store_root, NS).create()
    why = (f"it belongs to uid {OTHER}, not to you (uid {ME})" if how != "world-writable"
           else "group or others can write to it (mode 0777)")
    assert str(err.value).startswith(f"refusing the EC store `{planted.root}`: {why}")
    assert str(err.value).endswith("or set cache.dir to a directory of your own")
    # The connector's way: a store that is refused, not an error.
    store = Store(store_root, NS).open()
    assert store.refused == str(err.value)
    assert pin(store, "k") == pin(store, "anything")
    assert not isinstance(pin(store, "k"), Pin)
    assert store.has_entry("k") is False and store.touch("k") is False
    with pytest.raises(CacheError, match="refusing the EC store"):
        store.publish("k2", payload(2), dtype="float32", shape=(2, 8))
    assert os.listdir(planted.pins) == [] and os.listdir(planted.entries) == ["k.ec"]


@pytest.mark.parametrize("how", HOWS)
def test_janitor_and_cache_commands_refuse_a_planted_namespace(
        store_root: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = plant(store_root, how, monkeypatch)
    calls = [lambda: inspect(store_root), lambda: clean(store_root, all=True),
             lambda: enforce(planted.root, capacity_bytes=0, ttl_s=0, grace_s=0),
             lambda: keep_topology_store(planted.root, "ns", capacity_bytes=0, ttl_s=0,
                                         grace_s=0)]
    for call in calls:
        with pytest.raises(CacheError, match=rf"^refusing the EC store `{planted.root}`"):
            call()
    assert os.listdir(planted.entries) == ["k.ec"]  # nothing was removed either


@pytest.mark.parametrize("how", ["symlink", "world-writable", "other-owner", "other-uid"])
def test_a_root_that_is_not_the_users_alone_is_refused(
        store_root: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = store_root / "root"
    if how == "symlink":
        (store_root / "elsewhere").mkdir()
        root.symlink_to(store_root / "elsewhere")
        why = "it is a symbolic link"
    elif how == "world-writable":
        root.mkdir()
        os.chmod(root, 0o1777)
        why = "group or others can write to it (mode 1777)"
    elif how == "other-uid":  # the chown refusal without root: epdctl runs as another uid
        root.mkdir()
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: OTHER if me != OTHER else OTHER - 1)
        why = f"it belongs to uid {me}"
    else:
        if not IS_ROOT:
            pytest.skip("chown to another uid needs root")
        root.mkdir()
        os.chown(root, OTHER, OTHER)
        why = f"it belongs to uid {OTHER}"
    for call in (lambda: Store(root, NS).create(), lambda: check_capacity(root, 1),
                 lambda: inspect(root)):
        with pytest.raises(CacheError, match=f"^refusing the EC store `{root}`: {re.escape(why)}"):
            call()
    assert Store(root, NS).open().refused is not None
    assert not (store_root / "elsewhere" / NS).exists()  # nothing was created through it
