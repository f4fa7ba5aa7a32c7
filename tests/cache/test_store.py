"""Publish, pin, validate and read entries of one namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epdctl.cache._format import PAGE_BYTES, decode_header, key_filename
from epdctl.cache.capacity import check_capacity
from epdctl.cache.store import Miss, Pin, Store, read_into, unpin
from epdctl.errors import CacheError
from tests.cache.conftest import payload


def pin(store: Store, key: str, **kw) -> Pin | Miss:
    return store.pin(key, engine="pd-0", request="req-1", index=0, **kw)


def load(p: Pin) -> bytes:
    out = bytearray(p.header.nbytes)
    read_into(p.paths[0], p.header, out)
    return bytes(out)


def test_publish_pin_load_round_trip(store: Store) -> None:
    data = payload(4)
    assert store.publish("abc123", data, dtype="float32", shape=(4, 8)) == len(data)
    p = pin(store, "abc123", rows=4, dtype="float32")
    assert isinstance(p, Pin)
    assert (p.header.key, p.header.namespace, p.header.shape) == ("abc123", "ns-test", (4, 8))
    assert p.header.data_offset % PAGE_BYTES == 0
    assert load(p) == data
    assert os.stat(store.entry_path("abc123")).st_nlink == 2
    unpin(p.paths)
    assert os.stat(store.entry_path("abc123")).st_nlink == 1
    assert os.listdir(store.pins) == [] and os.listdir(store.tmp) == []


def test_keys_that_are_not_file_names_are_hashed_and_kept_in_the_header(store: Store) -> None:
    odd = ["lora:abc", "a/b", "x" * 300, "~abc", "..", "ünï"]
    for i, key in enumerate(odd):
        store.publish(key, payload(1, seed=i), dtype="float32", shape=(1, 8))
    names = os.listdir(store.entries)
    assert len(set(names)) == len(odd)
    assert all(n.startswith("~") and len(n) < 64 for n in names)
    for i, key in enumerate(odd):
        p = pin(store, key, rows=1)
        assert isinstance(p, Pin) and p.header.key == key and load(p) == payload(1, seed=i)
    assert key_filename("plain-KEY_09") == "plain-KEY_09"
    assert key_filename("a" * 100) == "a" * 100  # the longest plain name
    assert key_filename("a" * 101).startswith("~") and key_filename("a:b").startswith("~")


def test_every_rank_gets_its_own_pin(store: Store) -> None:
    store.publish("k", payload(2), dtype="float32", shape=(2, 8))
    p = pin(store, "k", rows=2, ranks=3)
    assert isinstance(p, Pin) and len(set(p.paths)) == 3
    assert [os.path.basename(x).split(".")[:5] for x in p.paths] == [
        ["k", "pd-0", "req-1", "0", str(r)] for r in range(3)
    ]
    assert os.stat(store.entry_path("k")).st_nlink == 4
    unpin(p.paths)
    assert os.stat(store.entry_path("k")).st_nlink == 1


def test_a_pinned_load_survives_eviction_and_replacement(store: Store) -> None:
    store.publish("k", payload(3, seed=1), dtype="float32", shape=(3, 8))
    p = pin(store, "k", rows=3)
    assert isinstance(p, Pin)
    os.unlink(store.entry_path("k"))  # the janitor (or `cache clean`) evicts it
    assert load(p) == payload(3, seed=1)
    store.publish("k", payload(3, seed=2), dtype="float32", shape=(3, 8))  # E re-saves
    assert load(p) == payload(3, seed=1)
    unpin(p.paths)
    fresh = pin(store, "k", rows=3)
    assert isinstance(fresh, Pin) and load(fresh) == payload(3, seed=2)


def test_missing_entry_is_a_miss(store: Store) -> None:
    result = pin(store, "nope")
    assert isinstance(result, Miss) and result.is_missing


def _publish_raw(store: Store, key: str, mutate) -> None:
    store.publish(key, payload(4), dtype="float32", shape=(4, 8))
    path = store.entry_path(key)
    data = bytearray(Path(path).read_bytes())
    Path(path).write_bytes(mutate(data))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: d[: len(d) - 4], "size"),
        (lambda d: d[:100], "corrupt"),
        (lambda d: d + b"\0" * 4, "size"),
        (lambda d: b"XXXXXXXX" + d[8:], "corrupt: bad magic"),
        (lambda d: d[:16] + b"{garbage" + d[24:], "corrupt"),
        (lambda d: d[:8] + (99).to_bytes(4, "little") + d[12:], "corrupt: format version 99"),
        (lambda d: b"", "corrupt"),
    ],
)
def test_damaged_entries_are_misses_not_errors(store: Store, mutate, reason: str) -> None:
    _publish_raw(store, "k", mutate)
    result = pin(store, "k", rows=4, dtype="float32")
    assert isinstance(result, Miss) and result.reason.startswith(reason), result
    assert os.listdir(store.pins) == []  # the failed pin was dropped


def test_wrong_namespace_dtype_or_rows_is_a_miss(store_root: Path, store: Store) -> None:
    other = Store(store_root, "ns-other").create()
    other.publish("k", payload(4), dtype="float32", shape=(4, 8))
    os.link(other.entry_path("k"), store.entry_path("k"))  # a foreign file in our dir
    assert pin(store, "k").reason == "namespace 'ns-other'"  # type: ignore[union-attr]
    store.publish("k", payload(4), dtype="float32", shape=(4, 8))
    assert pin(store, "k", dtype="bfloat16").reason == "dtype float32, expected bfloat16"  # type: ignore[union-attr]
    assert pin(store, "k", rows=5).reason == "shape [4, 8], expected 5 rows"  # type: ignore[union-attr]
    assert isinstance(pin(store, "k", rows=4, dtype="float32"), Pin)


def test_publish_checks_the_size_and_cleans_up_after_a_failed_write(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError):
        store.publish("k", payload(3), dtype="float32", shape=(4, 8))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    # The pages of a new entry are allocated before it is mapped: a full tmpfs is
    # ENOSPC there, never a SIGBUS during the copy.
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        store.publish("k", payload(4), dtype="float32", shape=(4, 8))
    assert os.listdir(store.tmp) == [] and not store.has_entry("k")


def test_header_decodes_what_it_encodes(store: Store) -> None:
    store.publish("k", b"\0" * 24, dtype="bfloat16", shape=(3, 4))
    header = decode_header(Path(store.entry_path("k")).read_bytes()[:PAGE_BYTES])
    assert (header.dtype, header.shape, header.nbytes) == ("bfloat16", (3, 4), 24)


def test_pin_recreates_dirs_removed_by_clean(store: Store) -> None:
    store.publish("k", payload(1), dtype="float32", shape=(1, 8))
    os.rmdir(store.pins)
    assert isinstance(pin(store, "k", rows=1), Pin)


def test_check_capacity(store_root: Path) -> None:
    check_capacity(store_root / "sub", 1 << 20)
    assert (store_root / "sub").is_dir() and os.listdir(store_root / "sub") == []
    with pytest.raises(
        CacheError, match=r"has .* available .* but the cache capacity is 1024.0 TiB"
    ):
        check_capacity(store_root, 1 << 50)
    (store_root / "file").write_bytes(b"")
    with pytest.raises(CacheError, match="is not writable"):
        check_capacity(store_root / "file" / "sub", 1)
