"""A fresh store root under /dev/shm per test, removed afterwards."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdctl.cache.store import Store


@pytest.fixture
def store_root() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="epdctl-test-", dir=base))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(store_root: Path) -> Store:
    return Store(store_root, "ns-test").create()


def payload(rows: int, cols: int = 8, seed: int = 0) -> bytes:
    """float32 rows x cols bytes that differ per seed."""
    import struct

    return struct.pack(f"<{rows * cols}f", *(float(seed * 1000 + i) for i in range(rows * cols)))


def age(path: str | Path, seconds: float, now: float) -> None:
    """Set a file's last use `seconds` before `now`."""
    os.utime(path, (now - seconds, now - seconds))
