"""Workload 4, fan-out wait: many threads blocked on distinct keys, one writer publishes them.

Measured: time from the writer's first put to the last reader woken (and from its last
put's acknowledgement), the wake-up spread, and etcd's own counters: watch streams opened
(``grpc_server_started_total{grpc_method="Watch"}``), watchers open while blocked, and the
requests etcd served while the readers were blocking and while they were woken.

- cachedstore: ``get(key, timeout=…)`` on one store; the writer is a raw etcd3 client
  putting the keys in Txns of 128.
- TCPStore (server in another process): one client per thread (a client serves one call
  at a time); the writer publishes with ``multi_set``. Fewer threads: on a machine without
  DNS every TCPStore client construction spends ~150 ms in a reverse lookup of its peer.
- torch v2 EtcdStore: one store per thread (fewer threads: every waiter long-polls its own
  v2 watch and re-reads the whole directory on every write under it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import harness
import pytest

VALUE = b"f" * 32
_TORCH_V2, _ = harness.torch_v2_available()


@contextlib.contextmanager
def small_stacks() -> Iterator[None]:
    old = threading.stack_size(512 * 1024)
    try:
        yield
    finally:
        threading.stack_size(old)


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


CONTENDERS = ["cachedstore", "TCPStore (server in another process)"]
if _TORCH_V2:
    CONTENDERS.append("torch v2 EtcdStore")


@pytest.mark.parametrize("contender", CONTENDERS)
def test_fanout(benchmark: Any, env: harness.Env, record: Any, scale: harness.Scale,
                contender: str) -> None:
    prefix = env.unique("fanout")
    n = scale.fanout_threads if contender == "cachedstore" else scale.other_fanout_threads
    keys = [f"k{i:05d}" for i in range(n)]
    woken: list[float | None] = [None] * n
    errors: list[BaseException] = []
    c0 = env.counters()

    if contender == "cachedstore":
        store = env.store(prefix=prefix, cache_size=4 * n)
        readers: list[Any] = [store] * n
        blocked: Callable[[], bool] = lambda: store._cache.n_waiters >= n  # noqa: E731
        client = env.etcd3()

        def publish() -> None:
            for start in range(0, n, 128):
                ops = [client.transactions.put(prefix + k, VALUE) for k in keys[start:start + 128]]
                client.transaction(compare=[], success=ops, failure=[])
    elif contender.startswith("TCPStore"):
        readers = [env.tcp_store(True) for _ in range(n)]
        writer = env.tcp_store(True)
        keys = [prefix + k for k in keys]
        blocked = lambda: True  # noqa: E731  (no way to ask; see the sleep below)

        def publish() -> None:
            writer.multi_set(keys, [VALUE] * n)
    else:
        readers = [env.torch_v2_store(prefix, timeout=120) for _ in range(n)]
        writer_v2 = env.torch_v2_store(prefix, timeout=120)
        writer_v2.set("present", VALUE)  # the directory exists: readers read, then watch
        c0 = env.counters()
        # Every reader reads the directory once, then long-polls a watch on it (etcd counts
        # a long poll when it ends, so only the reads can be seen here).
        blocked = lambda: (env.counters().get("v2 GET", 0)  # noqa: E731
                           - c0.get("v2 GET", 0)) >= n

        def publish() -> None:
            for k in keys:
                writer_v2.set(k, VALUE)

    def read(i: int) -> None:
        try:
            if contender == "cachedstore":
                readers[i].get(keys[i], timeout=120)
            else:
                readers[i].get(keys[i])
            woken[i] = time.perf_counter()
        except BaseException as exc:
            errors.append(exc)

    with small_stacks():
        threads = [threading.Thread(target=read, args=(i,), name=f"bench-fanout-{i}", daemon=True)
                   for i in range(n)]
        for t in threads:
            t.start()
    _wait_until(lambda: blocked() or bool(errors), 60, f"{contender}: readers did not block")
    if contender != "cachedstore":
        time.sleep(0.5)  # benchmark only: give every reader time to reach the server
    assert not errors, errors[0]
    c1 = env.counters()
    stamps: dict[str, float] = {}

    def go() -> None:
        stamps["t0"] = time.perf_counter()
        publish()
        stamps["acked"] = time.perf_counter()
        for t in threads:
            t.join(120)

    harness.bench_rounds(benchmark, go, rounds=1)
    c2 = env.counters()
    assert not errors, errors[0]
    assert all(w is not None for w in woken), f"{woken.count(None)} readers never woke"
    last = max(w for w in woken if w is not None)
    first = min(w for w in woken if w is not None)
    blocking = harness.counter_delta(c0, c1)
    waking = harness.counter_delta(c1, c2)
    etcd = contender != "TCPStore (server in another process)"  # TCPStore has no etcd
    record(f"fanout/{contender}", contender=contender, threads=n,
           all_woken_s=last - stamps["t0"], after_last_put_s=last - stamps["acked"],
           publish_s=stamps["acked"] - stamps["t0"], spread_s=last - first,
           watch_streams_opened=(blocking.get("Watch streams", 0)
                                 + waking.get("Watch streams", 0)) if etcd else None,
           watchers_open_while_blocked=(c1.get("watchers_open", 0)
                                        - c0.get("watchers_open", 0)) if etcd else None,
           etcd_requests_blocking=harness.total_requests(blocking) if etcd else None,
           etcd_requests_waking=harness.total_requests(waking) if etcd else None,
           etcd_blocking=blocking if etcd else None, etcd_waking=waking if etcd else None)
