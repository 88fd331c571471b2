"""Goal 5, per-host sharing: N stores behind one ``etcd grpc-proxy`` vs N direct stores.

:func:`measure_host_sharing` builds ``stores`` ``EtcdStore``s on one prefix through a
:class:`cachedstore.testing.GrpcProxy` and, separately, ``stores`` direct ones on another
prefix; a raw etcd3 client writes ``writes`` keys under each prefix in turn; etcd's own
``/metrics`` say how many watch streams it opened and how many watch messages it sent for
each setup. It then checks the stores saw every write (each store's ``mget`` of all keys
equals what was written, after its watch applied the last revision), and stays idle for
``idle`` seconds (longer than a store's default stall bound) to see whether the watches
behind the proxy stay up: ``watch_restarts`` comes from ``EtcdStore.stats()``.
Blocks for the whole measurement (bounded by ``timeout`` per wait); starts and kills its
own proxy.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .etcd_metrics import sample

__all__ = ["measure_host_sharing"]


def _wait_applied(stores: list[Any], revision: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.watch_revision >= revision for s in stores):
            return True
        time.sleep(0.01)
    return False


def _one_setup(endpoint: str, etcd_host: str, etcd_port: int, metrics_url: str,
               stores: int, writes: int, timeout: float, idle: float) -> dict[str, Any]:
    import etcd3

    from cachedstore import EtcdStore

    prefix = f"/fanout-host/{uuid.uuid4().hex[:8]}/"
    s0 = sample(metrics_url)
    group = [EtcdStore(endpoints=[endpoint], prefix=prefix) for _ in range(stores)]
    writer = etcd3.client(etcd_host, etcd_port)
    try:
        s1 = sample(metrics_url)
        for i in range(writes):
            writer.put(f"{prefix}k{i:05d}", f"v{i}".encode())
        revision = sample(metrics_url).revision
        caught_up = _wait_applied(group, revision, timeout)
        s2 = sample(metrics_url)
        expected = [f"v{i}".encode() for i in range(writes)]
        names = [f"k{i:05d}" for i in range(writes)]
        coherent = all(s.mget(names) == expected for s in group)
        healthy = all(s.watch_healthy for s in group)
        time.sleep(idle)  # measurement: does the watch survive a quiet period?
        restarts = sum(s.stats()["watch_restarts"] for s in group)
        healthy_after_idle = all(s.watch_healthy for s in group)
        connect, traffic = s1.minus(s0), s2.minus(s1)
        return {"stores": stores, "writes": writes,
                "watch_streams_opened": connect.watch_streams,
                "watch_streams_open_at_etcd": s1.watch_streams_open - s0.watch_streams_open,
                "watchers_open_at_etcd": s1.watchers_open - s0.watchers_open,
                "watch_msgs_sent": traffic.watch_msgs_sent,
                "watch_event_msgs": traffic.watch_event_msgs,
                "watch_msgs_per_write": traffic.watch_event_msgs / max(1, writes),
                "connect_requests": connect.total_requests,
                "caught_up": caught_up, "coherent": coherent, "healthy": healthy,
                "idle_s": idle, "watch_restarts_after_idle": restarts,
                "healthy_after_idle": healthy_after_idle}
    finally:
        writer.close()
        for s in group:
            s.close()


def measure_host_sharing(etcd_endpoint: str, metrics_url: str, *, stores: int = 8,
                         writes: int = 200, timeout: float = 60.0,
                         idle: float = 9.0) -> dict[str, Any]:
    """``{"direct": {...}, "proxy": {...}}``: etcd's streams and watch messages for
    ``stores`` stores connected directly and through one grpc-proxy."""
    from cachedstore.testing import GrpcProxy

    host, _, port = etcd_endpoint.rpartition(":")
    direct = _one_setup(etcd_endpoint, host, int(port), metrics_url, stores, writes, timeout,
                        idle)
    with GrpcProxy([etcd_endpoint]) as proxy:
        behind = _one_setup(proxy.endpoint, host, int(port), metrics_url, stores, writes,
                            timeout, idle)
    return {"direct": direct, "proxy": behind}
