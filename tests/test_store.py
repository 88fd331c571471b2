"""EtcdStore's API contract, against a real etcd."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest
from util import BusyPool, eventually, raw_client, rpc_count, sample

import cachedstore
from cachedstore import (
    EtcdConnectionError,
    EtcdStore,
    InvalidInputError,
    InvalidTypeError,
    KeyNotFoundError,
    NotAnIntegerError,
    StoreClosedError,
    StoreTimeoutError,
)
from cachedstore.server import free_port


@pytest.fixture
def store(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as s:
        yield s


def test_set_get_roundtrip_and_raw_key(store, etcd, prefix):
    store.set("addr", "10.0.0.1:29500")
    assert store.get("addr") == b"10.0.0.1:29500"
    store.set(b"bin\xff", b"\x00\x01")
    assert store.get(b"bin\xff") == b"\x00\x01"
    # The etcd key is prefix + name: other etcd clients see exactly that.
    value, _ = raw_client(etcd).get(prefix + "addr")
    assert value == b"10.0.0.1:29500"


def test_empty_prefix_maps_names_one_to_one(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint]) as store:
        store.set(prefix + "plain", "v")
        assert raw_client(etcd).get(prefix + "plain")[0] == b"v"
        assert store.get(prefix + "plain") == b"v"


def test_str_and_bytes_names_are_the_same_key(store):
    store.set("é", "1")
    assert store.get("é".encode()) == b"1"
    store.set("é".encode(), "2")
    assert store.get("é") == b"2"


def test_get_absent(store):
    with pytest.raises(KeyNotFoundError) as info:
        store.get("nope")
    assert isinstance(info.value, KeyError)
    assert "nope" in str(info.value)
    sentinel = object()
    assert store.get("nope", default=sentinel) is sentinel
    assert store.get("nope", None) is None


def test_get_timeout_blocks_until_created(store, etcd, prefix):
    threading.Timer(0.2, lambda: raw_client(etcd).put(prefix + "late", "here")).start()
    assert store.get("late", timeout=10) == b"here"


def test_get_timeout_expires(store):
    with pytest.raises(StoreTimeoutError) as info:
        store.get("never", timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    assert store.get("never", default=b"d", timeout=timedelta(milliseconds=100)) == b"d"


def test_mget_order_defaults_and_errors(store):
    store.set("a", "1")
    store.set("c", "3")
    assert store.mget(["a", "b", "c"], default=None) == [b"1", None, b"3"]
    with pytest.raises(KeyNotFoundError):
        store.mget(["a", "b"])
    assert store.mget([]) == []


def test_mget_blocks_for_absent_keys(store, etcd, prefix):
    store.set("x", "1")
    threading.Timer(0.2, lambda: raw_client(etcd).put(prefix + "y", "2")).start()
    assert store.mget(["x", "y"], timeout=10) == [b"1", b"2"]
    with pytest.raises(StoreTimeoutError):
        store.mget(["x", "z"], timeout=0.2)


def test_cold_mget_batches_into_txns(etcd, prefix):
    raw = raw_client(etcd)
    names = [f"k{i:04d}" for i in range(1000)]
    for start in range(0, 1000, 100):
        raw.transaction(compare=[], success=[
            raw.transactions.put(prefix + n, n) for n in names[start:start + 100]], failure=[])
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, preload_limit=0) as store:
        before_txn = rpc_count(store.registry, "txn")
        before_range = rpc_count(store.registry, "range")
        values = store.mget(names)
        assert values == [n.encode() for n in names]
        assert rpc_count(store.registry, "txn") - before_txn == 8  # ceil(1000 / 128)
        assert rpc_count(store.registry, "range") == before_range
        # Warm: no RPC at all.
        assert store.mget(names) == values
        assert rpc_count(store.registry, "txn") - before_txn == 8
        assert sample(store.registry, "cachedstore_cache_requests_total",
                      op="mget", result="hit") == 1000


def test_max_txn_ops_is_honoured(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, max_txn_ops=10,
                   preload_limit=0) as store:
        store.mget([f"n{i}" for i in range(25)], default=None)
        assert rpc_count(store.registry, "txn") == 3


def test_delete(store):
    store.set("d", "1")
    assert store.delete("d") is True
    assert store.delete("d") is False
    assert store.get("d", default=None) is None


def test_add_counts_atomically_across_stores(etcd, prefix):
    stores = [EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) for _ in range(3)]
    try:
        assert stores[0].add("ctr") == 1
        assert stores[1].add("ctr", 10) == 11

        def bump(s):
            for _ in range(20):
                s.add("ctr")

        threads = [threading.Thread(target=bump, args=(s,)) for s in stores for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert stores[2].add("ctr", 0) == 11 + 120
        assert stores[0].get("ctr") == b"131"
        assert stores[0].add("ctr", -31) == 100
    finally:
        for s in stores:
            s.close()


def test_add_rejects_non_integers(store):
    store.set("text", "abc")
    with pytest.raises(NotAnIntegerError) as info:
        store.add("text")
    assert isinstance(info.value, ValueError)
    assert store.get("text") == b"abc"  # unchanged
    with pytest.raises(InvalidTypeError):
        store.add("n", 1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store.add("n", True)


def test_compare_set_torch_semantics(store):
    # Missing key, expected "" → created.
    assert store.compare_set("k", "", "first") == b"first"
    # Wrong expectation → current value, unchanged.
    assert store.compare_set("k", "other", "x") == b"first"
    # Right expectation → swapped.
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.get("k") == b"second"
    # Missing key, non-empty expected → expected returned, nothing created.
    assert store.compare_set("m", "exp", "new") == b"exp"
    assert store.get("m", default=None) is None
    # Present with an empty value and expected "" → swapped.
    store.set("e", "")
    assert store.compare_set("e", "", "filled") == b"filled"


def test_wait_and_check(store, etcd, prefix):
    store.set("w1", "1")
    assert store.check(["w1"]) is True
    assert store.check(["w1", "w2"]) is False
    threading.Timer(0.2, lambda: raw_client(etcd).put(prefix + "w2", "2")).start()
    store.wait(["w1", "w2"], timeout=10)
    assert store.check(["w1", "w2"]) is True
    with pytest.raises(StoreTimeoutError):
        store.wait(["w3"], timeout=0.1)


def test_wait_uses_the_store_timeout_by_default(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, timeout=0.2) as store:
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            store.wait(["never"])
        assert time.monotonic() - started < 5


def test_num_keys(store):
    assert store.num_keys() == 0
    store.set("a", "1")
    store.set("b", "1")
    assert store.num_keys() == 2
    store.delete("a")
    assert store.num_keys() == 1


def test_bad_input_is_rejected_before_anything_is_sent(store):
    registry = store.registry
    sent_before = sum(rpc_count(registry, m) for m in ("put", "range", "txn", "delete_range"))
    with pytest.raises(InvalidTypeError):
        store.set(1, "v")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store.set("k", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.get(["list"])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        store.set("", "v")
    with pytest.raises(ValueError) as info:
        store.set("big", b"x" * 2_000_000)
    assert "1572864" in str(info.value)
    with pytest.raises(InvalidInputError):
        store.get("")
    with pytest.raises(InvalidInputError):
        store.get("k", timeout=-1)
    with pytest.raises(InvalidInputError):
        store.compare_set("k", "", b"x" * 2_000_000)
    sent_after = sum(rpc_count(registry, m) for m in ("put", "range", "txn", "delete_range"))
    assert sent_after == sent_before
    assert store.num_keys() == 0


def test_value_at_the_limit_round_trips(store):
    limit = store.config.max_request_bytes - 512 - len(store.prefix) - len("edge")
    store.set("edge", b"v" * limit)
    assert len(store.get("edge")) == limit


def test_unreachable_cluster_raises_connection_error_promptly():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(EtcdConnectionError) as info:
        EtcdStore("127.0.0.1", port, connect_timeout=1.0)
    assert isinstance(info.value, ConnectionError)
    assert time.monotonic() - started < 10
    assert f"127.0.0.1:{port}" in str(info.value)


def test_closed_store_refuses_operations(etcd, prefix):
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix)
    store.set("a", "1")
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.get("a"), lambda: store.set("a", "2"),
                 lambda: store.mget(["a"]), lambda: store.num_keys()):
        with pytest.raises(StoreClosedError):
            call()
    assert "closed" in repr(store)


def test_close_releases_blocked_waiters(etcd, prefix):
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix)
    errors = []

    def waiter():
        try:
            store.get("never", timeout=30)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    eventually(lambda: store.stats()["waiters"] == 1, what="waiter registered")
    store.close()
    t.join(10)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StoreClosedError)


def test_threads_are_named_and_stop_on_close(etcd, prefix):
    before = set(threading.enumerate())  # thread objects: idents are recycled
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix)
    asyncio.run(store.aget("x", default=None))  # starts the aio executor
    ours = [t for t in threading.enumerate() if t not in before]
    names = {t.name for t in ours}
    assert any(n.startswith("cachedstore-watch-") for n in names)
    store.close()
    # This store's threads (another test's unclosed store, whose etcd is gone, may still
    # be retrying: its watch thread is no thread of this store's).
    leftover = [t for t in threading.enumerate() if t not in before
                and t.name.startswith("cachedstore-") and t.is_alive()]
    assert leftover == [], _stacks(leftover)


def _stacks(threads: list[threading.Thread]) -> str:
    """Where each of ``threads`` is now (for a failure's message)."""
    import sys
    import traceback

    frames = sys._current_frames()
    return "\n".join(f"{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threads if t.ident in frames)


def test_the_watch_streams_sender_thread_is_gone_after_close(etcd, prefix, monkeypatch):
    """The wire transport's sender thread ends after its request iterator: forced to
    linger there, it must still be gone when close() returns (the watcher joins it)."""
    import cachedstore.wire as wire

    consume = wire.WireCall._consume_requests

    def lingering(self):
        consume(self)
        time.sleep(0.5)  # what the thread may still do after the iterator ended

    monkeypatch.setattr(wire.WireCall, "_consume_requests", lingering)
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_transport="wire")
    other = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, watch_transport="wire")
    try:
        # Named after its store, as the watch thread is: two stores, two names.
        name = f"cachedstore-watch-send-{store._id}"
        assert name != f"cachedstore-watch-send-{other._id}"
        assert f"cachedstore-watch-{store._id}" in {t.name for t in threading.enumerate()}
        assert any(t.name == name for t in threading.enumerate())
        store.close()
        assert [t for t in threading.enumerate() if t.name == name and t.is_alive()] == []
        assert any(t.name == f"cachedstore-watch-send-{other._id}"
                   for t in threading.enumerate())
    finally:
        store.close()
        other.close()


