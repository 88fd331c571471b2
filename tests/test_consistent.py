"""Linearizable reads (``consistent=True``, ``consistent.py``) against a real etcd: each
case forced deterministically (a held watch, a held revision request), each cost counted
by the store's own request metrics.

The history checker's linearizability check runs them under faults in
``tests/faults/test_checker.py``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cachedstore import EtcdStore
from cachedstore.server import LocalEtcd
from tests.util import eventually, held_watch, raw_client, rpc_count

pytestmark = pytest.mark.timeout(120)


def _store(server: LocalEtcd, prefix: str, **kwargs: Any) -> EtcdStore:
    return EtcdStore(endpoints=[server.endpoint], prefix=prefix, **kwargs)


@pytest.mark.parametrize("scope", ["prefix", "touched"])
@pytest.mark.parametrize("front", ["get", "mget", "aget", "amget", "check"])
def test_a_write_acknowledged_elsewhere_is_read(etcd: LocalEtcd, prefix: str, scope: str,
                                                front: str) -> None:
    """Another client's write is acknowledged while this store's watch is held: a plain
    read still answers the cached old value (coherent, not linearizable); a consistent
    read answers the new one."""
    writer = raw_client(etcd)
    writer.put(prefix + "k", "old")
    with _store(etcd, prefix, watch_scope=scope) as store:
        assert store.get("k") == b"old"
        with held_watch(store):
            writer.put(prefix + "k", "new")  # acknowledged: every later read must see it
            writer.delete(prefix + "gone")
            assert store.get("k") == b"old"  # the cache, behind the held watch
            if front == "get":
                assert store.get("k", consistent=True) == b"new"
            elif front == "mget":
                assert store.mget(["k", "gone"], None, consistent=True) == [b"new", None]
            elif front == "aget":
                assert asyncio.run(store.aget("k", consistent=True)) == b"new"
            elif front == "amget":
                assert asyncio.run(store.amget(["k"], consistent=True)) == [b"new"]
            else:
                writer.put(prefix + "born", "1")
                assert store.check(["k", "born"], consistent=True)


def test_a_busy_scope_is_answered_from_the_cache_after_one_range(etcd: LocalEtcd,
                                                               prefix: str) -> None:
    """When the watch applies the revision etcd reported, the cache answers: one range
    (the revision) and no read of the key."""
    writer = raw_client(etcd)
    with _store(etcd, prefix) as store:
        writer.put(prefix + "k", "v1")
        eventually(lambda: (store._cache.peek("k") or (None,))[0] == b"v1", what="v1")
        registry = store.metrics.registry
        ranges, txns = rpc_count(registry, "range"), rpc_count(registry, "txn")
        with held_watch(store) as release:
            writer.put(prefix + "k", "v2")
            # The revision request is answered; the watch applies v2 only then.
            store._reads.before_catch_up = lambda revision: release.set()
            assert store.get("k", consistent=True) == b"v2"
        assert rpc_count(registry, "range") == ranges + 1
        assert rpc_count(registry, "txn") == txns


def test_a_quiet_scope_reads_etcd_once_a_progress_response_passed(etcd: LocalEtcd,
                                                                  prefix: str) -> None:
    """etcd's revision moved elsewhere (another prefix): this store's scope gets no event
    to reach it. The read asks the stream for a progress response, and when it arrives
    with the scope still behind, reads the key from etcd: two ranges, the right value."""
    writer = raw_client(etcd)
    writer.put(prefix + "k", "v")
    with _store(etcd, prefix) as store:
        assert store.get("k") == b"v"
        for i in range(3):
            writer.put(prefix[:-1] + "-elsewhere/" + str(i), "x")
        registry = store.metrics.registry
        ranges = rpc_count(registry, "range")
        progress_before = store._reads.progress.revision
        assert store.get("k", consistent=True) == b"v"
        assert rpc_count(registry, "range") == ranges + 2
        assert store._reads.progress.revision > progress_before  # the stream answered


def test_concurrent_consistent_reads_share_one_revision_request(etcd: LocalEtcd,
                                                                prefix: str) -> None:
    """The first read's revision request is held until 31 more readers wait: they all
    share the next request. 32 reads, 2 revision requests."""
    with _store(etcd, prefix) as store:
        store.set("k", "v")
        revisions = store._reads.revisions
        conn = store._conn
        original = conn.call
        first = threading.Event()
        release = threading.Event()

        def call(method: str, request: Any, **kwargs: Any) -> Any:
            if method == "range" and not first.is_set():
                first.set()
                assert release.wait(30)
            return original(method, request, **kwargs)

        conn.call = call  # type: ignore[method-assign]
        results: list[bytes] = []
        try:
            readers = [threading.Thread(
                target=lambda: results.append(store.get("k", consistent=True)))
                for _ in range(32)]
            readers[0].start()
            assert first.wait(10)
            for reader in readers[1:]:
                reader.start()
            eventually(lambda: revisions.waiting == 31, what="31 readers waiting")
            release.set()
            for reader in readers:
                reader.join(30)
        finally:
            conn.call = original  # type: ignore[method-assign]
        assert results == [b"v"] * 32
        assert revisions.requests == 2


def test_a_consistent_read_while_the_watch_is_down_reads_etcd(etcd: LocalEtcd,
                                                              prefix: str) -> None:
    """With the stream down, nothing is served from the cache; the read goes to etcd and
    keeps the promise."""
    writer = raw_client(etcd)
    writer.put(prefix + "k", "old")
    with _store(etcd, prefix) as store:
        assert store.get("k") == b"old"
        store._cache.watch_down()
        writer.put(prefix + "k", "new")
        assert store.get("k", consistent=True) == b"new"


def test_wait_consistent_finds_a_key_created_before_the_call(etcd: LocalEtcd,
                                                             prefix: str) -> None:
    """``wait(consistent=True)``'s first look sees a key another client created before
    the call, though the watch has not delivered it."""
    writer = raw_client(etcd)
    with _store(etcd, prefix) as store, held_watch(store):
        writer.put(prefix + "k", "v")
        store.wait(["k"], timeout=5, consistent=True)


def test_progress_wakes_a_waiting_read_on_each_apply_and_each_progress_response() -> None:
    """``consistent.Progress`` (no etcd): a wait re-checks its predicate at every apply the
    watch reports and at a progress response, and ends at its deadline on the clock."""
    from cachedstore.clock import FakeClock
    from cachedstore.consistent import Progress

    clock = FakeClock()
    progress = Progress(clock)
    applied = [0]
    checks: list[int] = []

    def caught_up() -> bool:
        checks.append(applied[0])
        return applied[0] >= 2 or progress.revision >= 7

    def watch() -> None:
        eventually(lambda: len(checks) >= 1, what="the read's first look")
        for _ in range(2):  # advanced() takes the lock the read waits under: none is lost
            applied[0] += 1
            progress.advanced()

    thread = threading.Thread(target=watch)
    thread.start()
    assert progress.wait(caught_up, clock.monotonic() + 60) is True
    thread.join(5)
    assert applied[0] == 2 and checks[-1] == 2
    progress.progressed(7)  # a progress response: the revision is a hint to stop waiting
    assert progress.revision == 7 and progress.wait(caught_up, clock.monotonic()) is True
    assert progress.wait(lambda: False, clock.monotonic()) is False  # deadline already due
