"""The demo's figures: counted from the clients' registries and etcd's ``/metrics``, and
summed up into the summary that ``--json`` prints and the table shows.

Pure functions of their inputs, except :func:`etcd_counts` and :func:`settled_etcd_counts`,
which block on an HTTP request to etcd (at most 3 s each, plus ``SETTLE_TIMEOUT``).
"""

from __future__ import annotations

import array
import math
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from .settings import DemoSettings
from .uncached import UNCACHED_MEANS

#: Seconds the parent waits for etcd to finish handling every RPC it started before
#: reading its request count (a closed watch stream is counted when its handler returns).
SETTLE_TIMEOUT = 3.0
#: The latencies every worker samples, in the table's order: (key, label in the table,
#: unit in the summary). The summary holds ``<key>_p50_<unit>`` and ``<key>_p99_<unit>``.
LATENCIES = (("hot_read", "hot read", "us"), ("all_gather", "all-gather", "ms"),
             ("barrier", "barrier", "ms"))
#: A summary unit's scale from seconds and the decimals it keeps.
UNITS = {"us": (1e6, 1), "ms": (1e3, 3)}


def tally(families: Iterable[Metric], keys: Callable[[Sample], Iterable[str]]
          ) -> dict[str, float]:
    """The sum of the samples' values under each name ``keys(sample)`` gives (none: the
    sample is not counted), in the order the names first appear."""
    counts: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            for key in keys(sample):
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def increments(before: Mapping[str, float], after: Mapping[str, float], prefix: str
               ) -> dict[str, float]:
    """How much each count named ``prefix...`` in ``after`` grew since ``before``, by its
    name without ``prefix``; counts that did not grow are left out."""
    grown: dict[str, float] = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if key.startswith(prefix) and delta > 0:
            grown[key[len(prefix):]] = delta
    return grown


def _client_keys(sample: Sample) -> tuple[str, ...]:
    if sample.name == "cachedstore_cache_requests_total":
        return ("hits" if sample.labels.get("result") == "hit" else "misses",)
    if sample.name == "cachedstore_etcd_requests_total":
        return ("rpc:" + sample.labels.get("method", "?"),)
    return ()


def client_counts(registry: CollectorRegistry) -> dict[str, float]:
    """Cache hits/misses and etcd RPCs by method (``rpc:<method>``) recorded in
    ``registry`` so far."""
    return tally(registry.collect(), _client_keys)


def _etcd_keys(sample: Sample) -> tuple[str, ...]:
    if sample.name == "grpc_server_started_total":
        return ("started",)
    if sample.name == "grpc_server_handled_total":
        return ("handled", "etcd:" + sample.labels.get("grpc_method", "?"))
    return ()


def etcd_counts(metrics_url: str | None) -> dict[str, float] | None:
    """etcd's ``grpc_server_handled_total`` by method (``etcd:<method>``, and
    started/handled totals) from its ``/metrics``, or None when it cannot be read."""
    if metrics_url is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(metrics_url, timeout=3.0) as response:
            text = response.read().decode()
        return {"started": 0.0, "handled": 0.0,
                **tally(text_string_to_metric_families(text), _etcd_keys)}
    except (OSError, ValueError):
        return None


def settled_etcd_counts(metrics_url: str | None, before: dict[str, float] | None
                        ) -> dict[str, float] | None:
    """:func:`etcd_counts` once etcd has handled every RPC the phase started: once no more
    RPCs are in flight than when the phase began (``before``), or after ``SETTLE_TIMEOUT``."""
    baseline = 0.0 if before is None else before["started"] - before["handled"]
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        counts = etcd_counts(metrics_url)
        if counts is None or counts["started"] - counts["handled"] <= baseline \
                or time.monotonic() >= deadline:
            return counts
        time.sleep(0.02)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not); 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def phase_summary(results: list[dict[str, Any]], wall: float,
                  etcd_before: dict[str, float] | None,
                  etcd_after: dict[str, float] | None) -> dict[str, Any]:
    """One phase's figures from every worker's result (see ``workload.run_phase``) and
    etcd's counts before and after it (None: not available)."""
    def merged(name: str) -> array.array[float]:
        out = array.array("d")
        for result in results:
            out.frombytes(result[name])
        return out

    rpcs: Counter[str] = Counter()
    for result in results:
        rpcs.update(result["rpcs"])
    hits = sum(r["hits"] for r in results)
    misses = sum(r["misses"] for r in results)
    server: dict[str, int] | None = None
    if etcd_before is not None and etcd_after is not None:
        server = {k: int(v) for k, v in increments(etcd_before, etcd_after, "etcd:").items()}
    summary: dict[str, Any] = {
        "wall_seconds": round(wall, 3),
        "operations": sum(r["ops"] for r in results),
        "reads": sum(r["reads"] for r in results),
        "cache_hits": int(hits),
        "cache_misses": int(misses),
        "hit_ratio": round(hits / (hits + misses), 4) if hits + misses else None,
    }
    for key, _, unit in LATENCIES:
        samples, (scale, digits) = merged(key), UNITS[unit]
        for q in (50, 99):
            summary[f"{key}_p{q}_{unit}"] = round(percentile(samples, q / 100) * scale, digits)
    summary.update({
        "etcd_requests_client": int(sum(rpcs.values())),
        "etcd_requests_client_by_method": {k: int(v) for k, v in sorted(rpcs.items())},
        "etcd_requests_server": None if server is None else sum(server.values()),
        "etcd_requests_server_by_method": server,
    })
    return summary


def ratio(uncached: float | None, cached: float | None) -> float | None:
    """``uncached / cached`` to one decimal; None when either is unknown or cached is 0."""
    if uncached is None or cached is None or cached <= 0:
        return None
    return round(uncached / cached, 1)


def demo_summary(settings: DemoSettings, etcd_info: dict[str, Any], prefix: str,
                 phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The whole run's summary (what ``--json`` prints) from both phases' summaries."""
    cached, uncached = phases["cached"], phases["uncached"]
    return {
        "workers": settings.workers,
        "rounds": settings.rounds,
        "hot_reads_per_round": settings.hot_reads,
        "etcd": {k: etcd_info[k] for k in ("endpoints", "embedded", "version")},
        "prefix": prefix,
        "cached": cached,
        "uncached": uncached,
        "reduction": {
            "etcd_requests_client": ratio(uncached["etcd_requests_client"],
                                          cached["etcd_requests_client"]),
            "etcd_requests_server": ratio(uncached["etcd_requests_server"],
                                          cached["etcd_requests_server"]),
            "hot_read_p50": ratio(uncached["hot_read_p50_us"], cached["hot_read_p50_us"]),
            "wall_time": ratio(uncached["wall_seconds"], cached["wall_seconds"]),
        },
        "uncached_means": UNCACHED_MEANS,
    }