def test_repr_and_stats(store):
    store.set("a", "1")
    text = repr(store)
    assert "EtcdStore" in text and "watching" in text
    stats = store.stats()
    assert stats["watch_up"] is True and stats["entries"] >= 1


def test_public_api_is_declared():
    for name in cachedstore.__all__:
        assert hasattr(cachedstore, name), name
    assert issubclass(cachedstore.KeyNotFoundError, KeyError)
    assert issubclass(cachedstore.StoreTimeoutError, TimeoutError)
    assert issubclass(cachedstore.EtcdConnectionError, ConnectionError)
    assert issubclass(cachedstore.EtcdPermissionError, PermissionError)
    assert issubclass(cachedstore.InvalidInputError, ValueError)
    assert issubclass(cachedstore.InvalidTypeError, TypeError)


# -- asyncio -----------------------------------------------------------------------------
def test_aget_hit_does_not_suspend(store):
    store.set("hot", "v")
    store.get("hot")
    coro = store.aget("hot")
    with pytest.raises(StopIteration) as done:
        coro.send(None)  # completes on the first step: no await, no thread hop
    assert done.value.value == b"v"


def test_aget_miss_default_and_timeout(store):
    async def main():
        assert await store.aget("none", default=1) == 1
        with pytest.raises(KeyNotFoundError):
            await store.aget("none")
        with pytest.raises(StoreTimeoutError):
            await store.aget("none", timeout=0.1)

    asyncio.run(main())


