"""Per-host sharing (issue 11, goal 5): a node's ranks behind one etcd ``grpc-proxy``.

16 stores run torch's init traffic (NCCL-id broadcast, the native barrier, a gloo-style
all-gather) through one proxy, as the ranks of two nodes would through their node's proxy;
etcd's own ``/metrics`` must show one watch stream and about one watch message per write,
where 16 direct stores cost 16 streams and 16 messages per write.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from benchmarks.fanout.etcd_metrics import SettledSampler, sample
from cachedstore.server import LocalEtcd
from cachedstore.testing import GrpcProxy
from cachedstore.torch import TorchEtcdStore
from tests.test_counters import _all_at_once
from tests.util import eventually

pytestmark = pytest.mark.timeout(180)

W = 16


@pytest.fixture
def etcd_and_proxy() -> Iterator[tuple[LocalEtcd, GrpcProxy]]:
    with LocalEtcd() as server, GrpcProxy(server.endpoints) as proxy:
        yield server, proxy


def _init_traffic(store: Any, rank: int) -> list[bytes]:
    """One rank's torch init: NCCL id from rank 0, the barrier, an all-gather of W keys."""
    if rank == 0:
        store.set("nccl/0", b"\x5a" * 128)
    assert store.get("nccl/0") == b"\x5a" * 128
    store.barrier("init", W)
    store.set(f"gloo/{rank}", f"host{rank}")
    return list(store.multi_get([f"gloo/{r}" for r in range(W)]))


@pytest.mark.parametrize("scope", ["prefix", "touched"])
@pytest.mark.parametrize("via_proxy", [True, False], ids=["proxy", "direct"])
def test_a_nodes_ranks_share_one_watch_stream_through_grpc_proxy(etcd_and_proxy, prefix,
                                                                  via_proxy, scope):
    """Whole-prefix watches (``watch_scope="prefix"``) are equal ranges: the proxy
    coalesces them. Stores watching what they touched work behind the proxy too (their
    scopes start at different revisions, so etcd's counts are only checked for the
    prefix)."""
    server, proxy = etcd_and_proxy
    endpoint = proxy.endpoint if via_proxy else server.endpoint
    settled = SettledSampler(server.endpoint, server.metrics_url)
    before = settled()
    stores = [TorchEtcdStore(endpoints=[endpoint], prefix=prefix, watch_scope=scope,
                             timeout=timedelta(seconds=60)) for _ in range(W)]
    try:
        ranks = iter(range(W))
        lock = threading.Lock()

        def rank_of() -> int:
            with lock:
                return next(ranks)

        results = _all_at_once(stores, lambda s: _init_traffic(s, rank_of()))
        assert all(r == [f"host{i}".encode() for i in range(W)] for r in results)
        if scope == "touched":
            return
        revision = sample(server.metrics_url).revision
        for s in stores:
            eventually(lambda c=s.etcd_store._cache: c.applied_revision >= revision,
                       what="every watch applied the last write")
        counts = settled().minus(before)
    finally:
        for s in stores:
            s.close()
        settled.close()
    writes = counts.proposals  # the puts and adds: each one revision
    assert writes >= 2 * W + 1
    if via_proxy:
        # The proxy coalesces the 16 equal-range watches into one stream at etcd.
        assert counts.watch_streams == 1, counts.as_dict()
        assert counts.watch_event_msgs <= 1.5 * writes, counts.as_dict()
    else:
        assert counts.watch_streams == W, counts.as_dict()
        assert counts.watch_event_msgs >= W * (writes - W), counts.as_dict()
