"""``steps.py``: one read logic, two drivers (the thread's and asyncio's), no etcd."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cachedstore.aio import AsyncFront
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
    front = AsyncFront(reads=None, thread_name="test-steps")  # type: ignore[arg-type]
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
    front = AsyncFront(reads=None, thread_name="test-steps")  # type: ignore[arg-type]
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
