"""Regression tests for the coherence violations of the coherence-core issue, each against
a real etcd, each race forced deterministically: the watch thread held before it applies
a response (released one response at a time), or a hook between etcd's answer to a write
and the cache update. Each failed on the code before the coherence core."""

from __future__ import annotations

import asyncio
import math
import os
import queue
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
from util import eventually, raw_client

from cachedstore import (
    EtcdStore,
    InvalidTypeError,
    KeyNotFoundError,
    StoreClosedError,
    StoreForkedError,
    StoreTimeoutError,
)


def open_store(etcd, prefix, **kwargs) -> EtcdStore:
    return EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **kwargs)


@contextmanager
def stepped_watch(store: EtcdStore):
    """Hold the watch thread before every response it applies. ``step()`` lets exactly one
    response through and returns once it is applied (its revision)."""
    cache = store._cache
    original = cache.apply_events
    arrived: queue.Queue[int] = queue.Queue()
    release = threading.Semaphore(0)

    def gated(events, revision, scope=None):
        arrived.put(revision)
        release.acquire(timeout=30)
        original(events, revision, scope)

    def step() -> int:
        revision = arrived.get(timeout=10)
        release.release()
        eventually(lambda: cache.applied_revision >= revision, what="response applied")
        return revision

    cache.apply_events = gated
    try:
        yield step
    finally:
        cache.apply_events = original
        for _ in range(1000):
            release.release()


def evict(store: EtcdStore, name: str) -> None:
    """Push ``name`` out of a cache of size 2 with two read-throughs of absent keys."""
    for other in ("evict-1", "evict-2"):
        store.get(other, default=None)
    assert name not in store._cache._lru


# -- 1. eviction of an entry that is ahead of the watch ------------------------------------------
def test_evicted_local_write_is_not_replaced_by_an_older_event(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix, cache_size=2, preload_limit=0) as store, \
            stepped_watch(store) as step:
        older = raw.put(prefix + "k", "theirs").header.revision  # held in the watch
        store.set("k", "mine")  # newer, installed ahead of the watch
        evict(store, "k")
        assert step() == older  # the older event is applied now
        assert store.get("k") == b"mine"  # read-your-writes
        assert store._cache.n_marks == 1


def test_evicted_read_through_is_not_replaced_by_an_older_event(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix, cache_size=2, preload_limit=0) as store, \
            stepped_watch(store) as step:
        first = raw.put(prefix + "k", "v1").header.revision
        raw.put(prefix + "k", "v2")
        assert store.get("k") == b"v2"  # read through, ahead of the watch
        evict(store, "k")
        assert step() >= first
        assert store.get("k") == b"v2"  # monotonic reads


def test_evicted_local_delete_does_not_bring_the_older_put_back(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix, cache_size=2, preload_limit=0) as store, \
            stepped_watch(store) as step:
        raw.put(prefix + "k", "theirs")
        assert store.delete("k")
        evict(store, "k")
        step()
        assert store.get("k", default=None) is None


# -- 2. a local write recorded late -------------------------------------------------------------------
def test_late_write_after_a_newer_delete_and_an_eviction(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix, cache_size=2, preload_limit=0) as store:

        def meanwhile(names):  # between etcd's answer to our put and the cache update
            store._writes.after_write = None
            revision = raw.delete(prefix + "k", return_response=True).header.revision
            eventually(lambda: store.watch_revision >= revision, what="delete applied")
            evict(store, "k")

        store._writes.after_write = meanwhile
        store.set("k", "mine")
        assert store.get("k", default=None) is None  # etcd no longer holds "mine"
        assert raw.get(prefix + "k")[0] is None


def test_late_write_across_a_compaction_resync(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix, preload_limit=0) as store:
        store.set("k", "first")

        def meanwhile(names):
            store._writes.after_write = None
            revision = raw.put(prefix + "k", "newer").header.revision
            eventually(lambda: store.watch_revision >= revision, what="put applied")
            epoch = store._cache._epoch
            for i in range(2):  # writes the store does not watch move the revision on
                latest = raw.put(f"/outside-{prefix}{i}", "x").header.revision
            etcd.compact(latest)
            store._watcher._call.cancel()  # the resumed stream finds its revision compacted
            eventually(lambda: store._cache._epoch > epoch and store.watch_healthy,
                       what="resynced")

        store._writes.after_write = meanwhile
        store.set("k", "mine")
        assert store.get("k") == b"newer"


# -- 3. names that alias one etcd key ---------------------------------------------------------------------
def test_every_spelling_of_a_name_shares_one_entry(etcd, prefix):
    raw = raw_client(etcd)
    alias = "\udcc3\udca9"  # surrogate escapes of the UTF-8 bytes of "é"
    with open_store(etcd, prefix) as store:
        store.set("é", "v1")
        assert store.get(alias) == b"v1"
        assert store.get("é".encode()) == b"v1"
        revision = raw.put(prefix + "é", "v2").header.revision
        eventually(lambda: store.watch_revision >= revision, what="put applied")
        assert store.get(alias) == b"v2"
        assert len(store._cache) == 1


