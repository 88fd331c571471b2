"""Workload 6: resident memory per cached entry, 100 B and 10 KiB values.

The keys are written to a separate throw-away etcd (``--unsafe-no-fsync`` and a large
backend quota: only its contents matter here), then read into one store's cache by
``memory_probe.py`` in a fresh process, measuring RSS at several fill levels. Reported:
the slope (bytes per entry), the overhead per entry beyond the value's own bytes, and the
RSS of 100,000 entries extrapolated from that slope when fewer were measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import harness
import pytest

SIZES = (100, 10 * 1024)


@pytest.fixture(scope="module")
def bulk_etcd() -> Iterator[Any]:
    from cachedstore.server import LocalEtcd

    with LocalEtcd(extra_args=["--quota-backend-bytes=8589934592", "--unsafe-no-fsync"]) as s:
        yield s


@pytest.mark.parametrize("value_size", SIZES, ids=lambda s: f"{s}B")
def test_memory_per_entry(benchmark: Any, bulk_etcd: Any, record: Any, scale: harness.Scale,
                          value_size: int) -> None:
    import etcd3

    n = scale.memory_entries
    prefix = f"/mem{value_size}/"
    client = etcd3.client(bulk_etcd.host, bulk_etcd.client_port)
    value = b"x" * value_size
    t = time.perf_counter()
    for start in range(0, n, 128):
        ops = [client.transactions.put(f"{prefix}k{i:07d}", value)
               for i in range(start, min(n, start + 128))]
        client.transaction(compare=[], success=ops, failure=[])
    client.close()
    fill_s = time.perf_counter() - t
    probe = os.path.join(harness.HERE, "memory_probe.py")
    out: dict[str, Any] = {}

    def measure() -> None:
        proc = subprocess.run(
            [sys.executable, probe, bulk_etcd.host, str(bulk_etcd.client_port), prefix, str(n),
             str(scale.memory_checkpoints)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))

    harness.bench_rounds(benchmark, measure, rounds=1)
    assert out["entries"] >= n
    per_entry = out["bytes_per_entry"]
    record(f"memory/{value_size}", value_size=value_size, entries=n,
           bytes_per_entry=per_entry, overhead_per_entry=per_entry - value_size,
           rss_per_100k_bytes=per_entry * 100_000, rss_growth_bytes=out["rss_growth"],
           points=out["points"], etcd_fill_s=fill_s)
    assert per_entry > 0
