"""A quiet watch stream checks liveness with HTTP/2 PINGs (``ping_interval``): etcd answers
them in its gRPC transport, so an idle store costs etcd no request. Against real etcd: the
messages etcd's watch streams received (its own ``grpc_server_msg_received_total``), the
PING cadence etcd's keepalive policy accepts, and the fall-back when etcd refuses PINGs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cachedstore import EtcdStore
from cachedstore.cache import NOT_SERVING
from cachedstore.server import LocalEtcd
from tests.util import eventually, raw_client, sample

pytestmark = pytest.mark.timeout(90)


def _watch_messages(etcd: LocalEtcd) -> float:
    """Messages etcd received on watch streams: creates, cancels, progress requests."""
    return etcd.etcd_metric("grpc_server_msg_received_total", {"grpc_method": "Watch"})


def _liveness(store: EtcdStore, kind: str) -> float:
    return sample(store.registry, "cachedstore_watch_liveness_requests_total", kind=kind)


def _cached(store: EtcdStore, name: str) -> bytes | None:
    entry = store._cache.peek(name)
    return None if entry is None else entry[0]


def _store(etcd: LocalEtcd, prefix: str, **kwargs: Any) -> EtcdStore:
    return EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, **kwargs)


def test_a_quiet_store_pings_and_sends_etcd_no_watch_message(
        etcd_factory: Callable[..., LocalEtcd], prefix: str) -> None:
    """Quiet for several stall timeouts: the stream stays up on PING answers alone (no
    restart, the cache served), and etcd's watch streams receive nothing from it once its
    first progress request was answered (that tells etcd from a proxy). Fails with PINGs
    off (progress requests: one per progress_interval) and if an answered PING did not
    count as heard (the stream would be declared stalled)."""
    etcd = etcd_factory(extra_args=["--grpc-keepalive-min-time=100ms"])
    client = raw_client(etcd)
    client.put(f"{prefix}k", "v")
    with _store(etcd, prefix, ping_interval=0.3, stall_timeout=2.0,
                progress_interval=0.2) as store:
        assert store.get("k") == b"v"
        eventually(lambda: _liveness(store, "ping") >= 1, what="the first PING")
        assert _liveness(store, "progress") == 1  # answered: etcd itself, not a proxy
        before = _watch_messages(etcd)
        eventually(lambda: _liveness(store, "ping") >= 15, timeout=30,
                   what="14 more PINGs (4.3 s: 2 stall timeouts)")
        assert _watch_messages(etcd) == before
        assert _liveness(store, "progress") == 1
        assert store._watcher.restarts == 0 and store.watch_healthy
        assert store._cache.floor != NOT_SERVING
        hits = sample(store.registry, "cachedstore_cache_requests_total", op="get",
                      result="hit")
        assert store.get("k") == b"v"
        assert sample(store.registry, "cachedstore_cache_requests_total", op="get",
                      result="hit") == hits + 1
        client.put(f"{prefix}k", "w")  # and the stream still delivers
        eventually(lambda: _cached(store, "k") == b"w", what="the event")
    client.close()


def test_pings_as_often_as_etcd_allows_are_accepted(
        etcd_factory: Callable[..., LocalEtcd], prefix: str) -> None:
    """``ping_interval`` equal to etcd's ``--grpc-keepalive-min-time`` (as the defaults are,
    5 s and 5 s, here 1 s and 1 s) is accepted: six PINGs, no restart. An acceptance test
    of the cadence against etcd's policy (it closes the connection at the third PING it
    finds early), not of the schedule, which tests/test_liveness.py pins down: on
    loopback a PING every ping_interval since the last one sent would pass too."""
    etcd = etcd_factory(extra_args=["--grpc-keepalive-min-time=1s"])
    with _store(etcd, prefix, ping_interval=1.0, stall_timeout=3.0) as store:
        store.get("k", default=None)
        eventually(lambda: _liveness(store, "ping") >= 6, timeout=30, what="6 PINGs")
        assert store._watcher.restarts == 0 and not store._watcher._pings_refused


def test_pings_etcd_refuses_turn_into_progress_requests(etcd: LocalEtcd, prefix: str
                                                        ) -> None:
    """PINGs more often than etcd allows (its default 5 s, against 0.2 s here): etcd closes
    the connection (GOAWAY "too_many_pings"); the store reconnects once and uses progress
    requests from then on, with no further restart, and stays coherent."""
    client = raw_client(etcd)
    with _store(etcd, prefix, ping_interval=0.2, stall_timeout=2.0,
                progress_interval=0.3) as store:
        store.get("k", default=None)
        watcher = store._watcher
        eventually(lambda: watcher._pings_refused, timeout=30, what="etcd to refuse PINGs")
        eventually(lambda: watcher.restarts == 1 and store.watch_healthy,
                   what="the stream back")
        restarts, pings = watcher.restarts, _liveness(store, "ping")
        progress = _liveness(store, "progress")
        eventually(lambda: _liveness(store, "progress") >= progress + 5, timeout=30,
                   what="5 progress requests")
        assert watcher.restarts == restarts == 1
        assert _liveness(store, "ping") == pings
        client.put(f"{prefix}k", "v")
        eventually(lambda: _cached(store, "k") == b"v", what="the event")
        assert store.get("k") == b"v"
    client.close()
