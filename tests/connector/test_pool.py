"""E stocks the store's pool within the planned capacity; PD maps it ahead and loads a fresh
entry through mappings it already has."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from epdctl.cache import _recycle  # noqa: E402
from epdctl.cache._maps import MAPPINGS  # noqa: E402
from tests.connector.driving import NS, SCHED, WORKER, feature, make, request, step  # noqa: E402
from tests.waits import WAIT_S, until_sync  # noqa: E402


def test_e_stocks_the_pool_and_pd_loads_a_fresh_entry_through_kept_mappings(
    store_root: Path,
) -> None:
    e = make(store_root, WORKER, "ec_producer", capacity_bytes=1 << 30)
    sched, pd = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    pd.start_worker_services()  # vLLM calls it once the model is resident
    first, second = torch.randn(64, 32), torch.randn(64, 32)
    e.save_caches({"img1": first}, "img1")
    stocker = e._store.stocker
    assert stocker is not None and stocker.settled(WAIT_S)
    free = store_root / NS / _recycle.FREE
    spare = [os.stat(path) for path, _ in _recycle.pool_files(free)]
    assert len(spare) == _recycle.FREE_MAX_FILES
    until_sync(lambda: all(MAPPINGS.is_mapped(st, write=False) for st in spare),
               "PD mapped E's spare files")
    e.save_caches({"img2": second}, "img2")
    entry = os.stat(store_root / NS / "entries" / "img2.ec")
    assert entry.st_ino in {st.st_ino for st in spare}
    assert MAPPINGS.is_mapped(entry, write=False)  # PD's load maps nothing new
    req = request("r1", feature("img2", 64))
    assert sched.ensure_cache_available(req, 0) is True
    sched.update_state_after_alloc(req, 0)
    cache: dict = {}
    step(sched, pd, cache)
    assert torch.equal(cache["img2"], second)


def test_without_a_capacity_e_stocks_nothing(store_root: Path) -> None:
    e = make(store_root, WORKER, "ec_producer")
    e.save_caches({"img1": torch.randn(64, 32)}, "img1")
    assert e._store.stocker is None
    assert _recycle.pool_files(store_root / NS / _recycle.FREE) == []
