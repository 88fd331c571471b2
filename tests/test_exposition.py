"""Tests of :mod:`cachedstore.exposition`: the ``/metrics`` HTTP server and its helpers.

Everything listens on 127.0.0.1 only. Multiprocess mode runs in subprocesses, since
``PROMETHEUS_MULTIPROC_DIR`` must be set before a process imports ``prometheus_client``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from cachedstore.exposition import (
    MULTIPROC_ENV,
    MetricsServer,
    local_rank_port,
    mark_process_dead,
    start_metrics_server,
)
from cachedstore.metrics import METRIC_NAMES, make_metrics

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def parse(text: str) -> Samples:
    """``(sample name, labels) -> value`` of a text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture(autouse=True)
def _no_multiprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)


def test_serves_the_registry_on_a_free_port() -> None:
    registry = CollectorRegistry()
    Counter("probe_total", "A probe.", registry=registry).inc(7)
    with start_metrics_server(0, registry=registry) as server:
        assert isinstance(server, MetricsServer)
        assert server.port > 0
        assert server.addr == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert server.thread.name == f"cachedstore-metrics-{server.port}"
        assert server.thread.daemon and server.thread.is_alive()
        assert not server.multiprocess
        assert value(parse(scrape(server.url)), "probe_total") == 7


def test_serves_every_store_metric() -> None:
    registry = CollectorRegistry()
    metrics = make_metrics(registry)
    metrics.hit["get"].inc()
    metrics.rpc("range", "ok", 0.001)
    with start_metrics_server(0, registry=registry) as server:
        text = scrape(server.url)
    names = {f.name for f in text_string_to_metric_families(text)}
    # The parser drops a counter's _total suffix from the family name.
    assert {n.removesuffix("_total") for n in METRIC_NAMES} <= names
    samples = parse(text)
    assert value(samples, "cachedstore_cache_requests_total", op="get", result="hit") == 1
    assert value(samples, "cachedstore_etcd_requests_total", method="range", code="ok") == 1


def test_default_registry() -> None:
    with start_metrics_server(0) as server:
        assert "python_info" in scrape(server.url)


def test_close_stops_the_thread_and_frees_the_port() -> None:
    server = start_metrics_server(0, registry=CollectorRegistry())
    port, url, thread = server.port, server.url, server.thread
    scrape(url)
    server.close()
    assert server.closed
    assert not thread.is_alive()
    assert thread not in threading.enumerate()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)
    server.close()  # idempotent
    # The port is free again: a new server binds it.
    again = start_metrics_server(port, registry=CollectorRegistry())
    try:
        assert again.port == port
        scrape(again.url)
    finally:
        again.close()
    assert "closed" in repr(again)


def test_close_from_several_threads() -> None:
    server = start_metrics_server(0, registry=CollectorRegistry())
    closers = [threading.Thread(target=server.close) for _ in range(4)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(10)
    assert not server.thread.is_alive()


def test_port_in_use_raises() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            start_metrics_server(taken.getsockname()[1], registry=CollectorRegistry())


def test_local_rank_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank_port(9464) == 9464
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank_port(9464) == 9467
    monkeypatch.setenv("LOCAL_RANK", "")
    assert local_rank_port(9464) == 9464
    for bad in ("x", "-1", "1.5"):
        monkeypatch.setenv("LOCAL_RANK", bad)
        with pytest.raises(ValueError):
            local_rank_port(9464)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError):
        local_rank_port(65535)


def test_mark_process_dead_is_a_no_op_outside_multiprocess_mode() -> None:
    mark_process_dead()
    mark_process_dead(12345)


# ---- multiprocess mode ----------------------------------------------------------------------

# A worker: store metrics on its own registry, as a store in a torchrun worker would have.
WORKER = """
import sys
from prometheus_client import CollectorRegistry
from cachedstore.metrics import make_metrics
i = int(sys.argv[1])
m = make_metrics(CollectorRegistry())
m.hit["get"].inc(3)
m.miss["mget"].inc(2)
m.entries.inc(5)           # livesum
m.watch_up.inc()           # livesum
m.watch_revision.set(100 + i)  # livemax
m.waiters.inc(i)           # livesum
m.duration["get"].observe(0.001)
m.rpc("range", "ok", 0.002)
m.restart("disconnect")
"""

# The collector: serves the aggregate until its stdin closes.
COLLECTOR = """
import json, sys
from cachedstore.exposition import start_metrics_server
from prometheus_client import CollectorRegistry
server = start_metrics_server(0, registry=CollectorRegistry())  # ignored in multiprocess mode
print(json.dumps({"port": server.port, "url": server.url, "mp": server.multiprocess}), flush=True)
sys.stdin.read()
server.close()
print("closed", flush=True)
"""


def test_multiprocess_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mpdir = tmp_path / "prometheus-multiproc"
    mpdir.mkdir()  # a launcher creates it empty (or empties it) before starting workers
    env = {**os.environ, MULTIPROC_ENV: str(mpdir)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(i)], env=env)
               for i in (1, 2)]
    for w in workers:
        assert w.wait(timeout=30) == 0
    assert any(mpdir.iterdir())

    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert collector.stdout is not None and collector.stdin is not None
        hello = json.loads(collector.stdout.readline())
        assert hello["mp"] is True
        samples = parse(scrape(hello["url"]))

        # Counters and histograms add up over the processes.
        assert value(samples, "cachedstore_cache_requests_total", op="get", result="hit") == 6
        assert value(samples, "cachedstore_cache_requests_total", op="mget", result="miss") == 4
        assert value(samples, "cachedstore_request_duration_seconds_count", op="get") == 2
        assert value(samples, "cachedstore_request_duration_seconds_bucket",
                     op="get", le="0.001") == 2
        assert value(samples, "cachedstore_etcd_requests_total", method="range", code="ok") == 2
        assert value(samples, "cachedstore_watch_restarts_total", reason="disconnect") == 2
        # livesum / livemax gauges: no pid label, one aggregated sample.
        assert value(samples, "cachedstore_cache_entries") == 10
        assert value(samples, "cachedstore_watch_up") == 2
        assert value(samples, "cachedstore_waiters") == 3
        assert value(samples, "cachedstore_watch_revision") == 102

        # The launcher reaps worker 2: its live gauges go, its counts stay.
        monkeypatch.setenv(MULTIPROC_ENV, str(mpdir))
        mark_process_dead(workers[1].pid)
        samples = parse(scrape(hello["url"]))
        assert value(samples, "cachedstore_cache_requests_total", op="get", result="hit") == 6
        assert value(samples, "cachedstore_cache_entries") == 5
        assert value(samples, "cachedstore_watch_up") == 1
        assert value(samples, "cachedstore_waiters") == 1
        assert value(samples, "cachedstore_watch_revision") == 101

        collector.stdin.close()
        assert collector.stdout.readline().strip() == "closed"
        assert collector.wait(timeout=10) == 0
    finally:
        if collector.poll() is None:
            collector.kill()
            collector.wait(timeout=10)
