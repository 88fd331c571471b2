"""A 3-member etcd cluster whose members are killed and restarted one at a time, and a
store behind etcd's own ``grpc-proxy``."""

from __future__ import annotations

import threading
import time
from contextlib import closing

import etcd3
import pytest

from cachedstore import EtcdStore
from cachedstore.server import LocalEtcd
from cachedstore.testing import GrpcProxy, LocalEtcdCluster

from . import follows_by_watch, restarts, sample, split, wait_until

pytestmark = pytest.mark.timeout(120)


def _put_any(cluster: LocalEtcdCluster, key: str, value: str, timeout: float = 20.0) -> None:
    """Put through whichever running member accepts it (another client than the store)."""
    deadline = time.monotonic() + timeout
    while True:
        for member in cluster.members:
            if not member.running:
                continue
            host, port = split(member.endpoint)
            try:
                with closing(etcd3.client(host, port, timeout=2)) as client:
                    client.put(key, value)
                return
            except Exception:  # no leader yet, member down...: try the next one
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.05)


def _watching_member(cluster: LocalEtcdCluster) -> int | None:
    """Index of the member serving the store's watch stream (the only stream here)."""
    for index, member in enumerate(cluster.members):
        if member.running and member.etcd_metric("etcd_debugging_mvcc_watch_stream_total") >= 1:
            return index
    return None


def test_cluster_members_killed_one_at_a_time(prefix: str) -> None:
    """Kill (SIGKILL) and restart each member in turn -- first the one serving the store's
    watch, then the leader, then the last one: the store fails over, keeps serving reads and
    writes, and keeps following another client's updates through its watch."""
    with LocalEtcdCluster(3) as cluster, EtcdStore(
            endpoints=cluster.endpoints, prefix=prefix, request_timeout=5.0) as store:
        store.set("k", "v0")
        assert store.get("k") == b"v0"
        wait_until(lambda: _watching_member(cluster) is not None, 5, "the watch stream")
        killed: list[int] = []
        report = []
        for round_ in range(3):
            if round_ == 0:
                victim = _watching_member(cluster)
                role = "watch member"
            elif round_ == 1:
                victim = cluster.leader()
                role = "leader"
            else:
                victim = next(i for i in range(3) if i not in killed)
                role = "last member"
            assert victim is not None
            was_leader = victim == cluster.leader()
            started = time.monotonic()
            cluster.members[victim].kill()
            killed.append(victim)
            value = f"v{round_ + 1}"
            _put_any(cluster, prefix + "k", value)
            accepted = time.monotonic() - started
            seen = wait_until(lambda v=value: store.get("k") == v.encode(), 20,
                              f"the store to see {value} after killing member {victim}")
            store.set("mine", value)
            assert store.get("mine") == value.encode()
            wait_until(lambda: store.watch_healthy, 20, "the watch on a surviving member")
            watching = _watching_member(cluster)
            assert watching is not None and watching != victim
            # Following, not re-reading: the next update arrives as a cache hit.
            follows_by_watch(store, lambda v: _put_any(cluster, prefix + "k", v), "k",
                             value.encode(), value + "-followed", timeout=20)
            report.append(f"killed {role} {victim}{' (leader)' if was_leader else ''}: "
                          f"write accepted {accepted:.2f} s after the kill, seen by the "
                          f"store {seen:.3f} s later")
            cluster.members[victim].restart()
            cluster.wait_healthy(20)
            assert time.monotonic() - started < 60
        assert sorted(killed) == [0, 1, 2] or len(set(killed)) >= 2
        assert restarts(store, "disconnect") >= 1
    print("\n" + "\n".join(report))


@pytest.mark.parametrize("ping_interval", [None, 0.3], ids=["default", "pings-fit"])
def test_store_behind_grpc_proxy(etcd_factory, prefix: str, ping_interval: float | None
                                 ) -> None:
    """Through etcd's ``grpc-proxy``: reads, writes, blocking waits and watch coherence
    work, and a quiet watch is not mistaken for a stalled one. It never PINGs there, even
    when PINGs would fit its stall timeout: the proxy would answer them for etcd (and, at
    0.3 s, close the connection for PINGing more often than its 5 s minimum)."""
    server: LocalEtcd = etcd_factory()
    stall_timeout, progress_interval = 1.0, 0.25
    with GrpcProxy(server.endpoints) as proxy, \
            closing(etcd3.client(*split(server.endpoint), timeout=5)) as writer, \
            EtcdStore(endpoints=[proxy.endpoint], prefix=prefix, stall_timeout=stall_timeout,
                      progress_interval=progress_interval,
                      ping_interval=ping_interval) as store:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        assert store.add("n", 2) == 2 and store.compare_set("n", "2", "3") == b"3"
        value, _ = writer.get(prefix + "k")
        assert value == b"v1"
        follows_by_watch(store, lambda v: writer.put(prefix + "k", v), "k", b"v1", "v2")
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(store.get("later", timeout=10)),
                                  name="grpc-proxy-waiter", daemon=True)
        waiter.start()
        wait_until(lambda: store.stats()["waiters"] == 1, 5, "the blocked get")
        writer.put(prefix + "later", "here")
        waiter.join(10)
        assert got == [b"here"]
        assert store.delete("k") and store.get("k", None) is None
        # Quiet for several stall periods: the watch must stay up, the cache served.
        wait_for = 3 * (stall_timeout + progress_interval)
        deadline = time.monotonic() + wait_for
        while time.monotonic() < deadline:
            assert store.watch_healthy, "the quiet watch was declared down behind grpc-proxy"
            time.sleep(0.05)
        assert restarts(store, "stalled") == 0
        assert store._watcher.restarts == 0
        assert sample(store, "cachedstore_watch_liveness_requests_total",
                      {"kind": "ping"}) == 0
        writer.put(prefix + "k", "v3")
        follows_by_watch(store, lambda v: writer.put(prefix + "k", v), "k", b"v3", "v4")


def test_consistent_reads_behind_grpc_proxy(etcd_factory, prefix: str) -> None:
    """Through ``grpc-proxy``, which forwards linearizable ranges to etcd but never answers
    a progress request: a consistent read of a busy scope is answered from the cache once
    the watch caught up; one whose watch is behind (held here) waits its 50 ms and reads
    etcd; either way it returns the write acknowledged before it began."""
    server: LocalEtcd = etcd_factory()
    with GrpcProxy(server.endpoints) as proxy, \
            closing(etcd3.client(*split(server.endpoint), timeout=5)) as writer, \
            EtcdStore(endpoints=[proxy.endpoint], prefix=prefix) as store:
        writer.put(prefix + "k", "v1")
        assert store.get("k", consistent=True) == b"v1"
        writer.put(prefix + "k", "v2")
        assert store.get("k", consistent=True) == b"v2"
        cache = store._cache
        original = cache.apply_events
        release = threading.Event()

        def held(events, revision, scope=None) -> None:  # type: ignore[no-untyped-def]
            release.wait(30)
            original(events, revision, scope)

        cache.apply_events = held
        try:
            writer.put(prefix + "k", "v3")
            assert store.get("k") == b"v2"  # the cache, behind the held watch
            assert store.get("k", consistent=True) == b"v3"
        finally:
            release.set()
            cache.apply_events = original
