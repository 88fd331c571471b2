"""Issue 11's fan-out benchmark as pytest-benchmark tests: W simulated ranks, own store each.

Each test runs one torch coordination pattern (``benchmarks/fanout/patterns.py``) with W
ranks on the session's etcd and, in the same test, on a TCPStore server with W clients, and
records etcd's own counts per rank (``/metrics``) next to both wall times. W comes from
``$CACHEDSTORE_FANOUT_WS`` (default ``16``; the smoke scale uses 8 and three patterns).
The full table, exponents and extrapolation come from ``python -m benchmarks.fanout``
(``benchmarks/FANOUT.md``). No timing assertions: the checks are properties of the
patterns (every rank finished; a broadcast wrote once; the TCPStore run finished too).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import harness
import pytest

sys.path.insert(0, os.path.dirname(harness.HERE))  # the repo root: `benchmarks.fanout`

from benchmarks.fanout import PATTERNS, run_pattern  # noqa: E402
from benchmarks.fanout.tcp_server import TCPStoreServer  # noqa: E402

_SMOKE = harness.scale().name == "smoke"
WS = [int(w) for w in os.environ.get("CACHEDSTORE_FANOUT_WS", "8" if _SMOKE else "16").split(",")]
NAMES = (["nccl_broadcast", "store_barrier", "heartbeat"] if _SMOKE else list(PATTERNS))


@pytest.fixture(scope="module")
def tcp_server() -> Any:
    with TCPStoreServer() as server:
        yield server


@pytest.mark.parametrize("world", WS)
@pytest.mark.parametrize("pattern", NAMES)
def test_fanout_scale(benchmark: Any, env: harness.Env, record: Any, tcp_server: Any,
                      pattern: str, world: int) -> None:
    reason = PATTERNS[pattern].unsupported(world)
    if reason is not None:
        pytest.skip(reason)  # an API of a newer torch than the installed one
    results: dict[str, Any] = {}

    def run() -> None:
        results["etcd"] = run_pattern(pattern, world, env.etcd.endpoint, env.metrics_url,
                                      budget=60)

    harness.bench_rounds(benchmark, run, rounds=1)
    tcp = run_pattern(pattern, world, tcp_endpoint=f"{tcp_server.host}:{tcp_server.port}",
                      budget=60)
    r = results["etcd"]
    assert r.finished and not r.errors, r.errors
    assert tcp.finished and not tcp.errors, tcp.errors
    assert r.counts is not None and r.connect is not None
    assert r.connect.watch_streams == world  # one watch stream per rank's store
    if pattern == "nccl_broadcast" and world <= 128:
        assert r.counts.revisions == 1 and r.semantic_writes == 1
    per = r.counts.per_rank(world)
    record(f"fanout_scale/{pattern}/{world}", pattern=pattern, world=world,
           wall_s=r.wall_s, tcpstore_wall_s=tcp.wall_s,
           requests_per_rank=per["requests"], proposals_per_rank=per["proposals"],
           watch_msgs_per_rank=per["watch_msgs_sent"],
           needed_deliveries=r.needed_deliveries, counts=r.counts.as_dict())
