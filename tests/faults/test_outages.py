"""One etcd member, broken on purpose: SIGKILL and restart, connection resets during
compaction, a silent partition, and the opt-in bounded-staleness mode.

Every store here talks to a private etcd (``etcd_factory``), mostly through a
:class:`~tests.faults.proxy.FaultProxy` that cuts or stalls the path on demand. Waits are
polls with a deadline, never fixed sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import etcd3
import pytest

from cachedstore import EtcdConnectionError, EtcdStore, StoreConfig, StoreTimeoutError
from cachedstore.server import LocalEtcd

from . import follows_by_watch, restarts, sample, split, wait_until
from .proxy import FaultProxy

pytestmark = pytest.mark.timeout(90)

KEYS = [f"k{i}" for i in range(8)]


def _client(server: LocalEtcd) -> etcd3.Etcd3Client:
    host, port = split(server.endpoint)
    return etcd3.client(host, port, timeout=5)


@pytest.fixture
def server(etcd_factory: Callable[..., LocalEtcd]) -> LocalEtcd:
    # PINGs as often as the tests' short stall timeouts need (etcd's default: 5 s apart).
    return etcd_factory(extra_args=["--grpc-keepalive-min-time=100ms"])


@pytest.fixture
def proxy(server: LocalEtcd) -> Iterator[FaultProxy]:
    with FaultProxy(server.endpoint, max_lifetime=120) as p:
        yield p


def _store(endpoint: str, prefix: str, **kwargs: Any) -> EtcdStore:
    kwargs.setdefault("request_timeout", 1.0)
    kwargs.setdefault("connect_timeout", 5.0)
    return EtcdStore(endpoints=[endpoint], prefix=prefix, **kwargs)


def test_sigkill_and_restart_same_store_recovers(server: LocalEtcd, prefix: str) -> None:
    """etcd SIGKILLed and restarted on the same data: the same store object fails clearly
    during the outage and recovers by itself (no python3-etcd3 "failed node" lock-out)."""
    with _store(server.endpoint, prefix) as store:
        store.set("k", "before")
        assert store.get("k") == b"before"
        server.kill()
        wait_until(lambda: not store.watch_healthy, 5, "the watch to notice the kill")
        for name in ("k", "never-cached"):  # a cached key is not served while down
            with pytest.raises(EtcdConnectionError) as info:
                store.get(name)
            assert not isinstance(info.value, ValueError)
        with pytest.raises(EtcdConnectionError):
            store.set("k", "during")
        server.restart()  # same data dir, same ports
        with closing(_client(server)) as writer:
            writer.put(prefix + "k", "after")
            wait_until(lambda: _get_or_none(store, "k") == b"after", 15,
                       "the store to see a write made after the restart")
            wait_until(lambda: store.watch_healthy, 15, "the watch to come back")
            follows_by_watch(store, lambda v: writer.put(prefix + "k", v), "k", b"after",
                             "followed")
            store.set("mine", "1")
            assert store.get("mine") == b"1"
        assert restarts(store, "disconnect") >= 1


def _get_or_none(store: EtcdStore, name: str) -> bytes | None:
    try:
        return store.get(name, None)  # type: ignore[no-any-return]
    except EtcdConnectionError:
        return None


class _Reader(threading.Thread):
    """Reads every key in a loop and records (start, end, name, result-or-exception)."""

    def __init__(self, store: EtcdStore, names: list[str]) -> None:
        super().__init__(name="fault-test-reader", daemon=True)
        self.store, self.names = store, names
        self.stop = threading.Event()
        self.log: list[tuple[float, float, str, object]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for name in self.names:
                started = time.monotonic()
                try:
                    result: object = self.store.get(name, None)
                except EtcdConnectionError as exc:
                    result = exc
                self.log.append((started, time.monotonic(), name, result))

    def __enter__(self) -> _Reader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(10)


def test_reset_during_writes_and_compaction_serves_nothing_stale(
        server: LocalEtcd, proxy: FaultProxy, prefix: str) -> None:
    """The store's connection is reset while another client writes and etcd compacts past
    the store's last revision: during the outage reads fail (never the cached value); after
    healing the store resyncs (restart reason ``compacted``) and serves current values."""
    with _store(proxy.endpoint, prefix, request_timeout=0.5) as store, \
            closing(_client(server)) as writer:
        for name in KEYS:
            store.set(name, "old")
        assert store.mget(KEYS) == [b"old"] * len(KEYS)
        assert store.stats()["entries"] == len(KEYS)
        proxy.reset(refuse=True)
        wait_until(lambda: not store.watch_healthy, 5, "the watch to notice the reset")
        with _Reader(store, KEYS) as reader:
            wait_until(lambda: len(reader.log) >= 2 * len(KEYS), 20, "reads during the outage")
            for i, name in enumerate(KEYS):
                if i % 3 == 0:
                    writer.delete(prefix + name)
                else:
                    writer.put(prefix + name, f"new{i}")
            compacted = server.compact()
            assert compacted > store.watch_revision
            outage_end = len(reader.log)
            proxy.heal()
            wait_until(lambda: restarts(store, "compacted") >= 1, 15,
                       "the watch to report the compaction")
            wait_until(lambda: store.watch_healthy, 15, "the watch to resync")
            healed = len(reader.log)
            wait_until(lambda: len(reader.log) >= healed + 2 * len(KEYS), 10,
                       "reads after healing")
        during, after = reader.log[:outage_end], reader.log[outage_end:]
        # While cut off: nothing from the cache, every read is a clear ConnectionError.
        assert during and all(isinstance(r, EtcdConnectionError) for *_, r in during)
        # After healing: a failure while reconnecting, or the current value -- never "old".
        current = {n: (None if i % 3 == 0 else f"new{i}".encode()) for i, n in enumerate(KEYS)}
        for _, _, name, result in after:
            if not isinstance(result, EtcdConnectionError):
                assert result == current[name], (name, result)
        assert store.mget(KEYS, default=None) == [current[n] for n in KEYS]
        follows_by_watch(store, lambda v: writer.put(prefix + "k1", v), "k1", current["k1"],
                         "followed")


@pytest.mark.parametrize("liveness", ["ping", "progress"])
def test_silent_partition_detected_within_bound(server: LocalEtcd, proxy: FaultProxy,
                                                prefix: str, liveness: str) -> None:
    """A stalled path (bytes held, nothing closed) is detected within the documented bound:
    ``stall_timeout`` for a stream that PINGs (the default); for one of progress requests
    ``+ progress_interval`` if it has not answered one yet, as here (it is probed first).
    Then cached values are no longer served; after healing the store resumes. Default
    bound <= 10 s."""
    defaults = StoreConfig()
    assert defaults.ping_interval < defaults.stall_timeout <= 10.0
    assert defaults.stall_timeout + defaults.progress_interval <= 10.0
    stall_timeout, progress_interval = 1.5, 0.5
    ping_interval = 0.5 if liveness == "ping" else 0.0
    bound = stall_timeout + (progress_interval if liveness == "progress" else 0.0)
    with _store(proxy.endpoint, prefix, stall_timeout=stall_timeout,
                progress_interval=progress_interval, ping_interval=ping_interval) as store, \
            closing(_client(server)) as writer:
        store.set("k", "v1")
        assert store.get("k") == b"v1"
        wait_until(lambda: store.watch_healthy, 5, "a healthy watch")
        if liveness == "ping":  # its first check is a progress request; then PINGs
            wait_until(lambda: sample(store, "cachedstore_watch_liveness_requests_total",
                                      {"kind": "ping"}) >= 1, 10, "the first PING")
        started = time.monotonic()
        proxy.stall()
        detected = wait_until(lambda: not store.watch_healthy, bound + 5,
                              "the stall to be detected")
        # The documented bound, with 1 s of slack for a loaded 2-core CI machine.
        assert detected <= bound + 1.0, f"stall detected after {detected:.2f} s"
        writer.put(prefix + "k", "v2")  # etcd moves on; the store cannot see it
        for _ in range(2):
            try:
                value = store.get("k")
            except EtcdConnectionError:
                continue
            assert value == b"v2"  # never the cached v1
        assert restarts(store, "stalled") >= 1
        kinds = {k: sample(store, "cachedstore_watch_liveness_requests_total", {"kind": k})
                 for k in ("ping", "progress")}
        assert (kinds["ping"] > 0) == (liveness == "ping"), kinds
        assert kinds["progress"] > 0 or liveness == "ping", kinds
        proxy.heal()
        wait_until(lambda: store.watch_healthy, 20, "the watch to resume after healing")
        wait_until(lambda: _get_or_none(store, "k") == b"v2", 10, "the current value")
        follows_by_watch(store, lambda v: writer.put(prefix + "k", v), "k", b"v2", "v3")
    print(f"\nsilent partition detected after {detected:.3f} s "
          f"(bound {bound:g} s); {time.monotonic() - started:.1f} s in all")


def test_max_staleness_serves_cached_values_for_a_bounded_time(
        server: LocalEtcd, proxy: FaultProxy, prefix: str) -> None:
    """Opt-in ``max_staleness``: during an outage cached values are served for at most that
    long after the last watch contact, each counted in ``cachedstore_stale_reads_total``;
    a default store sharing the outage serves nothing stale."""
    max_staleness = 1.5
    assert StoreConfig().max_staleness is None  # strict by default
    with _store(proxy.endpoint, prefix, max_staleness=max_staleness,
                request_timeout=0.3) as lenient, \
            _store(proxy.endpoint, prefix, request_timeout=0.3) as strict:
        lenient.set("k", "cached")
        assert lenient.get("k") == b"cached" and strict.get("k") == b"cached"
        proxy.reset(refuse=True)
        cut = time.monotonic()  # no message from etcd can arrive after this
        wait_until(lambda: not lenient.watch_healthy and not strict.watch_healthy, 5,
                   "both watches to notice the outage")
        served: list[float] = []
        failed_at = None
        watcher = lenient._watcher
        assert watcher is not None
        last_contact = watcher.last_contact  # what max_staleness counts from
        assert last_contact <= cut + 0.05  # (+ a message already being read at the RST)
        deadline = cut + max_staleness + 10
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                value = lenient.get("k")
            except EtcdConnectionError:
                failed_at = started
                break
            assert value == b"cached"
            served.append(started)
        assert served, "no stale read was served within max_staleness"
        assert failed_at is not None, "stale values served without end"
        with pytest.raises(EtcdConnectionError):  # the default store serves nothing stale
            strict.get("k")
        assert max(served) <= last_contact + max_staleness
        assert sample(lenient, "cachedstore_stale_reads_total") == len(served)
        assert sample(strict, "cachedstore_stale_reads_total") == 0
        proxy.heal()
        wait_until(lambda: lenient.watch_healthy, 15, "the watch to come back")
        assert lenient.get("k") == b"cached"
        assert sample(lenient, "cachedstore_stale_reads_total") == len(served)


@pytest.mark.parametrize("scope", ["touched", "prefix"])
def test_blocking_reads_that_meet_an_outage_end_as_timeouts(
        server: LocalEtcd, proxy: FaultProxy, prefix: str, scope: str) -> None:
    """``get``, ``mget`` and ``wait`` with a timeout, of keys the cache cannot answer,
    while every connection to etcd is refused: each raises StoreTimeoutError (a
    TimeoutError) once its timeout passes, its ``__cause__`` the EtcdConnectionError, as
    the docstrings promise; not the EtcdConnectionError of their first read (``mget`` and
    ``wait`` raised that at once, before they waited)."""
    with _store(proxy.endpoint, prefix, watch_scope=scope) as store:
        store.set("present", "1")
        proxy.reset(refuse=True)
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("k", timeout=0.5),
            "mget": lambda: store.mget(["present", "k"], timeout=0.5),
            "wait": lambda: store.wait(["k", "present"], timeout=0.5),
        }
        for name, call in calls.items():
            with pytest.raises(StoreTimeoutError) as caught:
                call()
            assert isinstance(caught.value.__cause__, EtcdConnectionError), name
        proxy.heal()


def test_a_blocking_mget_in_an_outage_serves_what_max_staleness_allows(
        server: LocalEtcd, proxy: FaultProxy, prefix: str) -> None:
    """A blocking ``mget`` (with a default) whose read met an outage serves the keys its
    cache may still serve, a stale entry ``max_staleness`` allows included, as ``get``
    does; only the others wait, and end with the default at the deadline."""
    with _store(proxy.endpoint, prefix, max_staleness=60.0) as store:
        store.set("cached", "v")
        assert store.get("cached") == b"v"
        proxy.reset(refuse=True)
        wait_until(lambda: not store.watch_healthy, 5, "the watch to notice the outage")
        assert store.get("cached", timeout=0.5) == b"v"  # what get serves ...
        assert store.mget(["cached", "uncached"], None, timeout=0.5) == [b"v", None]
        proxy.heal()