def test_many_async_waiters_hold_no_threads(etcd, prefix):
    """200 coroutines block on absent keys; the executor's threads are not held by them."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        async def main():
            tasks = [asyncio.ensure_future(store.aget(f"k{i}", timeout=30)) for i in range(200)]
            await asyncio.to_thread(
                eventually, lambda: store.stats()["waiters"] == 200, 20, 0.01, "waiters")
            threads = [t for t in threading.enumerate() if t.name.startswith("cachedstore-aio")]
            assert len(threads) <= 4
            writer = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix)
            try:
                for i in range(200):
                    writer.set(f"k{i}", str(i))
            finally:
                writer.close()
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)

        assert asyncio.run(main()) == [str(i).encode() for i in range(200)]


def _abandon(store, read) -> None:
    """Run ``read()`` (a blocking aget/amget coroutine) on a loop of its own until it
    waits, then close the loop without cancelling it (no asyncio.run, which would)."""
    def abandoned_loop() -> None:
        loop = asyncio.new_event_loop()
        loop.create_task(read())
        loop.run_until_complete(asyncio.to_thread(
            eventually, lambda: store.stats()["waiters"] == 1, 10, 0.005, "the wait"))
        loop.close()

    thread = threading.Thread(target=abandoned_loop, name="test-abandoned-loop")
    thread.start()
    thread.join(30)


def test_an_aget_left_pending_by_a_closed_loop_does_not_stay_a_waiter(store, etcd, prefix):
    """A loop stopped and closed with a blocking aget still pending (no asyncio.run, which
    would cancel it): the coroutine never removes its waiter. Once the key is put, the
    store no longer counts it, and its watch may be paced again."""
    _abandon(store, lambda: store.aget("k", timeout=30))
    assert store.stats()["waiters"] == 1
    raw_client(etcd).put(prefix + "k", "v")
    eventually(lambda: store.stats()["waiters"] == 0, 10, 0.01, "the dead waiter forgotten")
    assert not store._cache.awaited()


def test_an_agets_timeout_covers_its_wait_for_an_executor_thread(etcd, prefix):
    """With every thread of the store's asyncio executor busy (the calls of reads cancelled
    meanwhile, or of blocked reads retrying an unreachable etcd), a blocking aget or amget
    ends at its deadline (StoreTimeoutError, caused by the read nobody could send; the
    default if given), as a blocking get would, not once a thread is free. (No preload:
    the cache does not know the key is absent, so the reads must ask etcd.)"""
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, preload_limit=0)
    store.add("counter", 5)
    assert store.get("counter") == b"5"  # its key cached: the read is of its value

    async def main() -> list[float]:
        took = []
        async with BusyPool(store._aio):
            for read in (lambda: store.aget("absent", timeout=0.5),
                         lambda: store.amget(["absent"], timeout=0.5)):
                started = time.monotonic()
                with pytest.raises(StoreTimeoutError) as timed_out:
                    await asyncio.wait_for(read(), 20)
                took.append(time.monotonic() - started)
                assert isinstance(timed_out.value.__cause__, EtcdConnectionError)
            assert await asyncio.wait_for(store.aget("absent", 7, timeout=0.5), 20) == 7
            started = time.monotonic()
            with pytest.raises(EtcdConnectionError):  # a consistent read: the error answers
                await asyncio.wait_for(store.aget("absent", 7, timeout=0.5, consistent=True),
                                       20)
            took.append(time.monotonic() - started)
            assert await asyncio.wait_for(
                store.amget(["absent"], default=7, timeout=0.5), 20) == [7]
            # A counter's value read (its key found) is a round trip as well: unanswered,
            # as when etcd does not answer it in time (as get and mget then raise).
            for read in (lambda: store.aget("counter", timeout=0.5),
                         lambda: store.amget(["counter"], timeout=0.5)):
                started = time.monotonic()
                with pytest.raises(EtcdConnectionError):
                    await asyncio.wait_for(read(), 20)
                took.append(time.monotonic() - started)
        return took

    try:
        assert all(t < 2.0 for t in asyncio.run(main()))
    finally:
        store.close()


def test_an_agets_wait_runs_on_the_stores_clock(etcd, prefix):
    """A blocking aget's pauses read the store's clock, as get's do: on a test's FakeClock
    it ends once the clock passes its deadline, not after its timeout of real time."""
    from cachedstore.clock import FakeClock

    clock = FakeClock()
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, clock=clock) as store:
        async def main():
            read = asyncio.ensure_future(store.aget("absent", "none", timeout=600))
            await asyncio.to_thread(
                eventually, lambda: store.stats()["waiters"] == 1, 10, 0.005, "the wait")
            clock.advance(601)
            return await asyncio.wait_for(read, 10)

        assert asyncio.run(main()) == "none"


def test_amget(store):
    store.set("a", "1")
    store.get("a")

    async def main():
        assert await store.amget(["a"]) == [b"1"]
        assert await store.amget(["a", "b"], default=None) == [b"1", None]
        with pytest.raises(KeyNotFoundError):
            await store.amget(["a", "b"])

    asyncio.run(main())


def test_an_abandoned_agets_cleanup_never_waits_for_the_cache_lock(store, etcd, prefix,
                                                                   monkeypatch):
    """An aget left pending by a closed loop is a reference cycle (task, coroutine, its
    waiter's future) that only the garbage collector frees, at any allocation, on any
    thread: one holding the cache's lock too. Its cleanup must not wait for that lock
    (the thread would wait for itself, and the store with it). Forced here: collection
    off until the writer's install, under the lock, collects."""
    import gc

    import cachedstore.cache as cache_module

    gc.disable()
    try:
        _abandon(store, lambda: store.aget("k", timeout=30))
        raw_client(etcd).put(prefix + "k", "v")  # its wake finds the loop closed
        eventually(lambda: store.stats()["waiters"] == 0, 10, 0.01, "the waiter forgotten")
        stored, collected = cache_module.stored, []

        def stored_after_collecting(value):
            if not collected:
                collected.append(store._cache._lock.locked())
                gc.collect()  # what any allocation under the lock may start
            return stored(value)

        monkeypatch.setattr(cache_module, "stored", stored_after_collecting)
        done = threading.Event()
        writer = threading.Thread(target=lambda: (store.set("x", "1"), done.set()),
                                  name="test-writer", daemon=True)
        writer.start()
        finished = done.wait(10)
        if not finished:  # unblock the store for its teardown (a plain Lock: any thread)
            store._cache._lock.release()
        assert finished, "the collector's cleanup waited for the lock its thread held"
        assert collected == [True]
        assert store.stats()["waiters"] == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("op", ["aget", "amget"])
def test_an_abandoned_sampled_reads_cleanup_never_waits_for_the_histograms_lock(
        etcd, prefix, op):
    """The sampled call (a store's first aget or amget is one) observes its latency as it
    ends; closed unfinished by the garbage collector, on a thread that may hold the
    histogram's lock (a scrape's snapshot allocates under it), it observes nothing.
    Forced: a collection while the histogram's lock is held."""
    import gc

    gc.disable()
    try:
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
            read = {"aget": lambda: store.aget("k", timeout=30),
                    "amget": lambda: store.amget(["k"], timeout=30)}[op]
            _abandon(store, read)
            raw_client(etcd).put(prefix + "k", "v")  # forgotten: now cyclic garbage
            eventually(lambda: store.stats()["waiters"] == 0, 10, 0.01, "forgotten")
            lock, done = store.metrics.duration[op]._lock, threading.Event()

            def collect_under_the_lock() -> None:
                with lock:
                    gc.collect()
                done.set()

            thread = threading.Thread(target=collect_under_the_lock, daemon=True,
                                      name="test-collector")
            thread.start()
            finished = done.wait(10)
            if not finished:
                lock.release()  # (for the teardown: a plain Lock, any thread)
            assert finished, "the collector's cleanup waited for the lock its thread held"
    finally:
        gc.enable()


def test_a_forgotten_store_is_closed_off_the_collectors_thread(etcd, prefix, monkeypatch):
    """A store dropped without close() is in reference cycles: the garbage collector frees
    it, on any thread, its own watch thread too, while that holds the cache's lock. Its
    close (which takes that lock, and joins that thread) runs on a thread of its own.
    Forced: the forgotten store's watch thread collects while it installs an event."""
    import gc
    import weakref

    import cachedstore.cache as cache_module

    gc.disable()
    try:
        store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix)
        store.get("x", default=None)
        cache, forgotten = store._cache, weakref.ref(store)
        watch_thread = f"cachedstore-watch-{store._id}"
        del store
        assert forgotten() is not None  # only its cycles hold it
        stored, collected = cache_module.stored, []

        def stored_after_collecting(value):
            if not collected and threading.current_thread().name == watch_thread:
                collected.append(cache._lock.locked())
                gc.collect()
            return stored(value)

        monkeypatch.setattr(cache_module, "stored", stored_after_collecting)
        raw_client(etcd).put(prefix + "x", "1")
        eventually(lambda: collected and forgotten() is None, 10, 0.01, "the collection")
        eventually(lambda: all(t.name != watch_thread for t in threading.enumerate()), 10,
                   0.01, "the forgotten store's watch thread ended")
        assert collected == [True] and not cache._lock.locked()
    finally:
        gc.enable()


