"""asyncio reads: ``aget``/``amget`` past the hot path, without blocking the event loop.

etcd round trips run on a small per-store thread pool, created on first use; blocking
waits hold no thread (an :class:`~cachedstore.waiters.AsyncWaiter` is woken through the
loop). A call's timeout covers the whole call, however many keys it waits for. Once the
store is closed every call raises :class:`~cachedstore.StoreClosedError`, including calls
in flight when it closed; a coroutine cancelled by its own caller still sees
``CancelledError``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .errors import StoreClosedError
from .reads import ReadThrough, Timeout
from .steps import Call, Pause, Steps, resume
from .waiters import AsyncWaiter

__all__ = ["AsyncFront"]

T = TypeVar("T")


class AsyncFront:
    """The asyncio side of one store. Safe to use from any number of event loops."""

    def __init__(self, reads: ReadThrough, thread_name: str) -> None:
        self._reads = reads
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # -- the executor ---------------------------------------------------------------------------
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the store's thread pool; StoreClosedError once closed."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=4, thread_name_prefix=self._thread_name)
            future: Future[Any] = self._executor.submit(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled() and self._closed:  # cancelled by close(), not the caller
                raise StoreClosedError("the store was closed") from None
            raise

    def close(self) -> None:
        """Refuse new work, cancel what has not started, wait for what has (it fails fast:
        the connection is closed first). Idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def abandon(self) -> None:
        """After a fork: forget the pool without touching its (absent) threads."""
        with self._lock:
            self._closed = True
            self._executor = None

    # -- reads ------------------------------------------------------------------------------------
    async def drive(self, steps: Steps[T]) -> T:
        """Run a read's logic (``steps.py``) on the event loop: each etcd round trip on the
        pool, each pause on an :class:`AsyncWaiter` (no thread held). The coroutine's own
        cancellation is thrown into the logic, so that its waiter is removed."""
        done, step = resume(steps, None, None)
        while not done:
            done, step = resume(steps, *(await self._answer(step)))
        return step

    async def _answer(self, step: Any) -> tuple[Any, BaseException | None]:
        """(the step's answer, None), or (None, what it raised: the caller's cancellation
        too) to throw into the logic."""
        try:
            if step.__class__ is Call:
                return await self.run(step.fn, *step.args), None
            if step.__class__ is Pause:
                return await self._pause(step.waiter, step.seconds), None
            return AsyncWaiter(asyncio.get_running_loop()), None
        except BaseException as exc:  # noqa: BLE001 -- thrown into the logic
            return None, exc

    @staticmethod
    async def _pause(waiter: AsyncWaiter, seconds: float) -> bytes | None:
        try:
            value = await asyncio.wait_for(asyncio.shield(waiter.future), seconds)
        except asyncio.TimeoutError:
            value = None
        if waiter.future.done():
            waiter.renew()
        return value

    async def get(self, op: str, name: Any, default: Any, timeout: Timeout,
                  consistent: bool = False) -> Any:
        """``aget`` past the hot path, and every consistent ``aget``: the logic of the
        blocking ``get`` (``ReadThrough.get_steps``)."""
        return await self.drive(self._reads.get_steps(op, name, default, timeout, consistent))

    async def mget(self, op: str, names: list[Any], default: Any, timeout: Timeout,
                   consistent: bool = False) -> list[Any]:
        """``amget`` past the hot path: the logic of ``mget``, every name pending."""
        return await self.drive(self._reads.mget_steps(
            op, names, default, timeout, [None] * len(names), list(range(len(names))),
            consistent))
