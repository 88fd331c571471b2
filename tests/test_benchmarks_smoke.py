"""CI smoke of ``benchmarks/``: every workload runs once at tiny scale and yields sane numbers.

The benchmarks are not part of the normal test run (``testpaths = ["tests"]``); this test
runs them in a child pytest with ``--benchmark-disable`` and ``CACHEDSTORE_BENCH_SCALE=smoke``
and checks the results JSON they write. No timing assertions (timings belong in
``benchmarks/RESULTS.md``); the counts it checks — etcd round trips of a cold ``mget(1000)``,
watch streams opened by a thousand waiters, puts per all-gather — are properties of the
design, not of the machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    env = dict(os.environ, CACHEDSTORE_BENCH_SCALE="smoke", CACHEDSTORE_BENCH_RESULTS=str(out))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(BENCH), "-q", "-x", "-p", "no:cacheprovider",
         "-o", "addopts=", "-o", "timeout=100", "--benchmark-disable",
         "-W", "ignore::DeprecationWarning"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    summary = [line for line in proc.stdout.splitlines() if " passed" in line]
    assert summary and "skipped" not in summary[-1] and "failed" not in summary[-1], tail
    return json.loads(out.read_text())


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_workload_ran(results: dict[str, Any]) -> None:
    w = results["workloads"]
    for prefix in ("hot_key/1/", "hot_key/8/", "mget/", "mget_round_trips", "coherence/",
                   "fanout/", "allgather/", "allgather_scaling", "memory/"):
        assert any(k.startswith(prefix) for k in w), f"no results for {prefix}"
    for contender in ("cachedstore cached", "cachedstore cached, metrics=False",
                      "cachedstore cached, latency_sample_every=1", "cachedstore uncached read",
                      "etcd3 get", "TCPStore get (server in another process)"):
        assert f"hot_key/1/{contender}" in w and f"hot_key/8/{contender}" in w
    m = results["machine"]
    assert m["cores"] >= 1 and m["python"] and m["etcd"] and m["cpu"]
    try:
        import etcd  # noqa: F401  (python-etcd: the torch v2 contender)
    except ImportError:
        assert any("python-etcd" in n for n in results.get("notes", []))
    else:
        assert any("torch v2" in k for k in w)


def test_latencies_are_sane(results: dict[str, Any]) -> None:
    w = results["workloads"]
    for key, v in w.items():
        if key.startswith(("hot_key/", "mget/")):
            assert _finite_positive(v["median_s"]) and v["median_s"] < 10, (key, v)
    for key, v in w.items():
        if key.startswith("coherence/"):
            lag = v["lag"]
            assert lag["trials"] >= 5, key
            assert 0 < lag["p50_s"] <= lag["p99_s"] <= lag["max_s"] < 30, (key, lag)


def test_cold_mget_1000_takes_at_most_8_round_trips(results: dict[str, Any]) -> None:
    rt = results["workloads"]["mget_round_trips"]
    assert rt["store_counted"] == {"txn": 8}, rt
    assert rt["etcd_unary_total"] == 8 and rt["etcd_counted"].get("Txn") == 8, rt


def test_fanout_waiters_share_the_one_watch(results: dict[str, Any]) -> None:
    f = results["workloads"]["fanout/cachedstore"]
    n = f["threads"]
    assert _finite_positive(f["all_woken_s"])
    # The store's own stream (opened when it was constructed) and nothing per waiter.
    assert f["watch_streams_opened"] == 1, f
    # While blocked: one read-through Range per reader (+ the store's construction).
    assert f["etcd_blocking"].get("Range", 0) <= n + 1, f
    # Waking: only the writer's Txns; the woken readers sent nothing to etcd.
    assert set(f["etcd_waking"]) <= {"Txn", "Watch msgs"}, f
    assert f["etcd_waking"]["Txn"] == math.ceil(n / 128), f


def test_allgather_counts(results: dict[str, Any]) -> None:
    w = results["workloads"]
    for key, v in w.items():
        if key.startswith("allgather/cachedstore/"):
            world = v["world"]
            gather = v["gather_by_method"]
            assert gather.get("Put") == world, v  # each worker's own key, once
            # At most one batched read of the keys its watch had not delivered yet.
            assert v["gather_requests"] <= 2 * world + 2, v
            assert _finite_positive(v["wall_s"])
        if key.startswith("allgather/cachedstore, barrier by arrival keys/"):
            world = v["world"]
            # One arrival key per worker, at most one read of the ones not yet delivered.
            assert v["barrier_by_method"].get("Put") == world, v
            assert v["barrier_requests"] <= 2 * world + 2, v
    fits = w["allgather_scaling"]["fits"]
    assert fits["cachedstore"]["gather_requests"] is not None


def test_memory_per_entry(results: dict[str, Any]) -> None:
    mem = {v["value_size"]: v for k, v in results["workloads"].items()
           if k.startswith("memory/")}
    assert set(mem) == {100, 10 * 1024}
    assert 0 < mem[100]["bytes_per_entry"] < 20_000, mem[100]
    assert 5_000 < mem[10 * 1024]["bytes_per_entry"] < 100_000, mem[10 * 1024]
