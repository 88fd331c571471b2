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
from typing import Any

from . import counters
from .cache import CoherentCache
from .clock import Clock
from .config import seconds
from .errors import EtcdConnectionError, StoreClosedError, StoreTimeoutError
from .keys import KeySpace
from .metrics import NullMetrics, StoreMetrics
from .reads import MISSING, ReadThrough, Timeout, absent
from .waiters import AsyncWaiter

__all__ = ["AsyncFront"]


class AsyncFront:
    """The asyncio side of one store. Safe to use from any number of event loops."""

    def __init__(self, reads: ReadThrough, keys: KeySpace, cache: CoherentCache,
                 metrics: StoreMetrics | NullMetrics, clock: Clock,
                 check_open: Callable[[], None], thread_name: str) -> None:
        self._reads = reads
        self._keys = keys
        self._cache = cache
        self._metrics = metrics
        self._clock = clock
        self._check_open = check_open
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
    async def get(self, op: str, name: Any, default: Any, timeout: Timeout,
                  deadline: float | None = None, consistent: bool = False) -> Any:
        """``aget`` past the hot path, and every consistent ``aget``. ``deadline`` (a clock
        time) overrides ``timeout``'s own, so that several keys can share one."""
        canonical = self._keys.canonical(name)
        wait = seconds(timeout)
        self._check_open()
        reads = self._reads
        if deadline is None:
            deadline = reads.deadline(wait)
        if consistent:  # etcd's revision and the watch's catch-up: on the pool
            entry = await self.run(reads.consistent_entry, canonical, deadline)
        else:
            entry = reads.cached(canonical, blocking=wait is not None)
        (self._metrics.hit if entry is not None else self._metrics.miss)[op].inc()
        if entry is not None:
            value = entry[0]
        elif deadline is None or consistent:  # consistent: etcd before any wait
            value = (await self.run(reads.fetch, [canonical], deadline)).get(canonical)
        else:
            value = None
        while True:
            if value is None and deadline is not None:
                try:
                    value = await self._await_for(canonical, deadline, timeout)
                except StoreTimeoutError:
                    if default is MISSING:
                        raise
            if not counters.is_mark(value):
                break
            value = await self.run(reads.decimal, canonical, value)
            if value is not None or deadline is None:
                break
            # The counter was deleted meanwhile: a blocking read waits for it again, as
            # the blocking ``get`` does (``ReadThrough.get``).
        if value is not None:
            return value
        return absent(name, default)

    async def mget(self, op: str, names: list[Any], default: Any, timeout: Timeout,
                   consistent: bool = False) -> Any:
        """``amget`` past the hot path: one deadline for the whole call."""
        wait = seconds(timeout)
        self._check_open()
        deadline = self._reads.deadline(wait)
        canonical = [self._keys.canonical(n) for n in names]
        unique = dict.fromkeys(canonical)  # ordered: the same requests in every process
        values, hits = await self.run(self._reads.resolve, unique, wait is not None, deadline,
                                      consistent)
        self._metrics.hit[op].inc(hits)
        self._metrics.miss[op].inc(len(unique) - hits)
        for key in dict.fromkeys(canonical):  # in order: the first absent key times out
            if values.get(key) is None and deadline is not None:
                try:
                    values[key] = await self._await_for(key, deadline, timeout)
                except StoreTimeoutError:
                    if default is MISSING:
                        raise
        while any(counters.is_mark(v) for v in values.values()):
            marked = [key for key, v in values.items() if counters.is_mark(v)]
            await self.run(self._reads.decimals, values)
            if deadline is None:
                break
            for key in marked:  # deleted meanwhile: wait for it again, as ``mget`` does
                if values.get(key) is None:
                    try:
                        values[key] = await self._await_for(key, deadline, timeout)
                    except StoreTimeoutError:
                        if default is MISSING:
                            raise
        out = []
        for name, key in zip(names, canonical, strict=True):
            value = values.get(key)
            out.append(value if value is not None else absent(name, default))
        return out

    async def _await_for(self, name: str, deadline: float, timeout: Timeout) -> bytes:
        waiter = AsyncWaiter(asyncio.get_running_loop())
        cache = self._cache
        cache.add_waiter(name, waiter)
        outage: EtcdConnectionError | None = None
        try:
            while True:
                self._check_open()
                entry = cache.lookup_or_absent(name)
                value = None
                if entry is not None:
                    value = entry[0]
                elif deadline - self._clock.monotonic() > 0 or outage is None:
                    try:
                        value = (await self.run(self._reads.fetch, [name], deadline)).get(name)
                        outage = None
                    except EtcdConnectionError as exc:
                        outage = exc
                if value is not None:
                    return value
                pause = self._reads.pause(name, deadline, timeout, outage)
                try:
                    value = await asyncio.wait_for(asyncio.shield(waiter.future), pause)
                except asyncio.TimeoutError:
                    value = None
                if waiter.future.done():
                    waiter.renew()
                if value is not None:
                    return value
        finally:
            cache.remove_waiter(name, waiter)
