"""deadlines.py: many deadlines on one loop timer, and `deadline()` held to what
asyncio.timeout promises (on asyncio's loop and on uvloop, the proxy's)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from epdctl.proxy.deadlines import GRAIN, Wheel, deadline, wheel

try:
    import uvloop
except ImportError:  # pragma: no cover - a dependency where it builds
    uvloop = None

LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio")]
if uvloop is not None:
    LOOPS.append(pytest.param(uvloop.new_event_loop, id="uvloop"))


@pytest.fixture(params=LOOPS)
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    def go(coro: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=request.param) as runner:
            return runner.run(coro)
    return go


def test_a_deadline_fires_once_never_early_and_at_most_a_grain_late(run) -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        done = asyncio.Event()
        when = loop.time() + 0.05

        def note() -> None:
            fired.append(loop.time() - when)
            done.set()
        wheel().at(when, note)
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(3 * GRAIN)  # and not again
        return fired

    fired = run(main())
    assert len(fired) == 1
    # The loop may run a callback a little late under load (as call_at); never early.
    assert -1e-3 <= fired[0] < GRAIN + 0.5


def test_cancelled_deadlines_never_fire_and_the_others_fire_in_order(run) -> None:
    async def main() -> tuple[list[int], list[float]]:
        loop = asyncio.get_running_loop()
        fired: list[int] = []
        now = loop.time()
        whens = [now + 0.01 * (n % 7) for n in range(50)]
        entries = [wheel().at(when, lambda n=n: fired.append(n)) for n, when in enumerate(whens)]
        for entry in entries[::2]:
            entry.cancel()
        entries[0].cancel()  # twice: no harm
        await asyncio.sleep(0.07 + 2 * GRAIN)
        return fired, whens

    fired, whens = run(main())
    assert sorted(fired) == list(range(1, 50, 2))
    # Buckets fire in order of their deadlines.
    buckets = [math.ceil(whens[n] / GRAIN) for n in fired]
    assert buckets == sorted(buckets)


def test_a_failing_callback_skips_no_other_and_reaches_the_exception_handler(run) -> None:
    async def main() -> tuple[list[str], list[dict]]:
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        fired: list[str] = []
        now = loop.time()

        def boom() -> None:
            raise ValueError("boom")
        wheel().at(now, boom)
        wheel().at(now, lambda: fired.append("after"))
        await asyncio.sleep(3 * GRAIN)
        return fired, reported

    fired, reported = run(main())
    assert fired == ["after"]
    assert isinstance(reported[0]["exception"], ValueError)


def test_each_loop_has_its_own_wheel() -> None:
    one, two = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert wheel(one) is wheel(one)
        assert wheel(one) is not wheel(two)
        assert isinstance(wheel(two), Wheel)
    finally:
        one.close()
        two.close()


def test_deadline_lets_a_block_that_ends_in_time_through(run) -> None:
    async def main() -> tuple[str, int]:
        with deadline(5) as bound:
            await asyncio.sleep(0)
        await asyncio.sleep(3 * GRAIN)  # nothing fires afterwards
        task = asyncio.current_task()
        assert task is not None
        assert not bound.expired()
        return "done", task.cancelling()

    assert run(main()) == ("done", 0)


def test_deadline_turns_an_overrun_into_timeout_error_and_cancels_the_block(run) -> None:
    async def main() -> tuple[bool, bool, int]:
        was_cancelled = False
        with pytest.raises(TimeoutError):
            with deadline(0.05) as bound:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    was_cancelled = True
                    raise
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # the task goes on: no cancel is left pending
        return was_cancelled, bound.expired(), task.cancelling()

    assert run(main()) == (True, True, 0)


def test_a_cancel_from_elsewhere_stays_a_cancel(run) -> None:
    async def main() -> None:
        entered = asyncio.Event()

        async def body() -> None:
            with deadline(30):
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.ensure_future(body())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_nested_deadlines_the_inner_one_fires_for_the_inner_block(run) -> None:
    async def main() -> tuple[str, bool]:
        with deadline(30) as outer:
            try:
                with deadline(0.05):
                    await asyncio.sleep(30)
            except TimeoutError:
                what = "inner"
            await asyncio.sleep(0)
        return what, outer.expired()

    assert run(main()) == ("inner", False)


def test_nested_deadlines_the_outer_one_passes_through_the_inner(run) -> None:
    async def main() -> str:
        try:
            with deadline(0.05):
                with deadline(30) as inner:
                    await asyncio.sleep(30)
        except TimeoutError:
            assert not inner.expired()
            return "outer"
        return "none"

    assert run(main()) == "outer"


def test_deadline_needs_a_task() -> None:
    with pytest.raises(RuntimeError):
        with deadline(1):
            pass
