"""End to end: a real Prometheus scrapes a live store and runs every dashboard query.

The test starts its own ``prometheus`` (Debian's package; ``bash .ci/install-prometheus.sh``)
on a free loopback port with a throw-away config and TSDB, scraping the store's
``/metrics`` every second. Once the target is up it generates traffic, waits for a scrape
that saw it, then sends every panel query of ``grafana/cachedstore.json`` (Grafana
variables substituted) and the template-variable lookups to the HTTP API and asserts that
each returns data. Without the binary it skips — except under CI (``CI=true``), where it
fails, so that a missing install step cannot pass unnoticed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cachedstore import EtcdStore
from cachedstore.exposition import MetricsServer, start_metrics_server
from cachedstore.metrics import StoreMetrics

try:
    from test_dashboard import dashboard_queries, expand, load_dashboard
except ImportError:  # tests/ imported as a package
    from tests.test_dashboard import dashboard_queries, expand, load_dashboard

#: Budget of the test body in seconds (fixtures: an etcd and a store, take a few more).
BUDGET = 45.0
SCRAPE_INTERVAL = "1s"
#: What $__rate_interval becomes: long enough to hold every scrape of the test.
RATE_INTERVAL = "30s"
JOB = "cachedstore"
#: A small cache, so that the traffic evicts for real.
CACHE_SIZE = 8

pytestmark = pytest.mark.timeout(60)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def prometheus_binary() -> str:
    """Path of the prometheus binary; skip (fail under CI) when it is not installed.

    ``$PROMETHEUS_BIN`` names a binary explicitly; otherwise ``prometheus`` on ``PATH`` or
    ``/usr/bin/prometheus``.
    """
    explicit = os.environ.get("PROMETHEUS_BIN")
    if explicit:
        candidates = [explicit]
    else:
        candidates = [shutil.which("prometheus") or "", "/usr/bin/prometheus"]
    for found in candidates:
        if found and os.path.isfile(found) and os.access(found, os.X_OK):
            return found
    reason = (f"PROMETHEUS_BIN={explicit} is not an executable file" if explicit else
              "prometheus is not installed (run: bash .ci/install-prometheus.sh)")
    if _in_ci():
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    """A Prometheus server this test started, and its HTTP API."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, timeout: float = 5.0, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return ``data``; raise on an error status."""
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=timeout) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) ``expr`` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def start_prometheus(binary: str, tmp: Path, targets: list[str], deadline: float) -> Prometheus:
    """Start Prometheus scraping ``targets`` (``host:port``) every second; wait until ready."""
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL,
                   "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
    }))
    last_error = ""
    for _attempt in range(3):  # the free port may be taken before prometheus binds it
        port = _free_port()
        log = tmp / f"prometheus-{port}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
                 "--storage.tsdb.retention.time=1h"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        prom = Prometheus(process, f"http://127.0.0.1:{port}", log)
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return prom
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        last_error = prom.logs()
        stop_prometheus(prom)
        if time.monotonic() >= deadline:
            break
    pytest.fail(f"prometheus did not become ready:\n{last_error}")


def stop_prometheus(prom: Prometheus) -> None:
    """SIGTERM our Prometheus (its own session), SIGKILL it if it lingers."""
    if prom.process.poll() is None:
        os.killpg(prom.process.pid, signal.SIGTERM)
        try:
            prom.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(prom.process.pid, signal.SIGKILL)
            prom.process.wait(timeout=10)


def wait_for(what: str, predicate: Any, deadline: float, prom: Prometheus) -> Any:
    """Poll ``predicate()`` until it returns something truthy, or fail at ``deadline``."""
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})\n{prom.logs()}")


