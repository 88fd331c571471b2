"""Prometheus metrics of a store.

Every metric is declared once per :class:`~prometheus_client.CollectorRegistry` (stores that
share a registry share the families and their counts add up) and every label child the hot
path touches is bound once, in :class:`StoreMetrics`, so a cache hit costs one
``Counter.inc()`` and no ``labels()`` lookup.

Gauges that several stores (or, in prometheus-client's multiprocess mode, several processes)
contribute to are kept with ``inc``/``dec`` and aggregated with a ``multiprocess_mode`` that
adds them up (``livesum``); ``cachedstore_watch_up`` then counts healthy watches and
``cachedstore_watch_revision`` shows the newest revision (``livemax``).

Label values are bounded: operation and method names, gRPC code names and restart reasons.
Key names and values never appear in labels.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["METRIC_NAMES", "NullMetrics", "StoreMetrics", "make_metrics"]

#: Latency buckets, in seconds, from 1 µs (a cache hit) to 10 s (a long blocking wait).
LATENCY_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

#: Read operations, whose requests are counted as cache hits or misses.
READ_OPS = ("get", "mget", "aget", "amget", "check", "wait")
#: Every operation whose duration is observed.
ALL_OPS = READ_OPS + ("set", "mset", "add", "compare_set", "append", "delete", "num_keys")
#: Why the watch stream had to be restarted.
RESTART_REASONS = (
    "disconnect", "compacted", "canceled", "stalled", "auth", "ended", "error",
)


class _Families:
    """The metric families of one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        kw: dict[str, Any] = {"registry": registry}
        self.cache_requests = Counter(
            "cachedstore_cache_requests_total",
            "Keys requested from the cache, by operation and result (mget counts each key).",
            ["op", "result"], **kw)
        self.request_duration = Histogram(
            "cachedstore_request_duration_seconds",
            "Duration of store operations as the caller sees them.",
            ["op"], buckets=LATENCY_BUCKETS, **kw)
        self.etcd_requests = Counter(
            "cachedstore_etcd_requests_total",
            "RPCs sent to etcd, by method and gRPC status code (ok on success).",
            ["method", "code"], **kw)
        self.etcd_duration = Histogram(
            "cachedstore_etcd_request_duration_seconds",
            "Duration of RPCs sent to etcd.",
            ["method"], buckets=LATENCY_BUCKETS, **kw)
        self.cache_entries = Gauge(
            "cachedstore_cache_entries",
            "Entries held in the cache (values and absent-key markers).",
            multiprocess_mode="livesum", **kw)
        self.cache_evictions = Counter(
            "cachedstore_cache_evictions_total",
            "Entries evicted to keep the cache within its size.", **kw)
        self.watch_events = Counter(
            "cachedstore_watch_events_total",
            "Events received on the watch stream, by type.",
            ["type"], **kw)
        self.watch_restarts = Counter(
            "cachedstore_watch_restarts_total",
            "Times the watch stream had to be restarted, by reason.",
            ["reason"], **kw)
        self.watch_up = Gauge(
            "cachedstore_watch_up",
            "1 while the watch is healthy and the cache may be served (summed over stores).",
            multiprocess_mode="livesum", **kw)
        self.watch_revision = Gauge(
            "cachedstore_watch_revision",
            "Newest etcd revision the watch has confirmed.",
            multiprocess_mode="livemax", **kw)
        self.waiters = Gauge(
            "cachedstore_waiters",
            "Blocked gets and waits right now.",
            multiprocess_mode="livesum", **kw)
        self.fills_dropped = Counter(
            "cachedstore_fills_dropped_total",
            "Read-through results refused by the revision gate (a newer write was known).",
            **kw)
        self.stale_reads = Counter(
            "cachedstore_stale_reads_total",
            "Reads served from the cache while the watch was down (max_staleness mode).",
            **kw)


