"""The coherence guarantees of docs/design.md, each against a real etcd: the core
(``cache.py``) as the read path (``reads.py``: misses, fills, waits) and the writes feed it.

The races are made deterministic with hooks: a gate in front of the watch thread's apply or
stream start, and a hook between "read from etcd" and "insert into the cache".
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
from util import eventually, raw_client, rpc_count, sample

from cachedstore import EtcdConnectionError, EtcdStore


def open_store(etcd, prefix, **kwargs) -> EtcdStore:
    return EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **kwargs)


@contextmanager
def held_watch_apply(store: EtcdStore):
    """Hold the watch thread before it applies its next response; yields the release."""
    cache = store._cache
    original = cache.apply_events
    gate = threading.Event()
    held = threading.Event()
    batches = []

    def gated(events, revision, scope=None):
        held.set()
        gate.wait(30)
        batches.append(list(events))
        original(events, revision, scope)

    cache.apply_events = gated
    try:
        yield gate, held, batches
    finally:
        gate.set()
        cache.apply_events = original


@contextmanager
def held_watch_restart(store: EtcdStore):
    """End the current watch stream and hold the watcher before it starts the next one."""
    watcher = store._watcher
    original = watcher._stream_once
    gate = threading.Event()
    waiting = threading.Event()

    def gated():
        waiting.set()
        gate.wait(30)
        return original()

    watcher._stream_once = gated
    watcher._call.cancel()
    try:
        waiting.wait(10)
        yield gate
    finally:
        gate.set()
        watcher.__dict__.pop("_stream_once", None)


def test_other_clients_writes_become_visible(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        raw.put(prefix + "k", "v1")
        eventually(lambda: store.get("k", default=None) == b"v1", what="put visible")
        raw.put(prefix + "k", "v2")
        eventually(lambda: store.get("k") == b"v2", what="update visible")
        raw.delete(prefix + "k")
        eventually(lambda: store.get("k", default=None) is None, what="delete visible")


def test_watch_fills_the_cache_so_the_first_read_is_a_hit(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        revision = raw.put(prefix + "peer", "addr").header.revision
        eventually(lambda: store.watch_revision >= revision, what="watch applied the put")
        ranges = rpc_count(store.registry, "range")
        assert store.get("peer") == b"addr"
        assert rpc_count(store.registry, "range") == ranges
        assert sample(store.registry, "cachedstore_cache_requests_total",
                      op="get", result="miss") == 0


def test_read_your_writes_and_monotonic_reads_with_a_lagging_watch(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store, held_watch_apply(store) as (gate, held, _):
        raw.put(prefix + "k", "other-old")  # the watch is held before applying this
        held.wait(10)
        store.set("k", "mine")  # newer: etcd orders it after the raw put
        assert store.get("k") == b"mine"  # read-your-writes without the watch
        gate.set()
        # The watch now applies the older put and then our own put: neither moves back.
        eventually(lambda: store.watch_revision >= raw.get(prefix + "k")[1].mod_revision,
                   what="watch caught up")
        assert store.get("k") == b"mine"


def test_events_of_one_transaction_apply_together_in_order(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.set("c", "old")
        with held_watch_apply(store) as (gate, held, batches):
            raw.transaction(compare=[], success=[
                raw.transactions.put(prefix + "a", "1"),
                raw.transactions.put(prefix + "b", "2"),
                raw.transactions.delete(prefix + "c"),
            ], failure=[])
            gate.set()
            eventually(lambda: batches, what="the txn batch")
        batch = batches[-1]
        assert [name for name, _, _ in batch] == ["a", "b", "c"]
        assert len({rev for _, _, rev in batch}) == 1  # one revision, applied as one batch
        assert store.get("a") == b"1" and store.get("b") == b"2"
        assert store.get("c", default=None) is None


def _delay_fill(store, during_fill):
    """Run ``during_fill()`` once, between the read from etcd and the cache insert."""
    reads = store._reads

    def hooked(names):
        reads.after_read = None
        during_fill()

    reads.after_read = hooked


def test_stale_fill_refused_when_the_entry_is_cached(etcd, prefix):
    raw = raw_client(etcd)
    raw.put(prefix + "k", "old")
    with open_store(etcd, prefix, preload_limit=0) as store:  # k is read through

        def newer_write():
            revision = raw.put(prefix + "k", "new").header.revision
            eventually(lambda: store.watch_revision >= revision, what="watch applied")

        _delay_fill(store, newer_write)
        assert store.get("k") == b"new"  # the refused read answers with the newer state
        assert store.get("k") == b"new"
        assert sample(store.registry, "cachedstore_fills_dropped_total") == 1


@pytest.mark.parametrize("change", ["put", "delete"])
def test_stale_fill_refused_even_after_eviction(etcd, prefix, change):
    """The newer event's entry is evicted before the fill lands: only the per-key revision
    gate, kept outside the LRU, can still refuse the fill."""
    raw = raw_client(etcd)
    raw.put(prefix + "k", "old")
    with open_store(etcd, prefix, cache_size=1, preload_limit=0) as store:

        def newer_change_then_evict():
            if change == "put":
                raw.put(prefix + "k", "new")
            else:
                raw.delete(prefix + "k")
            revision = raw.put(prefix + "other", "x").header.revision  # evicts k
            eventually(lambda: store.watch_revision >= revision, what="watch applied")
            assert "k" not in store._cache._lru

        _delay_fill(store, newer_change_then_evict)
        store.get("k", default=None)
        expected = b"new" if change == "put" else None
        assert store.get("k", default=None) == expected
        assert sample(store.registry, "cachedstore_fills_dropped_total") == 1
        # And the cache does not hold the stale value.
        entry = store._cache.peek("k")
        assert entry is None or entry[0] == expected


def test_unhealthy_watch_is_not_served(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        with held_watch_restart(store):
            eventually(lambda: not store.watch_healthy, what="watch down")
            raw.put(prefix + "k", "v2")  # the watch cannot see it
            ranges = rpc_count(store.registry, "range")
            assert store.get("k") == b"v2"  # read through, never the cached v1
            assert rpc_count(store.registry, "range") == ranges + 1
        eventually(lambda: store.watch_healthy, what="watch back")
        assert store.get("k") == b"v2"
        assert sample(store.registry, "cachedstore_watch_restarts_total",
                      reason="canceled") == 1


def test_resync_after_compaction(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.set("k", "v1")
        store.set("gone", "x")
        assert store.get("k") == b"v1"
        with held_watch_restart(store):
            raw.put(prefix + "k", "v2")
            raw.delete(prefix + "gone")
            raw.put(prefix + "fresh", "f")
            etcd.compact()
            assert store.get("k") == b"v2"  # down: reads go to etcd
        eventually(lambda: sample(store.registry, "cachedstore_watch_restarts_total",
                                  reason="compacted") == 1, what="compaction detected")
        eventually(lambda: store.watch_healthy, what="resynced")
        assert store.get("k") == b"v2"
        assert store.get("gone", default=None) is None
        assert store.get("fresh") == b"f"
        raw.put(prefix + "k", "v3")  # and the new watch follows further changes
        eventually(lambda: store.get("k") == b"v3", what="following after resync")


@pytest.mark.parametrize("max_txn_ops, txns", [(128, 1), (5, 3)])
def test_a_compaction_resync_reads_the_touched_scopes_in_few_txns(etcd, prefix, max_txn_ops,
                                                                  txns):
    """A store watching the keys it touched that finds its resume revision compacted
    reads them afresh: one Txn of ranges per ``max_txn_ops`` scopes, not a range per
    scope, and then serves each of them fresh."""
    raw = raw_client(etcd)
    names = [f"group{i}/key" for i in range(12)]
    with open_store(etcd, prefix, watch_scope="touched", max_txn_ops=max_txn_ops) as store:
        for name in names:
            store.set(name, "v1")
        assert all(store.get(name) == b"v1" for name in names)  # 12 scopes touched
        with held_watch_restart(store):
            for name in names:
                raw.put(prefix + name, "v2")
            etcd.compact()
            before = {m: rpc_count(store.registry, m) for m in ("range", "txn")}
        eventually(lambda: sample(store.registry, "cachedstore_watch_restarts_total",
                                  reason="compacted") == 1, what="compaction detected")
        eventually(lambda: store.watch_healthy, what="resynced")
        after = {m: rpc_count(store.registry, m) - before[m] for m in before}
        assert after == {"range": 0, "txn": txns}, after
        assert all(store.get(name, timeout=0) == b"v2" for name in names)
        assert {m: rpc_count(store.registry, m) - before[m] for m in before} == after


def test_resume_after_disconnect_does_not_lose_events(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.set("k", "v1")
        revision = store.watch_revision
        with held_watch_restart(store):
            raw.put(prefix + "k", "v2")
            raw.put(prefix + "j", "j1")
        # Resumed from revision + 1: the missed events arrive, no resync needed.
        eventually(lambda: store.watch_healthy and store.watch_revision > revision,
                   what="resumed")
        eventually(lambda: store.get("j", default=None) == b"j1", what="missed event")
        assert store.get("k") == b"v2"
        assert sample(store.registry, "cachedstore_watch_restarts_total",
                      reason="compacted") == 0


def test_recovers_after_etcd_is_killed_and_restarted(etcd_factory, prefix):
    server = etcd_factory()
    raw = raw_client(server)
    with EtcdStore(endpoints=[server.endpoint], prefix=prefix, request_timeout=1.0) as store:
        store.set("k", "before")
        assert store.get("k") == b"before"
        server.kill()
        eventually(lambda: not store.watch_healthy, what="watch noticed the outage")
        with pytest.raises(EtcdConnectionError):
            store.get("k")  # not served from the cache while the watch is down
        server.restart()
        raw = raw_client(server)
        raw.put(prefix + "k", "after")
        eventually(lambda: store.get("k", default=None) == b"after", timeout=20,
                   what="new write seen after restart")
        eventually(lambda: store.watch_healthy, timeout=20, what="watch back")
        store.set("k2", "v")
        assert raw.get(prefix + "k2")[0] == b"v"


def test_waiters_share_one_watch_and_do_not_poll(etcd, prefix):
    n = 300
    with open_store(etcd, prefix) as store:
        results: dict[int, bytes] = {}

        def wait(i):
            results[i] = store.get(f"w{i}", timeout=60)

        watches_before = etcd.etcd_metric("grpc_server_started_total", {"grpc_method": "Watch"})
        threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        eventually(lambda: store.stats()["waiters"] == n, what="all waiting")
        ranges = rpc_count(store.registry, "range")
        # Hold them for a few watch progress intervals: no request goes to etcd.
        threading.Event().wait(1.0)
        assert rpc_count(store.registry, "range") == ranges
        writer = raw_client(etcd)
        writer.put(prefix + "w7", "seven")
        threads[7].join(10)
        assert results == {7: b"seven"}  # exactly that waiter woke
        assert store.stats()["waiters"] == n - 1
        for i in range(n):
            if i != 7:
                writer.put(prefix + f"w{i}", str(i))
        for t in threads:
            t.join(30)
        assert len(results) == n
        assert all(results[i] == str(i).encode() for i in range(n) if i != 7)
        watches_after = etcd.etcd_metric("grpc_server_started_total", {"grpc_method": "Watch"})
        assert watches_after == watches_before  # no waiter opened a stream
        assert store.stats()["waiters"] == 0


def test_only_one_watch_stream_per_store(etcd, prefix):
    before = etcd.etcd_metric("grpc_server_started_total", {"grpc_method": "Watch"})
    with open_store(etcd, prefix) as store:
        for i in range(20):
            store.set(f"k{i}", "v")
            store.get(f"k{i}")
        store.mget([f"k{i}" for i in range(20)])
        after = etcd.etcd_metric("grpc_server_started_total", {"grpc_method": "Watch"})
    assert after - before == 1


def test_an_idle_watch_is_kept_alive_by_progress_responses(etcd, prefix):
    """A quiet prefix is not a stalled stream: progress responses prove liveness."""
    with open_store(etcd, prefix, stall_timeout=0.6, progress_interval=0.2) as store:
        store.set("k", "v")
        streams = {"grpc_method": "Watch"}
        streams_before = etcd.etcd_metric("grpc_server_started_total", streams)
        assert streams_before >= 1
        deadline = threading.Event()
        deadline.wait(2.0)  # ten progress intervals, three stall timeouts, nothing written
        assert store.watch_healthy
        assert store._watcher.restarts == 0
        assert store.get("k") == b"v"
        assert etcd.etcd_metric("grpc_server_started_total", streams) == streams_before


def test_resync_after_compaction_reloads_a_small_prefix(etcd, prefix):
    raw = raw_client(etcd)
    with open_store(etcd, prefix) as store:
        store.set("k", "v1")
        with held_watch_restart(store):
            raw.put(prefix + "k", "v2")
            raw.put(prefix + "new", "n")
            etcd.compact()
        eventually(lambda: sample(store.registry, "cachedstore_watch_restarts_total",
                                  reason="compacted") == 1, what="compaction detected")
        eventually(lambda: store.watch_healthy, what="resynced")
        assert store._cache.complete  # reloaded: absence is known again without reads
        ranges = rpc_count(store.registry, "range")
        assert store.mget(["k", "new"]) == [b"v2", b"n"]
        assert store.get("missing", default=None, timeout=0.05) is None
        assert rpc_count(store.registry, "range") == ranges


@pytest.mark.parametrize("scope", ["prefix", "touched"])
def test_a_zero_timeout_read_takes_no_waiter_and_a_blocking_one_does(etcd, prefix, scope):
    """A read whose deadline has already passed never pauses: it looks (and reads through
    if it must) without registering a waiter, so it neither counts as blocked nor wakes a
    paced watch (``on_waiter`` hurries it). One that may wait registers before its first
    look."""
    with open_store(etcd, prefix, watch_scope=scope) as store:
        added: list[int] = []
        hurry = store._cache.on_waiter
        store._cache.on_waiter = lambda: (added.append(1), hurry and hurry())
        assert store.get("absent", default=None, timeout=0) is None
        assert store.mget(["absent", "also/absent"], default=None, timeout=0) == [None, None]
        assert store.check(["absent"]) is False
        assert added == []
        assert store.get("absent", default=None, timeout=0.05) is None  # waited, timed out
        assert added == [1]
        assert store.stats()["waiters"] == 0
