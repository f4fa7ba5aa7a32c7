"""Connector tests need vLLM; they build connectors from stand-in configs, no servers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def store_root() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="epdctl-test-", dir=base))
    yield root
    # Connectors flush stats from a thread; shut them down before removing their store.
    from tests.connector.driving import shutdown_all

    shutdown_all()
    shutil.rmtree(root, ignore_errors=True)

