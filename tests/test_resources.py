"""Resources: the cache stays within ``cache_size`` (entries and RSS), and ``close()`` leaves
no thread, no file descriptor and no open gRPC channel behind."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import psutil
import pytest
from etcd3 import etcdrpc

from cachedstore import EtcdStore, StoreClosedError
from cachedstore.server import LocalEtcd

MiB = 1 << 20


def _rss() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MiB


def _fill(server: LocalEtcd, prefix: str, n: int, value: bytes) -> list[str]:
    """Write ``n`` keys under ``prefix`` in Txns of 128 puts (raw gRPC, not the store)."""
    names = [f"k{i:07d}" for i in range(n)]
    channel = grpc.insecure_channel(server.endpoint)
    try:
        kv = etcdrpc.KVStub(channel)
        for start in range(0, n, 128):
            ops = [etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
                key=(prefix + name).encode(), value=value)) for name in names[start:start + 128]]
            kv.Txn(etcdrpc.TxnRequest(success=ops), timeout=60)
    finally:
        channel.close()
    return names


def _read_all(store: EtcdStore, names: list[str], chunk: int, bound: int) -> int:
    """Read every name once (mget in chunks); return the most entries seen at any time."""
    most = 0
    for start in range(0, len(names), chunk):
        values = store.mget(names[start:start + chunk])
        assert all(v is not None for v in values)
        entries = store.stats()["entries"]
        assert entries <= bound, f"{entries} entries with cache_size={bound}"
        most = max(most, entries)
    return most


def _bounded_memory(server: LocalEtcd, n: int, cache_size: int, value_size: int,
                    chunk: int) -> tuple[float, float]:
    """Read ``n`` distinct keys through a store with ``cache_size``; returns (RSS growth
    after the cache filled, RSS at the end) in MiB, after checking the entry bound."""
    prefix = "/bounded/"
    started = time.monotonic()
    names = _fill(server, prefix, n, b"v" * value_size)
    filled = time.monotonic()
    with EtcdStore(endpoints=[server.endpoint], prefix=prefix, cache_size=cache_size) as store:
        warm = names[:2 * cache_size]  # fill the cache (and Python's allocator) first
        _read_all(store, warm, chunk, cache_size)
        before = _rss()
        most = _read_all(store, names[len(warm):], chunk, cache_size)
        after = _rss()
        assert most == cache_size and store.stats()["entries"] == cache_size
        registry = store.registry
        assert registry is not None
        assert registry.get_sample_value("cachedstore_cache_entries") == cache_size
        assert registry.get_sample_value("cachedstore_cache_evictions_total") == n - cache_size
    print(f"\n{n:,} keys of {value_size} B, cache_size={cache_size:,}: RSS {before:.1f} -> "
          f"{after:.1f} MiB (+{after - before:.1f}); write {filled - started:.1f} s, "
          f"read {time.monotonic() - filled:.1f} s")
    return after - before, after


@pytest.mark.timeout(120)
def test_memory_stays_bounded(etcd_factory: Callable[..., LocalEtcd]) -> None:
    """20,000 distinct 1 KiB keys through cache_size=1,000: the entry count never passes the
    bound and RSS does not grow, while the same reads unbounded grow it by ~20 MiB."""
    server = etcd_factory()
    growth, _ = _bounded_memory(server, 20_000, 1_000, 1024, 500)
    assert growth < 5.0, f"RSS grew {growth:.1f} MiB reading through a 1,000-entry cache"
    # Control: the measurement can see the difference.
    names = [f"k{i:07d}" for i in range(20_000)]
    with EtcdStore(endpoints=[server.endpoint], prefix="/bounded/",
                   cache_size=100_000) as unbounded:
        before = _rss()
        _read_all(unbounded, names, 500, 100_000)
        control = _rss() - before
        assert unbounded.stats()["entries"] == 20_000
    print(f"control without a bound: +{control:.1f} MiB")
    assert control > growth + 10.0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_million_keys_stay_bounded(etcd_factory: Callable[..., LocalEtcd]) -> None:
    """By hand: ``pytest -m slow tests/test_resources.py -s`` (1,000,000 keys, 10,000
    entries)."""
    server = etcd_factory(extra_args=["--quota-backend-bytes=8589934592"])
    growth, _ = _bounded_memory(server, 1_000_000, 10_000, 100, 1000)
    assert growth < 20.0, f"RSS grew {growth:.1f} MiB reading 1,000,000 keys"


# --------------------------------------------------------------------- close()


def _channels() -> list[grpc.Channel]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is grpc._channel.Channel]


def _refuse_calls(channels: list[grpc.Channel]) -> None:
    """Each of ``channels`` is closed: a new call on it raises (and no reference to one
    outlives this call)."""
    for channel in channels:
        with pytest.raises(ValueError, match="closed channel"):
            channel.unary_unary("/etcdserverpb.KV/Range")(b"", timeout=1)


def _settle(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _exercise(store: EtcdStore) -> None:
    """Touch every part that owns a resource: channel, watch, executor, waiters."""
    store.set("a", "1")
    assert store.get("a") == b"1" and store.mget(["a", "b"], default=None) == [b"1", None]
    assert store.add("n", 1) >= 1
    assert asyncio.run(store.aget("a")) == b"1"
    assert asyncio.run(store.aget("absent", default=None)) is None  # on the executor


@pytest.fixture
def warmed(etcd: LocalEtcd, prefix: str) -> Iterator[None]:
    # gRPC keeps process-wide state (pollers, timer threads, fds) created with the first
    # channel ever; one store of each transport opened and closed first puts that out of
    # the measurement.
    for transport in _TRANSPORTS:
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                       unary_transport=transport, watch_transport=transport) as store:
            _exercise(store)
    yield


#: The stores' transports, by cycle: the wire's (the default: no grpcio channel at all),
#: and grpcio's (one channel, which close() must close).
_TRANSPORTS = ("wire", "grpc")


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("warmed")
def test_close_leaves_no_thread_fd_or_channel(etcd: LocalEtcd, prefix: str) -> None:
    process = psutil.Process()
    assert _settle(lambda: not [t for t in threading.enumerate()
                                if t.name.startswith("cachedstore-")])
    threads_before = set(threading.enumerate())
    channels_before = {id(c) for c in _channels()}
    fds_before = process.num_fds()
    fds_after = []
    for cycle in range(6):
        transport = _TRANSPORTS[cycle % 2]
        store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix,
                          unary_transport=transport, watch_transport=transport)
        try:
            _exercise(store)
            names = {t.name for t in threading.enumerate()}
            assert any(n.startswith("cachedstore-watch-") for n in names)
            assert any(n.startswith("cachedstore-aio-") for n in names)
            mine = [c for c in _channels() if id(c) not in channels_before]
            if transport == "grpc":
                assert mine, "the store's channel was not found"
            else:
                assert not mine, "a store on the wire transports opened a grpcio channel"
        except BaseException:
            store.close()  # no store of a failed cycle outlives the test
            raise
        blocked: list[BaseException] = []

        def wait_forever(s: EtcdStore = store, out: list[BaseException] = blocked) -> None:
            try:
                s.get("never", timeout=30)
            except BaseException as exc:  # recorded for the assertion
                out.append(exc)

        waiter = threading.Thread(target=wait_forever, name="resource-test-waiter")
        waiter.start()
        assert _settle(lambda s=store: s.stats()["waiters"] == 1)
        store.close()
        waiter.join(5)
        assert not waiter.is_alive() and isinstance(blocked[0], StoreClosedError)
        # No thread: every thread that exists now existed before the store.
        assert _settle(lambda: set(threading.enumerate()) <= threads_before), \
            [t.name for t in set(threading.enumerate()) - threads_before]
        # No open channel: each one the store created refuses new calls.
        _refuse_calls(mine)
        del mine, store
        assert _settle(lambda: {id(c) for c in _channels()} <= channels_before), \
            "a channel of a closed store is still referenced"
        # No descriptor: back to the count from before (sockets close asynchronously).
        assert _settle(lambda: process.num_fds() <= fds_before), \
            f"cycle {cycle}: {process.num_fds()} fds open, {fds_before} before"
        fds_after.append(process.num_fds())
    print(f"\nfds before {fds_before}, after each of 6 open/close cycles: {fds_after}")
