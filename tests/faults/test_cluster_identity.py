"""Endpoints of two different clusters (issue 14, item 7): the store keeps to the cluster
that answered first and never reads, writes or watches a member of the other one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cachedstore import EtcdConnectionError, EtcdStore
from cachedstore.errors import ClusterMismatchError
from cachedstore.server import LocalEtcd

from . import follows_by_watch, wait_until

pytestmark = pytest.mark.timeout(60)


def test_failover_into_another_cluster_is_refused(etcd_factory: Callable[..., LocalEtcd],
                                                  prefix: str) -> None:
    ours, other = etcd_factory(), etcd_factory()
    ours.etcdctl("put", prefix + "k", "ours")
    for i in range(5):  # the other cluster is ahead: resuming there would "work"
        other.etcdctl("put", prefix + "k", f"other{i}")
    with EtcdStore(endpoints=[ours.endpoint, other.endpoint], prefix=prefix,
                   request_timeout=2.0, connect_timeout=5.0) as store:
        assert store.get("k") == b"ours"
        ours.kill()
        wait_until(lambda: not store.watch_healthy, 10, "the watch to notice the kill")
        # Reads fail over, meet the other cluster's member, refuse it and fail clearly
        # (nothing is served from the cache while the watch is down).
        with pytest.raises(ClusterMismatchError, match="another cluster") as info:
            store.get("k")
        assert other.endpoint in str(info.value)
        assert isinstance(info.value, EtcdConnectionError)
        for _ in range(3):  # and stay refused: the foreign member is never used again
            with pytest.raises(EtcdConnectionError):
                store.get("k")
        assert not store.watch_healthy
        with pytest.raises(EtcdConnectionError):
            store.set("k", "lost")
        assert other.etcdctl("get", "--print-value-only", prefix + "k").stdout.strip() \
            == "other4"

        ours.restart()  # the store's own cluster is back: it recovers by itself
        wait_until(lambda: store.watch_healthy, 15, "the watch to come back on its cluster")
        assert store.get("k") == b"ours"
        follows_by_watch(store, lambda v: ours.etcdctl("put", prefix + "k", v), "k",
                         b"ours", "ours2")


def test_writes_never_reach_another_cluster(etcd_factory: Callable[..., LocalEtcd],
                                                      prefix: str) -> None:
    """The cluster is the one that answered first; a member of another cluster listed
    later is refused as soon as the store fails over to it, before any request."""
    ours, other = etcd_factory(), etcd_factory()
    with EtcdStore(endpoints=[ours.endpoint, other.endpoint], prefix=prefix,
                   request_timeout=2.0, connect_timeout=5.0) as store:
        store.set("k", "v")
        ours.stop()
        with pytest.raises(ClusterMismatchError):
            store.set("k2", "never written")
        assert other.etcdctl("get", "--prefix", prefix).stdout == ""