def test_mget_and_amget_latency_is_observed_hit_or_miss_alike(store):
    """The duration histogram is an unbiased sample on both fronts: every mget (all hits,
    a miss, consistent), and one amget in ``LATENCY_SAMPLE_EVERY`` whichever it is (it had
    observed only the calls with a miss)."""
    from cachedstore.config import LATENCY_SAMPLE_EVERY

    store.set("a", "1")
    store.get("a")
    registry = store.registry

    def observed(op: str) -> float:
        return sample(registry, "cachedstore_request_duration_seconds_count", op=op)

    before = observed("mget")
    assert store.mget(["a"]) == [b"1"]
    assert store.mget(["a", "b"], default=None) == [b"1", None]
    assert store.mget(["a"], consistent=True) == [b"1"]
    assert observed("mget") - before == 3

    async def amgets(names: list[str]) -> None:
        for _ in range(2 * LATENCY_SAMPLE_EVERY):
            assert (await store.amget(names, default=None))[0] == b"1"

    for names in (["a"], ["a", "b"]):  # all hits; a miss
        before = observed("amget")
        asyncio.run(amgets(names))
        assert observed("amget") - before == 2, names


def test_small_prefix_is_preloaded_and_blocking_reads_need_no_etcd_read(etcd, prefix):
    raw = raw_client(etcd)
    raw.put(prefix + "a", "1")
    raw.put(prefix + "b", "2")
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        assert rpc_count(store.registry, "range") == 2  # count, then the snapshot
        assert store.mget(["a", "b"]) == [b"1", b"2"]
        assert rpc_count(store.registry, "range") == 2 and rpc_count(store.registry, "txn") == 0
        # Blocking reads of keys nobody wrote yet wait on the watch without asking etcd:
        # the cache holds every key of the prefix, so "not here" means "not yet written".
        threading.Timer(0.2, lambda: raw.put(prefix + "late", "3")).start()
        assert store.get("late", timeout=10) == b"3"
        threading.Timer(0.2, lambda: raw.put(prefix + "later", "4")).start()
        assert store.mget(["a", "later"], timeout=10) == [b"1", b"4"]
        assert rpc_count(store.registry, "range") == 2 and rpc_count(store.registry, "txn") == 0
        # A non-blocking read of a key never seen still asks etcd (it may have been written
        # a moment ago, ahead of the watch).
        assert store.get("absent", default=None) is None
        assert rpc_count(store.registry, "range") == 3


