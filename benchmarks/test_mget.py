"""Workload 2: ``mget`` of 10 … 10,000 keys, cold (a fresh store) and warm (all cached).

Also counts the etcd round trips of a cold ``mget(1000)``, both as the store counts them
(``cachedstore_etcd_requests_total``) and as etcd counts them (``grpc_server_started_total``
by method), next to TCPStore's ``multi_get(1000)`` (one request to its server).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import harness
import pytest

VALUE = b"m" * 64
SIZES = harness.scale().mget_sizes
_TORCH_V2, _ = harness.torch_v2_available()
_POPULATED: dict[int, str] = {}


def names(n: int) -> list[str]:
    return [f"k{i:05d}" for i in range(n)]


def populated(env: harness.Env, n: int) -> str:
    """The etcd prefix holding keys ``k00000``… ``k{n-1}``, written once per session."""
    prefix = _POPULATED.get(n)
    if prefix is None:
        prefix = env.unique(f"mget{n}")
        client = env.etcd3()
        keys = names(n)
        for start in range(0, n, 128):
            ops = [client.transactions.put(prefix + k, VALUE) for k in keys[start:start + 128]]
            client.transaction(compare=[], success=ops, failure=[])
        _POPULATED[n] = prefix
    return prefix


CONTENDERS = [
    "cachedstore mget, warm",
    "cachedstore mget, cold",
    "etcd3 get per key",
    "TCPStore multi_get (in-process server, legacy)",
    "TCPStore multi_get (server in another process)",
]
if _TORCH_V2:
    CONTENDERS.append("torch v2 EtcdStore get per key")


def _cases() -> list[Any]:
    cases = []
    for n in SIZES:
        for c in CONTENDERS:
            if c.startswith("etcd3") and n > harness.scale().etcd3_mget_max:
                continue
            if c.startswith("torch v2") and n > 100:
                continue
            cases.append(pytest.param(c, n, id=f"{c}-{n}"))
    return cases


@pytest.mark.parametrize(("contender", "n"), _cases())
def test_mget(benchmark: Any, env: harness.Env, record: Any, scale: harness.Scale,
              contender: str, n: int) -> None:
    keys = names(n)
    prefix = populated(env, n)
    if contender == "cachedstore mget, cold":
        stores: list[Any] = []

        def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
            while stores:
                stores.pop().close()
            stores.append(env.store(prefix=prefix, cache_size=max(n, 1024),
                                    **harness.read_through_kwargs()))
            return (keys,), {}

        def cold(ks: list[str]) -> list[bytes]:
            out = stores[-1].mget(ks)
            assert out[-1] == VALUE
            return out

        median = harness.bench_rounds(benchmark, cold, rounds=scale.cold_rounds, setup=fresh)
        for s in stores:
            s.close()
        record(f"mget/{contender}/{n}", contender=contender, n=n, median_s=median,
               per_key_s=median / n)
        return
    fn = _mget_fn(env, contender, prefix, keys)
    result, median = harness.bench_median(benchmark, fn)
    assert len(result) == n and result[0] == VALUE and result[-1] == VALUE
    record(f"mget/{contender}/{n}", contender=contender, n=n, median_s=median,
           per_key_s=median / n)


def _mget_fn(env: harness.Env, contender: str, prefix: str, keys: list[str]
             ) -> Callable[[], list[bytes]]:
    if contender == "cachedstore mget, warm":
        store = env.store(prefix=prefix, cache_size=max(len(keys), 1024))
        store.mget(keys)
        return functools.partial(store.mget, keys)
    if contender.startswith("etcd3"):
        client = env.etcd3()
        full = [prefix + k for k in keys]
        return lambda: [client.get(k)[0] for k in full]
    if contender.startswith("TCPStore"):
        remote = "another process" in contender
        tcp = env.tcp_store(remote, libuv=remote)
        full = [prefix + k for k in keys]
        for start in range(0, len(full), 1000):
            chunk = full[start:start + 1000]
            tcp.multi_set(chunk, [VALUE] * len(chunk))
        return functools.partial(tcp.multi_get, full)
    if contender.startswith("torch v2"):
        store = env.torch_v2_store(prefix + "v2")
        for k in keys:
            store.set(k, VALUE)
        return lambda: [store.get(k) for k in keys]
    raise AssertionError(contender)


def test_cold_mget_1000_round_trips(benchmark: Any, env: harness.Env, record: Any) -> None:
    """A cold mget(1000): etcd round trips counted by the store and by etcd itself."""
    n = 1_000
    prefix = populated(env, n)
    store = env.store(prefix=prefix, cache_size=4096, **harness.read_through_kwargs())
    before_store = harness.store_rpcs(store.registry)
    before = env.counters()
    values = benchmark.pedantic(store.mget, args=(names(n),), rounds=1, iterations=1)
    after = env.counters()
    after_store = harness.store_rpcs(store.registry)
    assert values[0] == VALUE and len(values) == n
    by_store = {m: after_store.get(m, 0) - before_store.get(m, 0) for m in after_store}
    by_store = {m: v for m, v in by_store.items() if v}
    by_etcd = harness.counter_delta(before, after)
    unary = {k: v for k, v in by_etcd.items() if not k.startswith(("Watch", "v2"))}
    tcp = env.tcp_store(True)
    keys = [prefix + k for k in names(n)]
    tcp.multi_set(keys, [VALUE] * n)
    assert len(tcp.multi_get(keys)) == n
    record("mget_round_trips", n=n, store_counted=by_store, etcd_counted=by_etcd,
           etcd_unary_total=sum(unary.values()), store_total=sum(by_store.values()),
           tcpstore_multi_get_requests=1, target_max=8)
    # Counts, not timings: the batching bound is a correctness property of mget.
    assert sum(by_store.values()) <= 8, by_store
    assert sum(unary.values()) <= 8, by_etcd
