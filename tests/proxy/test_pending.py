"""PendingMarks: a mark stays while any request relies on it, and an item several overlapped
requests share is encoded by one E."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from epdctl.cache.store import Store
from epdctl.proxy.stages.pending import PendingMarks

pytestmark = pytest.mark.anyio


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path, "ns-pending").create()


async def test_a_second_request_shares_the_running_e_and_the_mark(store: Store) -> None:
    marks, deadline = PendingMarks(store), time.time() + 60
    first = marks.claim(["x"], deadline)
    assert first.mine == ["x"] and first.held == ["x"] and not first.shared
    e = asyncio.get_running_loop().create_future()
    marks.fly(first.mine, e)
    second = marks.claim(["x", "y"], deadline + 5)
    assert second.mine == ["y"] and second.shared == {e}  # no second E for x
    assert marks.count("x") == 2 and store.pending_until("x") == pytest.approx(deadline)
    marks.release(first.held)  # the first request is done with it: the second is not
    assert store.pending_until("x") is not None
    marks.release(second.held)
    assert store.pending_until("x") is None and store.pending_until("y") is None
    assert marks.count("x") == marks.count("y") == 0


async def test_an_e_that_is_over_is_never_shared_and_a_later_owner_keeps_the_mark(
        store: Store) -> None:
    """The first E for x is over (it failed: no entry) while a request that shared it has
    not let go yet; a third request then sends x to E again, and its mark must outlive the
    second request's release."""
    marks = PendingMarks(store)
    first = marks.claim(["x"], time.time() + 60)
    e = asyncio.get_running_loop().create_future()
    marks.fly(first.mine, e)
    second = marks.claim(["x"], time.time() + 60)
    e.set_result(None)
    marks.release(first.held)
    later = time.time() + 120
    third = marks.claim(["x"], later)
    assert third.mine == ["x"] and not third.shared
    assert store.pending_until("x") == pytest.approx(later)  # its own deadline now
    marks.release(second.held)
    assert store.pending_until("x") == pytest.approx(later)  # the third relies on it
    marks.release(third.held)
    assert store.pending_until("x") is None


async def test_a_refused_store_holds_no_mark_and_e_still_encodes(tmp_path: Path) -> None:
    store = Store(tmp_path, "ns-pending")
    store.refused = "not ours"
    claim = PendingMarks(store).claim(["x"], time.time() + 60)
    assert claim.mine == ["x"] and claim.held == []