def test_blocking_reads_ask_etcd_once_anything_was_evicted(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, cache_size=2) as store:
        assert rpc_count(store.registry, "range") == 1  # empty prefix: complete already
        assert store.get("x", default=None, timeout=0.05) is None
        assert rpc_count(store.registry, "range") == 1
        for name in ("a", "b", "c"):  # the third entry evicts one: no longer complete
            store.set(name, "v")
        assert store.get("y", default=None, timeout=0.05) is None
        assert rpc_count(store.registry, "range") == 2


def test_large_prefix_is_not_preloaded(etcd, prefix):
    raw = raw_client(etcd)
    for i in range(5):
        raw.put(prefix + f"k{i}", "v")
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, preload_limit=4) as store:
        assert rpc_count(store.registry, "range") == 1 and store.stats()["entries"] == 0
        assert store.get("k0") == b"v"
        assert store.get("nope", default=None) is None
        assert rpc_count(store.registry, "range") == 3  # both were read through


def test_mset_writes_in_batched_txns_and_validates_first(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, max_txn_ops=10) as store:
        items = {f"m{i:02d}": str(i) for i in range(25)}
        store.mset(items)
        assert rpc_count(store.registry, "txn") == 3  # 10 + 10 + 5
        assert store.mget(list(items)) == [v.encode() for v in items.values()]
        assert raw_client(etcd).get(prefix + "m07")[0] == b"7"
        store.mset([("dup", "first"), ("dup", "last")])  # a name twice: the last value wins
        assert store.get("dup") == b"last"
        with pytest.raises(InvalidTypeError):
            store.mset([("ok", "v"), ("bad", 3)])  # type: ignore[list-item]
        with pytest.raises(InvalidInputError):
            store.mset([("ok", "v"), ("", "v")])
        assert store.get("ok", default=None) is None  # nothing of a refused call was written


