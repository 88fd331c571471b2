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

import json
import math
import os
import shutil
import signal
import socket
import subprocess
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

from cachedstore.exposition import MetricsServer, start_metrics_server
from cachedstore.metrics import READ_OPS, RESTART_REASONS, StoreMetrics, make_metrics

try:
    from test_dashboard import dashboard_queries, expand, load_dashboard
except ImportError:  # tests/ imported as a package
    from tests.test_dashboard import dashboard_queries, expand, load_dashboard

#: Whole-test budget in seconds; each wait below takes a share of it.
BUDGET = 55.0
SCRAPE_INTERVAL = "1s"
#: What $__rate_interval becomes: long enough to hold every scrape of the test.
RATE_INTERVAL = "30s"
JOB = "cachedstore"

pytestmark = pytest.mark.timeout(90)


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


def synthetic_traffic(m: StoreMetrics, round_: int) -> None:
    """One round of samples for every metric, written straight to a store's metrics."""
    for op in READ_OPS:
        m.hit[op].inc(3)
        m.miss[op].inc()
        m.duration[op].observe(0.00002 * (1 + round_ % 7))
    m.duration["set"].observe(0.002)
    m.rpc("range", "ok", 0.001)
    m.rpc("txn", "ok", 0.002)
    m.rpc("put", "ok", 0.0015)
    m.rpc("range", "UNAVAILABLE", 0.05)
    m.entries.set(100 + round_)
    m.evictions.inc()
    m.events_put.inc(2)
    m.events_delete.inc()
    m.watch_up.set(1)
    m.watch_revision.set(1000 + round_)
    m.waiters.set(round_ % 3)
    m.fills_dropped.inc()
    m.stale_reads.inc()
    m.restart(RESTART_REASONS[round_ % len(RESTART_REASONS)])


@dataclass
class Target:
    """What Prometheus scrapes: a registry served over HTTP, and a way to make traffic."""

    metrics: StoreMetrics
    server: MetricsServer

    def traffic(self, round_: int) -> None:
        synthetic_traffic(self.metrics, round_)


@pytest.fixture
def target() -> Iterator[Target]:
    registry = CollectorRegistry()
    metrics = make_metrics(registry)
    assert isinstance(metrics, StoreMetrics)
    server = start_metrics_server(0, registry=registry)
    try:
        yield Target(metrics, server)
    finally:
        server.close()


# ---- the test --------------------------------------------------------------------------------


def test_every_dashboard_query_returns_data(target: Target, tmp_path: Path) -> None:
    binary = prometheus_binary()
    started = time.monotonic()
    deadline = started + BUDGET
    instance = f"127.0.0.1:{target.server.port}"
    target.traffic(0)
    prom = start_prometheus(binary, tmp_path, [instance], min(deadline, started + 20))
    try:
        # 1. The target is scraped.
        wait_for("the first scrape", lambda: _values(prom.query(f'up{{job="{JOB}"}}')) == [1.0],
                 deadline, prom)

        # 2. Traffic over a few scrapes, so that every rate has two samples that differ.
        traffic_end = time.monotonic() + 3.5
        round_ = 1
        while time.monotonic() < traffic_end:
            target.traffic(round_)
            round_ += 1
            time.sleep(0.1)
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
        # The same queries with Grafana's "All" (.*) also match.
        for _title, _ref, raw in queries[:3]:
            assert prom.query(expand(raw, rate_interval=RATE_INTERVAL))
    finally:
        stop_prometheus(prom)
    assert prom.process.returncode is not None
    assert time.monotonic() - started < 60
