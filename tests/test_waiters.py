"""``cachedstore.waiters``: a wake-up is never lost between a look and a wait."""

from __future__ import annotations

import asyncio

from cachedstore.waiters import AsyncWaiter, ThreadWaiter


def test_a_thread_waiter_keeps_a_wake_that_came_before_its_wait() -> None:
    waiter = ThreadWaiter()
    waiter.wake(b"v")  # between the owner's look at the cache and its wait
    assert waiter.event.wait(0) is True
    assert waiter.take() == b"v"
    assert not waiter.event.is_set() and waiter.take() is None
    waiter.nudge()  # look again, nothing handed over
    assert waiter.event.is_set() and waiter.take() is None


def test_an_async_waiter_is_woken_through_its_loop_from_another_thread() -> None:
    async def main() -> tuple[bytes | None, bytes | None]:
        waiter = AsyncWaiter(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, waiter.wake, b"v")
        first = await asyncio.wait_for(waiter.future, 5)
        waiter.renew()
        waiter.nudge()
        return first, await asyncio.wait_for(waiter.future, 5)

    assert asyncio.run(main()) == (b"v", None)


def test_waking_an_async_waiter_whose_loop_closed_is_harmless() -> None:
    loop = asyncio.new_event_loop()
    waiter = AsyncWaiter(loop)
    loop.close()
    waiter.wake(b"late")  # nobody waits any more: no exception