#: The names of every metric family cachedstore exports (without the _bucket/_sum suffixes).
METRIC_NAMES = (
    "cachedstore_cache_requests_total",
    "cachedstore_request_duration_seconds",
    "cachedstore_etcd_requests_total",
    "cachedstore_etcd_request_duration_seconds",
    "cachedstore_cache_entries",
    "cachedstore_cache_evictions_total",
    "cachedstore_watch_events_total",
    "cachedstore_watch_restarts_total",
    "cachedstore_watch_up",
    "cachedstore_watch_revision",
    "cachedstore_waiters",
    "cachedstore_fills_dropped_total",
    "cachedstore_stale_reads_total",
)

_families_lock = threading.Lock()
_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = (
    weakref.WeakKeyDictionary()
)


def _families(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        families = _families_by_registry.get(registry)
        if families is None:
            families = _families_by_registry[registry] = _Families(registry)
        return families


class StoreMetrics:
    """The bound label children one store updates. Thread-safe (prometheus-client is)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        f = self._f = _families(registry)
        self.hit = {op: f.cache_requests.labels(op, "hit") for op in READ_OPS}
        self.miss = {op: f.cache_requests.labels(op, "miss") for op in READ_OPS}
        self.duration = {op: f.request_duration.labels(op) for op in ALL_OPS}
        self.entries = f.cache_entries
        self.evictions = f.cache_evictions
        self.events_put = f.watch_events.labels("put")
        self.events_delete = f.watch_events.labels("delete")
        self.restarts = {r: f.watch_restarts.labels(r) for r in RESTART_REASONS}
        self.watch_up = f.watch_up
        self.watch_revision = f.watch_revision
        self.waiters = f.waiters
        self.fills_dropped = f.fills_dropped
        self.stale_reads = f.stale_reads
        self._rpc_counts: dict[tuple[str, str], Any] = {}
        self._rpc_durations: dict[str, Any] = {}

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """Record one etcd RPC (not on the hot path: a dict lookup per RPC is fine)."""
        child = self._rpc_counts.get((method, code))
        if child is None:
            child = self._rpc_counts[(method, code)] = self._f.etcd_requests.labels(method, code)
        child.inc()
        hist = self._rpc_durations.get(method)
        if hist is None:
            hist = self._rpc_durations[method] = self._f.etcd_duration.labels(method)
        hist.observe(seconds)

    def restart(self, reason: str) -> None:
        child = self.restarts.get(reason)
        if child is None:
            child = self.restarts[reason] = self._f.watch_restarts.labels(reason)
        child.inc()


class _Null:
    """Stands in for a counter, gauge or histogram child when metrics are off."""

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class NullMetrics:
    """The same surface as :class:`StoreMetrics`, doing nothing (``EtcdStore(metrics=False)``)."""

    registry = None

    def __init__(self) -> None:
        null = _Null()
        self.hit = dict.fromkeys(READ_OPS, null)
        self.miss = dict.fromkeys(READ_OPS, null)
        self.duration = dict.fromkeys(ALL_OPS, null)
        self.entries = self.evictions = self.events_put = self.events_delete = null
        self.watch_up = self.watch_revision = self.waiters = null
        self.fills_dropped = self.stale_reads = null
        self.restarts = dict.fromkeys(RESTART_REASONS, null)

    def rpc(self, method: str, code: str, seconds: float) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass


def make_metrics(registry: CollectorRegistry | None, enabled: bool = True
                 ) -> StoreMetrics | NullMetrics:
    """The metrics of one store: on ``registry``, or on a new private registry when None."""
    if not enabled:
        return NullMetrics()
    return StoreMetrics(registry if registry is not None else CollectorRegistry())


def exported_names(registry: CollectorRegistry) -> Iterable[str]:
    """Names of the cachedstore families present in ``registry`` (for tests and docs)."""
    for family in registry.collect():
        if family.name.startswith("cachedstore_"):
            yield family.name