def _values(result: list[dict[str, Any]]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


# ---- traffic ---------------------------------------------------------------------------------


@dataclass
class Target:
    """What Prometheus scrapes: a live store whose registry is served over HTTP."""

    store: EtcdStore
    server: MetricsServer
    registry: CollectorRegistry

    def traffic(self, round_: int) -> None:
        """One round of real store traffic touching every read op, write op and metric."""
        store = self.store
        base = round_ * 4
        for i in range(base, base + 4):  # more keys than cache_size: real evictions
            store.set(f"k{i}", f"v{i}")
        store.get(f"k{base}")  # hit: writes fill the cache
        store.get(f"k{max(0, base - CACHE_SIZE - 4)}")  # evicted earlier: a miss, range RPC
        store.get(f"absent{round_}", default=None)  # miss on an absent key
        store.mget([f"k{base}", f"k{base + 1}", f"absent{round_}"], default=None)
        store.check([f"k{base + 2}", f"absent{round_}"])
        store.wait([f"k{base + 3}"], timeout=5)
        store.add("counter", 1)
        store.delete(f"k{base + 1}")  # a delete event on the watch

        async def reads() -> None:
            await store.aget(f"k{base + 2}")
            await store.amget([f"k{base + 2}", f"k{base + 3}"])

        asyncio.run(reads())
        if round_ % 10 == 1:  # a blocked wait, woken by a later set: the waiters gauge
            waiter = threading.Thread(target=store.wait, args=([f"late{round_}"],),
                                      kwargs={"timeout": 10}, name="e2e-waiter")
            waiter.start()
            time.sleep(0.2)
            store.set(f"late{round_}", "now")
            waiter.join(10)
            assert not waiter.is_alive()

    def force_rare_events(self) -> None:
        """Touch the series that healthy traffic on a healthy etcd never produces.

        A failed etcd RPC (the "errors by code" panel selects code!="ok", a series that only
        exists after a failure) and a watch restart cannot be caused within this test's time
        budget without breaking the shared etcd, so when none has occurred for real by the
        time this runs (after the first scrape and a first round of traffic) they are
        recorded through the store's own StoreMetrics, exactly as the connection layer and the
        watcher would record them. Every other series comes from the real traffic above.
        """
        m = self.store.metrics
        assert isinstance(m, StoreMetrics)
        codes = {s.labels["code"] for f in self.registry.collect()
                 if f.name == "cachedstore_etcd_requests" for s in f.samples
                 if s.name == "cachedstore_etcd_requests_total"}
        if codes <= {"ok"}:
            m.rpc("range", "UNAVAILABLE", 0.05)
        if self.store.stats()["watch_restarts"] == 0:
            m.restart("disconnect")


@pytest.fixture
def target(etcd: Any, prefix: str) -> Iterator[Target]:
    registry = CollectorRegistry()
    store = EtcdStore(endpoints=[etcd.endpoint], prefix=prefix, registry=registry,
                      cache_size=CACHE_SIZE)
    try:
        server = start_metrics_server(0, registry=registry)
        try:
            yield Target(store, server, registry)
        finally:
            server.close()
    finally:
        store.close()


# ---- the test --------------------------------------------------------------------------------


def test_every_dashboard_query_returns_data(target: Target, tmp_path: Path) -> None:
    binary = prometheus_binary()
    started = time.monotonic()
    deadline = started + BUDGET
    instance = f"127.0.0.1:{target.server.port}"
    target.traffic(0)  # before the first scrape: the rare-event check sees real traffic
    prom = start_prometheus(binary, tmp_path, [instance], min(deadline, started + 20))
    try:
        # 1. The target is scraped.
        wait_for("the first scrape", lambda: _values(prom.query(f'up{{job="{JOB}"}}')) == [1.0],
                 deadline, prom)

        # 2. Traffic over a few scrapes, so that every rate has two samples that differ.
        #    The rare events go first: a series born in the last scrape has no rate yet.
        target.force_rare_events()
        traffic_end = time.monotonic() + 3.5
        round_ = 1
        while time.monotonic() < traffic_end:
            target.traffic(round_)
            round_ += 1
            time.sleep(0.05)
        done_at = time.time()

        # 3. A scrape taken after the traffic stopped has landed.
        wait_for("a scrape after the traffic",
                 lambda: any(v > done_at for v in _values(
                     prom.query(f'timestamp(up{{job="{JOB}"}})'))),
                 deadline, prom)

        # 4. The template variables find this job and instance.
        jobs = prom.api("label/job/values", **{"match[]": "cachedstore_watch_up"})
        assert JOB in jobs
        instances = prom.api("label/instance/values",
                             **{"match[]": f'cachedstore_watch_up{{job=~"{JOB}"}}'})
        assert instance in instances

        # 5. Every panel query returns data, with at least one number that is not NaN.
        variables = {"job": JOB, "instance": instance}
        queries = dashboard_queries(load_dashboard())
        assert queries
        empty, nan_only = [], []
        for title, ref, raw in queries:
            expr = expand(raw, variables, rate_interval=RATE_INTERVAL)
            result = prom.query(expr)
            if not result:
                empty.append(f"{title}/{ref}: {expr}")
            elif all(math.isnan(v) for v in _values(result)):
                nan_only.append(f"{title}/{ref}: {expr}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
        assert not nan_only, "queries with only NaN:\n" + "\n".join(nan_only)

        # 6. The store's real traffic is what Prometheus saw.
        sel = f'job="{JOB}", instance="{instance}"'
        for expr in (f'sum(cachedstore_cache_requests_total{{{sel}, result="hit"}})',
                     f'sum(cachedstore_cache_requests_total{{{sel}, result="miss"}})',
                     f'sum(cachedstore_etcd_requests_total{{{sel}, code="ok"}})',
                     f"sum(cachedstore_cache_evictions_total{{{sel}}})",
                     f'cachedstore_watch_events_total{{{sel}, type="put"}}',
                     f'cachedstore_watch_events_total{{{sel}, type="delete"}}',
                     f"cachedstore_cache_entries{{{sel}}}",
                     f"cachedstore_watch_revision{{{sel}}}",
                     f"cachedstore_watch_up{{{sel}}}"):
            values = _values(prom.query(expr))
            assert values and all(v > 0 for v in values), f"{expr}: {values}"
        # The same queries with Grafana's "All" (.*) also match.
        for _title, _ref, raw in queries[:3]:
            assert prom.query(expand(raw, rate_interval=RATE_INTERVAL))
    finally:
        stop_prometheus(prom)
    assert prom.process.returncode is not None
    assert time.monotonic() - started < BUDGET
