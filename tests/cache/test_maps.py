"""Kept mappings of store files: found again by inode, dropped once the file is gone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epdctl.cache._maps import Mappings


def make(path: Path, data: bytes) -> int:
    path.write_bytes(data)
    return os.open(path, os.O_RDWR)


def test_a_file_is_mapped_once_and_found_again_through_any_name(tmp_path: Path) -> None:
    maps = Mappings(sweep_s=3600)
    fd = make(tmp_path / "a", b"x" * 8192)
    with maps.view(fd, 8192, write=True) as v:
        v[:5] = b"hello"
    os.link(tmp_path / "a", tmp_path / "pin")  # a pin: another name of the same inode
    other = os.open(tmp_path / "pin", os.O_RDONLY)
    with maps.view(other, 5, write=False) as v:
        assert bytes(v) == b"hello"
    with maps.view(other, 8192, write=False):
        pass
    assert len(maps) == 2  # one writable and one read-only mapping, reused
    for f in (fd, other):
        os.close(f)
    maps.clear()


def test_a_view_never_goes_past_the_end_of_the_file(tmp_path: Path) -> None:
    maps = Mappings(sweep_s=3600)
    fd = make(tmp_path / "a", b"x" * 4096)
    with pytest.raises(OSError, match="holds 4096 bytes"):
        maps.view(fd, 4097, write=False)
    os.ftruncate(fd, 100)  # cut shorter after it was mapped
    with pytest.raises(OSError, match="holds 100 bytes"):
        maps.view(fd, 4096, write=False)
    empty = make(tmp_path / "empty", b"")
    with pytest.raises(OSError):
        maps.view(empty, 0, write=False)  # nothing to map
    for f in (fd, empty):
        os.close(f)
    maps.clear()


def test_sweep_drops_the_mappings_of_files_no_longer_named(tmp_path: Path) -> None:
    maps = Mappings(sweep_s=3600)
    fds = [make(tmp_path / name, b"x" * 4096) for name in ("kept", "gone")]
    for fd in fds:
        maps.view(fd, 4096, write=False).release()
        os.close(fd)
    (tmp_path / "gone").unlink()
    assert maps.sweep() == 1 and len(maps) == 1
    (tmp_path / "kept").unlink()
    assert maps.sweep() == 1 and len(maps) == 0


def test_a_mapping_in_use_is_not_dropped(tmp_path: Path) -> None:
    maps = Mappings(sweep_s=3600)
    fd = make(tmp_path / "a", b"x" * 4096)
    view = maps.view(fd, 4096, write=False)
    os.close(fd)
    (tmp_path / "a").unlink()
    assert maps.sweep() == 0 and bytes(view[:1]) == b"x"  # still readable
    view.release()
    assert maps.sweep() == 1


def test_the_oldest_mappings_go_past_the_limit(tmp_path: Path) -> None:
    maps = Mappings(max_maps=2, sweep_s=3600)
    for name in "abc":
        fd = make(tmp_path / name, b"x" * 4096)
        maps.view(fd, 4096, write=False).release()
        os.close(fd)
    assert len(maps) == 2
    maps.clear()
    assert len(maps) == 0


def test_the_sweeper_thread_frees_an_idle_process_s_memory(tmp_path: Path) -> None:
    import time

    maps = Mappings(sweep_s=0.05)
    fd = make(tmp_path / "a", b"x" * 4096)
    maps.view(fd, 4096, write=False).release()
    os.close(fd)
    (tmp_path / "a").unlink()
    deadline = time.monotonic() + 5
    while len(maps) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(maps) == 0


def test_a_forked_child_maps_and_sweeps_on_its_own(tmp_path: Path) -> None:
    from epdctl.cache._maps import MAPPINGS

    fd = make(tmp_path / "a", b"abc" + b"x" * 4093)
    MAPPINGS.view(fd, 3, write=False).release()
    with MAPPINGS._lock:  # the parent's sweeper could hold it at the fork
        pid = os.fork()
        if pid == 0:  # the child: a lock held in the parent must not block it
            try:
                with MAPPINGS.view(fd, 3, write=False) as v:
                    ok = bytes(v) == b"abc"
                os._exit(0 if ok and MAPPINGS._sweeper_pid == os.getpid() else 1)
            except BaseException:
                os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.close(fd)


def test_a_file_grown_past_its_mapping_is_mapped_again(tmp_path: Path) -> None:
    maps = Mappings(sweep_s=3600)
    fd = make(tmp_path / "a", b"a" * 4096)
    old = maps.view(fd, 4096, write=False)  # still in use while the file grows
    os.ftruncate(fd, 8192)
    with maps.view(fd, 8192, write=False) as v:
        assert bytes(v[:1]) == b"a" and v.nbytes == 8192
    assert bytes(old[:1]) == b"a" and len(maps) == 1
    old.release()
    os.close(fd)
    maps.clear()
