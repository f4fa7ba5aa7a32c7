"""A store directory the connector refuses (another user's, or world-writable): the engine
keeps serving, every item is a miss (encoded locally), E saves nothing, one log line."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from epdctl.cache.store import Store  # noqa: E402
from tests.connector.driving import (  # noqa: E402
    NS,
    SCHED,
    WORKER,
    feature,
    make,
    produce,
    request,
    step,
)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """WARNING and up from the connector's loggers (vLLM's tree does not propagate)."""
    handler = Records()
    loggers = [logging.getLogger(f"vllm.epdctl.connector.{m}") for m in ("ec", "_scheduler")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.lines
    for logger in loggers:
        logger.removeHandler(handler)


def test_a_refused_store_is_never_read_or_written(store_root: Path,
                                                   warnings: list[str]) -> None:
    planted = torch.randn(4, 8)
    produce(store_root, "k", planted)  # a valid entry, as a planter would write it
    ns_dir = store_root / NS
    os.chmod(ns_dir, 0o777)  # anyone could have put it there
    warnings.clear()
    sched, worker = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    req = request("r1", feature("k", 4))
    for _ in range(3):
        assert sched.ensure_cache_available(req, 0) is True  # encoded locally
        assert sched.has_cache_item("k") is False
    sched.update_state_after_alloc(req, 0)
    cache: dict = {}
    step(sched, worker, cache)
    assert cache == {} and os.listdir(ns_dir / "pins") == []

    e_sched, e_worker = make(store_root, SCHED, "ec_producer"), make(store_root, WORKER,
                                                                      "ec_producer")
    new = request("r2", feature("k", 4), feature("k2", 4))
    assert e_sched.ensure_cache_available(new, 0) is True
    step(e_sched, e_worker, {"k": planted})  # nothing is republished into it
    e_worker.save_caches({"k2": torch.zeros(4, 8)}, "k2")
    _, items = e_sched.request_finished(new)
    assert items is not None and items["k"]["metadata"] == items["k2"]["metadata"] == {}
    assert os.listdir(ns_dir / "entries") == ["k.ec"] and os.listdir(ns_dir / "tmp") == []
    sched.request_finished(req)
    for conn in (sched, worker, e_sched, e_worker):
        conn.shutdown()
        assert conn._stats is None  # no stats file is written into it either
    # One line per connector, naming the directory and the fix; nothing per item.
    assert len(warnings) == 4, warnings
    assert all(line.startswith(f"EC store: refusing the EC store `{ns_dir}`: group or others "
                               "can write to it (mode 0777)") for line in warnings)
    assert all("every item is encoded locally and nothing is saved" in w for w in warnings)
    assert Store(store_root, NS).open().refused is not None