def test_mset_splits_large_values_within_the_request_limit(etcd, prefix):
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        big = b"x" * 600_000
        store.mset({f"big{i}": big for i in range(5)})  # 3 MB: more than one request holds
        assert rpc_count(store.registry, "txn") >= 3
        assert store.mget([f"big{i}" for i in range(5)]) == [big] * 5


def test_a_zero_timeout_reads_a_key_the_cache_evicted(etcd, prefix):
    # A blocking read whose deadline is now still gets one etcd round trip for a key that
    # exists but is not cached (evicted): it used to fail as "etcd unreachable", and a
    # TorchEtcdStore.get of such a key blocked until the store timeout.
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, cache_size=2) as store:
        store.set("k", "v")
        for i in range(4):
            store.set(f"other{i}", "x")
        assert store._cache.lookup("k") is None  # evicted
        assert store.get("k", timeout=0) == b"v"
        store.set("other-again", "x")
        store.set("other-more", "x")
        assert store.mget(["k"], default=None, timeout=0) == [b"v"]
        with pytest.raises(StoreTimeoutError):
            store.get("absent", timeout=0)


# -- the hit path (store.get/aget inline CoherentCache.lookup, lock-free) ------------------
@pytest.mark.parametrize("metrics", [True, False])
def test_a_hit_while_a_change_is_half_done_takes_the_locked_path(etcd, prefix, metrics):
    """While the cache's lock is held (an apply, reset or eviction spanning several names
    may be half done), ``get`` and ``aget`` must not answer from the entry they read
    lock-free: they take the read-through path, which reads it again under the lock. The
    lock is held by this thread and the reads run on another, whose read-through is
    recorded instead of run (it would wait for the lock): deterministic."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, metrics=metrics) as store:
        store.set("k", "v")
        for _ in range(3):  # past the first (sampled, timed) call: the untimed hit path
            assert store.get("k") == b"v"
            assert asyncio.run(store.aget("k")) == b"v"
        slow: list[str] = []

        def read_through(op, name, *args):
            slow.append(op)
            return "read through"

        async def front_get(op, name, *args):
            slow.append(op)
            return "read through"

        store._reads.get = read_through
        store._async.get = front_get
        got: list[object] = []
        with store._cache._lock:
            reader = threading.Thread(target=lambda: got.extend(
                [store.get("k"), asyncio.run(store.aget("k"))]))
            reader.start()
            reader.join(10)
        assert got == ["read through", "read through"] and slow == ["get", "aget"]
        # The lock free again: a hit, from the cache, and no read-through.
        assert store.get("k") == b"v" and asyncio.run(store.aget("k")) == b"v"
        assert slow == ["get", "aget"]


@pytest.mark.parametrize("metrics", [True, False])
def test_a_hit_below_the_floor_is_refused(etcd, prefix, metrics):
    """An entry older than the cache's floor (a watch that went down, a reset, close) is
    never served by the lock-free hit: the read goes through."""
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, metrics=metrics) as store:
        store.set("k", "v")
        for _ in range(3):
            assert store.get("k") == b"v"
        calls: list[str] = []
        store._reads.get = lambda op, name, *args: calls.append(op) or "read through"
        cache = store._cache
        floor = cache.floor
        cache.floor = store._entries["k"][1] + 1
        try:
            assert store.get("k") == "read through" and calls == ["get"]
        finally:
            cache.floor = floor


def test_hits_are_counted_and_one_in_sample_every_is_timed(store):
    """With metrics on every hit counts and one get in ``LATENCY_SAMPLE_EVERY`` (hit or
    miss) is observed in the latency histogram; with ``metrics=False`` neither happens
    and the hit is the same value."""
    from cachedstore.config import LATENCY_SAMPLE_EVERY

    store.set("k", "v")
    registry = store.registry
    assert registry is not None

    def figures():
        hits = registry.get_sample_value("cachedstore_cache_requests_total",
                                         {"op": "get", "result": "hit"}) or 0
        timed = registry.get_sample_value("cachedstore_request_duration_seconds_count",
                                          {"op": "get"}) or 0
        return hits, timed

    store.get("k")
    hits, timed = figures()
    for _ in range(4 * LATENCY_SAMPLE_EVERY):
        assert store.get("k") == b"v"
    assert figures() == (hits + 4 * LATENCY_SAMPLE_EVERY, timed + 4)
