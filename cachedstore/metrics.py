"""Prometheus metrics of a store, sized for fleets of thousands of processes.

Every metric family is declared once per :class:`~prometheus_client.CollectorRegistry`
(stores that share a registry share the families, and their counts add up).

Series budget. A process that merely opened a store exports about 50 series and one that
has used every operation about 140 (``tests/test_metrics_series.py`` counts them):

* **Label children are created lazily**, the first time an operation, RPC method or restart
  reason is used, and then kept: ``metrics.hit["get"]`` is a plain dict lookup after the
  first one.
* **Children are cachedstore's own values, read by a collector at scrape time** (in one
  process; prometheus-client's own in its multiprocess mode): making one is one small
  object, not a ``labels()`` call. :mod:`cachedstore.metric_families` says how.
* **Cache hits are counted without a lock.** A hit is the hot path (a few hundred ns), and
  prometheus-client's ``Counter.inc()`` takes its value's lock (about as long as the rest of
  the hit). ``metrics.hit[op]`` is a :class:`HitCounter`: the store binds its ``tick``, an
  :func:`itertools.count`, once at construction and counts a hit with ``next(tick)`` (one C
  call, atomic under the GIL: exact counts, no lock). The collector of the registry's
  families adds the hits counted since the last collection to the exported child
  (``cachedstore_cache_requests_total{result="hit"}``) before every collection (a scrape,
  ``get_sample_value``), so what a scrape reads is exact as of the scrape. In
  prometheus-client's multiprocess mode, where samples are written to files as they happen
  and the worker that counts is not the process that scrapes, ``next(tick)`` increments the
  child directly (the lock is paid there).
* **Coarse buckets by default** (:data:`COARSE_BUCKETS`, five decades from 10 µs to 100 ms
  plus ``+Inf``); the fine layout (:data:`FULL_BUCKETS`, 22 bounds from 1 µs to 10 s) is a
  setting: ``make_metrics(registry, buckets="full")``. The layout is fixed per registry by
  the first store that uses it; asking for another one on the same registry is an error.
* **No ``_created`` series.** prometheus-client's own switch for that
  (``disable_created_metrics()`` / ``PROMETHEUS_DISABLE_CREATED_SERIES``) is process-wide and
  would also change the user's metrics in the same registry, so it is left alone: instead
  cachedstore's collector never makes them, or drops them from prometheus-client's
  families in multiprocess mode (:mod:`cachedstore.metric_families`). Other
  metrics in a shared registry (including the global ``REGISTRY``) keep theirs.
* etcd RPCs are counted by method and code, their durations in one histogram without labels.

Gauges that several stores (or, in prometheus-client's multiprocess mode, several processes)
contribute to are kept with ``inc``/``dec`` and aggregated with a ``multiprocess_mode`` that
adds them up (``livesum``); ``cachedstore_watch_up`` then counts healthy watches and
``cachedstore_watch_revision`` shows the newest revision (``livemax``).

Label values are bounded: the operation and method names below, gRPC code names and the
restart reasons. An unknown operation name is a ``KeyError``, never a new series. Key names
and values never appear in labels. Everything here is thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from .errors import InvalidInputError
from .metric_families import SPECS, HitCounter, families

__all__ = [
    "COARSE_BUCKETS",
    "FULL_BUCKETS",
    "METRIC_NAMES",
    "HitCounter",
    "NullMetrics",
    "StoreMetrics",
    "make_metrics",
    "resolve_buckets",
]

#: The default latency buckets, in seconds: one per decade from 10 µs (a cache hit is
#: below) to 100 ms (a blocking wait is usually above).
COARSE_BUCKETS: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 0.01, 0.1)
#: The fine layout (``buckets="full"``), from 1 µs (a cache hit) to 10 s (a long wait).
FULL_BUCKETS: tuple[float, ...] = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: The named layouts ``buckets=`` accepts.
BUCKET_LAYOUTS: dict[str, tuple[float, ...]] = {"coarse": COARSE_BUCKETS, "full": FULL_BUCKETS}

#: Read operations, whose requests are counted as cache hits or misses.
READ_OPS = ("get", "mget", "aget", "amget", "check", "wait")
#: Every operation whose duration is observed.
ALL_OPS = READ_OPS + ("set", "mset", "add", "compare_set", "append", "delete", "num_keys")
#: Why the watch stream had to be restarted.
RESTART_REASONS = (
    "disconnect", "compacted", "canceled", "stalled", "auth", "ended", "error", "rescoped",
    "rewound",
)

#: The names of every metric family cachedstore exports (without the _bucket/_sum suffixes).
METRIC_NAMES = tuple(spec.name for spec in SPECS)


def resolve_buckets(buckets: str | Sequence[float]) -> tuple[float, ...]:
    """A bucket layout: ``"coarse"``, ``"full"`` or increasing positive finite bounds.

    Raises:
        InvalidInputError: an unknown name, or bounds that are empty, not increasing,
            not positive or not finite (``+Inf`` is always added by prometheus-client).
    """
    if isinstance(buckets, str):
        try:
            return BUCKET_LAYOUTS[buckets]
        except KeyError:
            raise InvalidInputError(
                f"buckets must be one of {', '.join(BUCKET_LAYOUTS)} or a sequence of "
                f"bounds in seconds, got {buckets!r}") from None
    try:
        bounds = tuple(float(b) for b in buckets)
    except (TypeError, ValueError):
        raise InvalidInputError(f"buckets must be numbers of seconds, got {buckets!r}") from None
    if not bounds or any(not 0 < b < float("inf") for b in bounds) or any(
            a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise InvalidInputError(
            f"buckets must be increasing, positive and finite, got {list(bounds)}")
    return bounds


class _LazyChildren(dict[str, Any]):
    """``{name: label child}``, each child created on first lookup and then kept.

    Only names in ``allowed`` exist (anything else is a KeyError, not a new series). After
    the first lookup of a name, looking it up is a plain dict lookup. Thread-safe: two
    threads missing the same name at once get the same child (making one is idempotent).
    """

    def __init__(self, allowed: Iterable[str], make: Callable[[str], Any]) -> None:
        super().__init__()
        self._allowed = frozenset(allowed)
        self._make = make

    def __missing__(self, name: str) -> Any:
        if name not in self._allowed:
            raise KeyError(name)
        child = self[name] = self._make(name)
        return child


class StoreMetrics:
    """The label children one store updates, created on first use and then bound.

    Thread-safe (prometheus-client is). ``hit``, ``miss`` and ``duration`` map an operation
    name of :data:`READ_OPS` / :data:`ALL_OPS` to its child (``hit``: a :class:`HitCounter`);
    on a hot path bind ``metrics.hit_tick(op)`` once and count a hit with ``next()`` of it.

    Raises:
        InvalidInputError: ``buckets`` is not a layout (see :func:`resolve_buckets`), or the
            registry already holds cachedstore's families with another layout.
    """

    def __init__(self, registry: CollectorRegistry,
                 buckets: str | Sequence[float] | None = None) -> None:
        self.registry = registry
        f = self._f = families(registry, None if buckets is None else resolve_buckets(buckets),
                                COARSE_BUCKETS)
        child = f.child
        self.hit = _LazyChildren(READ_OPS, f.hit_counter)
        self.miss = _LazyChildren(READ_OPS, lambda op: child("cache_requests", op, "miss"))
        self.duration = _LazyChildren(ALL_OPS, lambda op: child("request_duration", op))
        self.restarts = _LazyChildren(RESTART_REASONS, lambda r: child("watch_restarts", r))
        self.entries = child("cache_entries")
        self.evictions = child("cache_evictions")
        self.events_put = child("watch_events", "put")
        self.events_delete = child("watch_events", "delete")
        self.watch_up = child("watch_up")
        self.watch_revision = child("watch_revision")
        self.watch_scopes = child("watch_scopes")
        self.quiet_refreshes = child("quiet_refreshes")
        self.watch_pings = child("watch_liveness", "ping")
        self.progress_requests = child("watch_liveness", "progress")
        self.waiters = child("waiters")
        self.fills_dropped = child("fills_dropped")
        self.stale_reads = child("stale_reads")
        self._rpc_counts: dict[tuple[str, str], Any] = {}
        self._rpc_duration = child("etcd_duration")

    @property
    def buckets(self) -> tuple[float, ...]:
        """The latency bucket bounds of this registry's histograms (without ``+Inf``)."""
        return self._f.buckets

    def hit_tick(self, op: str) -> Iterator[Any]:
        """An iterator whose ``next()`` counts one hit of ``op`` (no lock; see
        :class:`HitCounter`)."""
        counter: HitCounter = self.hit[op]
        return counter.tick

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """Record one etcd RPC (not on the hot path: a dict lookup per RPC is fine)."""
        child = self._rpc_counts.get((method, code))
        if child is None:
            child = self._rpc_counts[(method, code)] = self._f.child(
                "etcd_requests", method, code)
        child.inc()
        self._rpc_duration.observe(seconds)

    def restart(self, reason: str) -> None:
        """Count one watch restart; an unknown ``reason`` is counted as ``error``."""
        self.restarts[reason if reason in RESTART_REASONS else "error"].inc()


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
    buckets: tuple[float, ...] = ()

    def __init__(self) -> None:
        null = _Null()
        self.hit = dict.fromkeys(READ_OPS, null)
        self.miss = dict.fromkeys(READ_OPS, null)
        self.duration = dict.fromkeys(ALL_OPS, null)
        self.entries = self.evictions = self.events_put = self.events_delete = null
        self.watch_up = self.watch_revision = self.watch_scopes = self.waiters = null
        self.quiet_refreshes = self.watch_pings = self.progress_requests = null
        self.fills_dropped = self.stale_reads = null
        self.restarts = dict.fromkeys(RESTART_REASONS, null)

    def rpc(self, method: str, code: str, seconds: float) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass

    @staticmethod
    def hit_tick(op: str) -> Iterator[Any]:
        """An iterator whose ``next()`` does nothing (and allocates nothing)."""
        if op not in READ_OPS:
            raise KeyError(op)
        return itertools.repeat(None)


def make_metrics(registry: CollectorRegistry | None, enabled: bool = True, *,
                 buckets: str | Sequence[float] | None = None) -> StoreMetrics | NullMetrics:
    """The metrics of one store: on ``registry``, or on a new private registry when None.

    ``buckets``: ``"coarse"`` (the default, :data:`COARSE_BUCKETS`), ``"full"``
    (:data:`FULL_BUCKETS`) or explicit bounds in seconds. None means "whatever the registry
    already uses, coarse if it has none yet". Raises InvalidInputError as
    :class:`StoreMetrics` does.
    """
    if not enabled:
        if buckets is not None:
            resolve_buckets(buckets)  # bad input is reported even with metrics off
        return NullMetrics()
    return StoreMetrics(registry if registry is not None else CollectorRegistry(), buckets)
