"""Workload 1, hot key: ``get`` of one key that every reader wants, 1 and 8 threads.

cachedstore serves it from its cache (metrics on, off, and timing every hit); the other
contenders make one round trip per read. "cachedstore uncached read" is the same key read
through cachedstore's own connection layer (one gRPC Range, no cache), i.e. what a miss
costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import harness
import pytest

VALUE = b"v" * 64

CONTENDERS = [
    "dict.get (Python floor)",
    "LRUCache lookup under a lock (Python floor)",
    "prometheus Counter.inc() (Python floor)",
    "cachedstore cached",
    "cachedstore cached, metrics=False",
    "cachedstore cached, latency_sample_every=1",
    "cachedstore uncached read",
    "etcd3 get",
    "TCPStore get (in-process server, libuv)",
    "TCPStore get (in-process server, legacy)",
    "TCPStore get (server in another process)",
]
_TORCH_V2, _NOTE = harness.torch_v2_available()
if _TORCH_V2:
    CONTENDERS += [f"torch v2 EtcdStore get ({n} keys in dir)" for n in harness.scale().torch_dir_sizes]
else:
    harness.note(_NOTE)


def make_getters(env: harness.Env, contender: str, n: int) -> list[Callable[[], Any]]:
    """``n`` callables (one per thread) that each read the hot key once and return it."""
    prefix = env.unique("hot")
    if contender.startswith("dict.get"):
        d = {"hot": VALUE}
        return [functools.partial(d.get, "hot")] * n
    if contender.startswith("LRUCache"):
        import threading

        from cachetools import LRUCache

        lru: LRUCache[str, bytes] = LRUCache(1024)
        lru["hot"] = VALUE
        lock = threading.Lock()

        def locked_lookup() -> bytes:
            with lock:
                return lru["hot"]

        return [locked_lookup] * n
    if contender.startswith("prometheus"):
        from prometheus_client import CollectorRegistry, Counter

        inc = Counter("floor_total", "floor", ["op"], registry=CollectorRegistry()).labels(
            "get").inc

        def count() -> bytes:
            inc()
            return VALUE

        return [count] * n
    if contender.startswith("cachedstore"):
        kwargs: dict[str, Any] = {"prefix": prefix}
        if "metrics=False" in contender:
            kwargs["metrics"] = False
        store = env.store(**kwargs)
        if "latency_sample_every=1" in contender:
            store._sample_every = 1  # time every call (config.LATENCY_SAMPLE_EVERY: 1 in 64)
        store.set("hot", VALUE)
        if "uncached" in contender:
            from etcd3 import etcdrpc

            conn = store._conn
            request = etcdrpc.RangeRequest(key=store.prefix + b"hot")

            def uncached() -> bytes:
                return conn.call("range", request, deadline=conn.deadline()).kvs[0].value

            return [uncached] * n
        return [functools.partial(store.get, "hot")] * n
    if contender.startswith("etcd3"):
        client = env.etcd3()
        key = prefix + "hot"
        client.put(key, VALUE)
        return [lambda: client.get(key)[0]] * n
    if contender.startswith("TCPStore"):
        remote = "another process" in contender
        clients = [env.tcp_store(remote, libuv="legacy" not in contender) for _ in range(n)]
        key = prefix + "hot"
        clients[0].set(key, VALUE)
        return [functools.partial(c.get, key) for c in clients]
    if contender.startswith("torch v2"):
        dir_size = int(contender.split("(")[1].split()[0])
        stores = [env.torch_v2_store(prefix) for _ in range(n)]
        for i in range(dir_size - 1):
            stores[0].set(f"other{i}", VALUE)
        stores[0].set("hot", VALUE)
        return [functools.partial(s.get, "hot") for s in stores]
    raise AssertionError(contender)


@pytest.mark.parametrize("contender", CONTENDERS)
def test_hot_get_1_thread(benchmark: Any, env: harness.Env, record: Any, contender: str) -> None:
    (get,) = make_getters(env, contender, 1)
    value, median = harness.bench_median(benchmark, get)
    assert value == VALUE
    record(f"hot_key/1/{contender}", contender=contender, threads=1, median_s=median)


@pytest.mark.parametrize("contender", CONTENDERS)
def test_hot_get_8_threads(benchmark: Any, env: harness.Env, record: Any,
                           scale: harness.Scale, contender: str) -> None:
    threads = 8
    getters = make_getters(env, contender, threads)
    assert all(g() == VALUE for g in getters)
    single = harness.per_call_median(getters[0], rounds=3, min_seconds=0.002)
    count = max(3, int(scale.thread_round_seconds / single / threads))
    with harness.gang(getters, name="bench-hot") as g:
        g.run(count)  # warm-up
        wall = harness.bench_rounds(benchmark, g.run, (count,), rounds=scale.thread_rounds)
    record(f"hot_key/8/{contender}", contender=contender, threads=threads,
           gets_per_thread=count, round_median_s=wall,
           # Inverse throughput: the process-wide cost of one get with 8 threads reading.
           median_s=wall / (threads * count),
           # What each thread waits per get while all 8 read at once.
           per_thread_latency_s=wall / count,
           throughput_per_s=threads * count / wall)