def test_blocking_get_of_an_alias_is_woken_by_the_watch(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        assert store._cache.complete
        timer = threading.Timer(0.2, lambda: raw.put(prefix + "é", "late"))
        timer.start()
        try:
            assert store.get("\udcc3\udca9", timeout=10) == b"late"
        finally:
            timer.cancel()


# -- 6/7/8. asyncio timeouts and close, unbounded timeouts ------------------------------------------
def test_amget_timeout_covers_the_whole_call(etcd, prefix):
    with open_store(etcd, prefix) as store:
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            asyncio.run(store.amget(["a", "b", "c", "d"], timeout=0.5))
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, f"4 keys with timeout=0.5 took {elapsed:.2f} s"


def test_close_with_agets_in_flight_raises_store_closed(etcd, prefix):
    with open_store(etcd, prefix, preload_limit=0) as store:
        entered = threading.Event()
        release = threading.Event()

        def hold(names):  # keep one read-through in flight on the executor
            entered.set()
            release.wait(10)

        async def scenario():
            store._reads.after_read = hold
            blocked = [asyncio.ensure_future(store.aget(f"w{i}", timeout=30)) for i in range(5)]
            fetching = asyncio.ensure_future(store.aget("miss"))
            queued = [asyncio.ensure_future(store.aget(f"q{i}")) for i in range(8)]
            await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
            closer = asyncio.get_running_loop().run_in_executor(None, store.close)
            await asyncio.sleep(0.1)
            release.set()
            await closer
            return await asyncio.gather(*blocked, fetching, *queued, return_exceptions=True)

        results = asyncio.run(scenario())
        assert results and all(isinstance(r, StoreClosedError) for r in results), results
        with pytest.raises(StoreClosedError):
            asyncio.run(store.amget(["x", "y"]))
        with pytest.raises(StoreClosedError):
            asyncio.run(store.aget("x"))
        assert store._aio._executor is None  # nothing created after close


@pytest.mark.parametrize("timeout", [math.inf, 1e300, timedelta.max],
                         ids=["inf", "1e300", "timedelta.max"])
def test_unbounded_timeouts_wait_without_overflow(etcd, prefix, timeout):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        timer = threading.Timer(0.2, lambda: raw.put(prefix + "k", "v"))
        timer.start()
        try:
            assert store.get("k", timeout=timeout) == b"v"
            store.wait(["k"], timeout=timeout)
            assert store.mget(["k"], timeout=timeout) == [b"v"]
            assert asyncio.run(store.aget("k", timeout=timeout)) == b"v"
        finally:
            timer.cancel()


# -- 9. close while the watch resyncs against an unresponsive etcd ------------------------------------------
def test_close_during_a_resync_against_a_frozen_etcd(etcd_factory, prefix):
    server = etcd_factory()
    store = open_store(server, prefix, request_timeout=30)
    try:
        store.set("k", "v")
        watcher = store._watcher
        in_resync = threading.Event()
        original = watcher._resync

        def resync():
            in_resync.set()
            original()

        watcher._resync = resync
        watcher._needs_resync = True
        server.pause()  # SIGSTOP: connections stay open, nothing answers
        watcher._call.cancel()
        assert in_resync.wait(10)
        started = time.monotonic()
        store.close()
        took = time.monotonic() - started
        assert not watcher._thread.is_alive()
        assert took < 5, f"close() took {took:.1f} s"
    finally:
        server.resume()
        store.close()


# -- 10. fork ---------------------------------------------------------------------------------------
def test_a_forked_child_never_serves_what_it_inherited(etcd, prefix):
    with open_store(etcd, prefix) as store:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what happened, then leave without cleanup
            try:
                os.close(read_end)
                outcome = []
                for call in (lambda: store.get("k"), lambda: store.get("k", timeout=1),
                             lambda: store.set("k", "x"), lambda: store.mget(["k"])):
                    try:
                        call()
                        outcome.append("served")
                    except StoreForkedError:
                        outcome.append("refused")
                outcome.append("healthy" if store.watch_healthy else "down")
                store.close()
                os.write(write_end, ",".join(outcome).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            report = pipe.read()
        os.waitpid(pid, 0)
        assert report == "refused,refused,refused,refused,down"
        store.set("k", "v2")  # the parent is unaffected
        assert store.get("k") == b"v2"


# -- 11. a string where a list of names is expected -------------------------------------------------
def test_a_lone_string_is_not_a_list_of_names(etcd, prefix):
    with open_store(etcd, prefix) as store:
        for call in (lambda: store.mget("key"), lambda: store.wait("key", timeout=1),
                     lambda: store.check("key"), lambda: store.mget(b"key"),
                     lambda: asyncio.run(store.amget("key"))):
            with pytest.raises(InvalidTypeError, match="list of names"):
                call()
        with pytest.raises(TypeError):
            EtcdStore(endpoints=etcd.endpoint)
        with pytest.raises(TypeError, match="endpoints="):
            EtcdStore([etcd.endpoint])  # a list where the host goes
        with pytest.raises(KeyNotFoundError):
            store.mget(["key"])  # a list still works
