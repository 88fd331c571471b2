"""``steps.py``: one read logic, two drivers (the thread's and asyncio's), no etcd."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from util import BusyPool

from cachedstore.aio import MAX_WORKERS, AsyncFront
from cachedstore.clock import SYSTEM_CLOCK, FakeClock
from cachedstore.errors import EtcdConnectionError
from cachedstore.steps import NEW_WAITER, Call, Pause, Steps, drive
from cachedstore.waiters import AsyncWaiter


def _logic(log: list[Any]) -> Steps[str]:
    """Calls, a failing call caught by the logic, a waiter, a pause; cleanup in finally."""
    try:
        first = yield Call(lambda a, b: a + b, (1, 2))
        log.append(("sum", first))
        try:
            yield Call(_unreachable, ())
        except EtcdConnectionError as exc:
            log.append(("caught", str(exc)))
        waiter = yield NEW_WAITER
        log.append(("waiter", type(waiter).__name__))
        woken = yield Pause(waiter, 0.01)
        log.append(("paused", woken))
        return "done"
    finally:
        log.append("finally")


def _unreachable() -> None:
    raise EtcdConnectionError("etcd unreachable")


def test_thread_driver_answers_each_step_and_throws_failures_into_the_logic() -> None:
    log: list[Any] = []
    assert drive(_logic(log), SYSTEM_CLOCK) == "done"
    assert log == [("sum", 3), ("caught", "etcd unreachable"), ("waiter", "ThreadWaiter"),
                   ("paused", None), "finally"]


def test_thread_driver_pause_returns_the_value_the_waiter_was_woken_with() -> None:
    clock = FakeClock()

    def logic() -> Steps[bytes | None]:
        waiter = yield NEW_WAITER
        threading.Timer(0.01, waiter.wake, (b"v",)).start()
        return (yield Pause(waiter, 3600.0))

    assert drive(logic(), clock) == b"v"  # woken, not timed out: the fake clock never moved


def test_asyncio_driver_runs_the_same_logic_on_the_pool() -> None:
    front = AsyncFront(reads=None, thread_name="test-steps",  # type: ignore[arg-type]
                       clock=SYSTEM_CLOCK)
    log: list[Any] = []
    try:
        assert asyncio.run(front.drive(_logic(log))) == "done"
    finally:
        front.close()
    assert log == [("sum", 3), ("caught", "etcd unreachable"), ("waiter", "AsyncWaiter"),
                   ("paused", None), "finally"]


def test_a_cancelled_coroutine_runs_the_logics_cleanup() -> None:
    """The caller's cancellation reaches the logic (its ``finally`` removes the waiter) and
    the coroutine still ends cancelled."""
    front = AsyncFront(reads=None, thread_name="test-steps",  # type: ignore[arg-type]
                       clock=SYSTEM_CLOCK)
    log: list[Any] = []

    def logic() -> Steps[None]:
        waiter = yield NEW_WAITER
        assert isinstance(waiter, AsyncWaiter)
        try:
            yield Pause(waiter, 3600.0)
        finally:
            log.append("removed")

    async def main() -> None:
        task = asyncio.ensure_future(front.drive(logic()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        front.close()
    assert log == ["removed"]


def test_a_driver_side_interrupt_runs_the_logics_cleanup() -> None:
    log: list[Any] = []

    def interrupted() -> None:
        raise KeyboardInterrupt

    def logic() -> Steps[None]:
        try:
            yield Call(interrupted, ())
        finally:
            log.append("finally")

    with pytest.raises(KeyboardInterrupt):
        drive(logic(), SYSTEM_CLOCK)
    assert log == ["finally"]


def test_a_call_still_queued_at_its_start_by_fails_as_unanswered_and_never_runs() -> None:
    """A read's timeout covers its round trips' wait for a thread: with every thread of
    the store's executor busy, a call queued past its ``start_by`` is answered with
    EtcdConnectionError (as etcd not answering in time) and is never run."""
    front = AsyncFront(reads=None, thread_name="test-steps",  # type: ignore[arg-type]
                       clock=SYSTEM_CLOCK)
    ran: list[str] = []

    def logic() -> Steps[str]:
        try:
            yield Call(ran.append, ("late",), SYSTEM_CLOCK.monotonic() + 0.2)
        except EtcdConnectionError as exc:
            return str(exc)
        return "answered"

    async def main() -> tuple[str, float]:
        async with BusyPool(front):
            started = SYSTEM_CLOCK.monotonic()
            answer = await asyncio.wait_for(front.drive(logic()), 10)
            return answer, SYSTEM_CLOCK.monotonic() - started

    try:
        answer, took = asyncio.run(main())
    finally:
        front.close()
    assert "were all busy until the read's deadline" in answer
    assert took < 5 and ran == []


def test_a_call_queued_when_its_coroutine_is_cancelled_never_runs() -> None:
    front = AsyncFront(reads=None, thread_name="test-steps",  # type: ignore[arg-type]
                       clock=SYSTEM_CLOCK)
    ran: list[str] = []

    async def main() -> None:
        async with BusyPool(front):
            for start_by in (None, SYSTEM_CLOCK.monotonic() + 60):
                task = asyncio.ensure_future(front.run(ran.append, "late", start_by=start_by))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        # Every thread meets at a barrier: a call still queued ahead of them (FIFO) would
        # have been run, to the end, before the last of them could start.
        barrier = threading.Barrier(MAX_WORKERS)
        await asyncio.gather(*(front.run(barrier.wait, 10) for _ in range(MAX_WORKERS)))

    try:
        asyncio.run(main())
    finally:
        front.close()
    assert ran == []
