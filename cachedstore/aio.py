"""asyncio reads: ``aget``/``amget`` past the hot path, without blocking the event loop.

etcd round trips run on a per-store thread pool of up to :data:`MAX_WORKERS` threads,
created as needed; blocking waits hold no thread (an
:class:`~cachedstore.waiters.AsyncWaiter` is woken through the loop). A call's timeout
covers the whole call, however many keys it waits for, and however long its round trips
wait for a free thread: one still queued at its read's deadline (but never sooner than
250 ms after it was queued) fails as if etcd had not answered in time, with
:class:`~cachedstore.EtcdConnectionError`, and the read ends as it would in an outage
(docs/guarantees.md point 4: a blocking read times out, its default answering if it has
one). A pause reads the store's clock. Once the store is closed every call raises
:class:`~cachedstore.StoreClosedError`, including calls in flight when it closed; a
coroutine cancelled by its own caller still sees ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .clock import Clock, SystemClock
from .errors import EtcdConnectionError, StoreClosedError
from .reads import ReadThrough, Timeout
from .steps import Call, Pause, Steps, resume
from .waiters import AsyncWaiter

__all__ = ["AsyncFront"]

T = TypeVar("T")

#: The most threads a store's asyncio reads run etcd round trips on at once. Waits hold
#: none; a thread is held by a round trip (up to ``request_timeout`` each in an outage,
#: when every blocked read retries etcd). The bound keeps a flood of concurrent misses from
#: opening as many connections to etcd.
MAX_WORKERS = 32

#: How often a pause on a clock other than the system's reads it (real seconds).
_CLOCK_POLL = 0.002


class AsyncFront:
    """The asyncio side of one store. Safe to use from any number of event loops."""

    def __init__(self, reads: ReadThrough, thread_name: str, clock: Clock) -> None:
        self._reads = reads
        self._clock = clock
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # -- the executor ---------------------------------------------------------------------------
    async def run(self, fn: Callable[..., Any], *args: Any, start_by: float | None = None
                  ) -> Any:
        """``fn(*args)`` on the store's thread pool; StoreClosedError once closed.
        ``start_by`` (the store's clock): EtcdConnectionError if no thread took the call
        by then (it is never started)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=MAX_WORKERS, thread_name_prefix=self._thread_name)
            future: Future[Any] = self._executor.submit(fn, *args)
        try:
            result = await self._answered(future, start_by)
        except asyncio.CancelledError:
            closed = future.cancelled() and self._closed  # by close(), not the caller
            future.cancel()  # a call still queued never starts (the shield kept it)
            if closed:
                raise StoreClosedError("the store was closed") from None
            raise
        if self._closed:  # a call in flight as the store closed
            raise StoreClosedError("the store was closed")
        return result

    async def _answered(self, future: Future[Any], start_by: float | None) -> Any:
        """``future``'s result: EtcdConnectionError if it is still queued at ``start_by``
        (the store's clock), and then it is never started."""
        answer = asyncio.wrap_future(future)
        if start_by is None:
            return await answer
        left = max(0.0, start_by - self._clock.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(answer), left)
        except asyncio.TimeoutError:
            if future.cancel():  # still queued: it never reached etcd
                raise EtcdConnectionError(
                    f"etcd was not asked in time: the store's {MAX_WORKERS} threads for "
                    f"asyncio reads were all busy until the read's deadline") from None
            return await answer  # started: bounded by its own round trip's deadline

    def refuse(self) -> None:
        """Refuse new work from now on, and fail the calls in flight as they end (the
        store's close() begins with it; :meth:`close` ends it)."""
        self._closed = True

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
                return await self.run(step.fn, *step.args, start_by=step.start_by), None
            if step.__class__ is Pause:
                return await self._pause(step.waiter, step.seconds), None
            return AsyncWaiter(asyncio.get_running_loop()), None
        except BaseException as exc:  # noqa: BLE001 -- thrown into the logic
            return None, exc

    async def _pause(self, waiter: AsyncWaiter, seconds: float) -> bytes | None:
        """Until the watch wakes ``waiter`` or ``seconds`` pass on the store's clock: the
        loop's timer on the system clock; another clock (a test's FakeClock, whose time
        moves when the test says) is read every :data:`_CLOCK_POLL` seconds, as FakeClock
        polls for threads."""
        future = waiter.future
        if self._clock.__class__ is SystemClock:
            try:
                value = await asyncio.wait_for(asyncio.shield(future), seconds)
            except asyncio.TimeoutError:
                value = None
        else:
            deadline = self._clock.monotonic() + seconds
            while not future.done() and self._clock.monotonic() < deadline:
                await asyncio.wait((future,), timeout=_CLOCK_POLL)
            value = future.result() if future.done() else None
        if future.done():
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
