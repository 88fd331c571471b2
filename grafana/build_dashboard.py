#!/usr/bin/env python3
"""Generate ``grafana/cachedstore.json``, the Grafana dashboard of cachedstore's metrics.

The JSON file is what Grafana loads (by provisioning or by import); this script is its source,
so that every query is written once, filtered the same way and checked by
``tests/test_dashboard.py``. After editing the panels below run::

    python grafana/build_dashboard.py          # rewrite grafana/cachedstore.json
    python grafana/build_dashboard.py --check  # exit 1 if the JSON is out of date

Conventions (checked by the tests): every panel queries the ``${datasource}`` variable, every
selector is filtered by ``job=~"$job", instance=~"$instance"``, every ``rate``/``increase``
uses ``$__rate_interval``, and every panel has a unit. The script uses the standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("cachedstore.json")

DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
#: The label filter every selector carries.
SEL = 'job=~"$job", instance=~"$instance"'
RI = "$__rate_interval"

Panel = dict[str, Any]


def sel(metric: str, extra: str = "") -> str:
    """``metric{job=~"$job", instance=~"$instance"[, extra]}``."""
    return f"{metric}{{{SEL}{', ' + extra if extra else ''}}}"


def rate(metric: str, extra: str = "") -> str:
    """``rate(metric{...}[$__rate_interval])``."""
    return f"rate({sel(metric, extra)}[{RI}])"


def quantile(q: float, histogram: str, by: str) -> str:
    """``histogram_quantile`` over the bucket rates of ``histogram``, kept apart by ``by``."""
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(histogram + '_bucket')}))"


def target(expr: str, legend: str = "__auto", ref: str = "A", **extra: Any) -> dict[str, Any]:
    """One Prometheus query of a panel."""
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "refId": ref,
        **extra,
    }


def _refs(exprs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(exprs)]


def timeseries(title: str, unit: str, exprs: list[tuple[str, str]], description: str,
               *, stack: bool = False, minimum: float | None = 0) -> Panel:
    """A time series panel with one query per ``(expr, legend)``."""
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "fillOpacity": 10,
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
    }
    defaults: dict[str, Any] = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if minimum is not None:
        defaults["min"] = minimum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"calcs": ["mean", "max", "lastNotNull"], "displayMode": "table",
                       "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _refs(exprs),
    }


def stat(title: str, unit: str, expr: str, description: str,
         steps: list[tuple[float | None, str]], *, decimals: int | None = None) -> Panel:
    """A single-value panel coloured by threshold ``steps`` (``(from, colour)``, first from None)."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute",
                       "steps": [{"color": c, "value": v} for v, c in steps]},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": [target(expr, "", "A", instant=False)],
    }


def heatmap(title: str, histogram: str, description: str) -> Panel:
    """A heatmap of a histogram's bucket rates (Prometheus ``format: heatmap``)."""
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        # Cells are requests per second falling in a bucket; the y axis is the bucket bound.
        "fieldConfig": {"defaults": {"unit": "reqps"}, "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "cellValues": {"unit": "reqps"},
            "color": {"exponent": 0.5, "fill": "dark-orange", "mode": "scheme", "reverse": False,
                      "scale": "exponential", "scheme": "Spectral", "steps": 64},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "showColorScale": False, "yHistogram": True},
            "yAxis": {"axisPlacement": "left", "reverse": False, "unit": "s"},
        },
        "targets": [target(f"sum by (le) ({rate(histogram + '_bucket')})", "{{le}}", "A",
                           format="heatmap")],
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


HITS = 'result="hit"'
NOT_OK = 'code!="ok"'
REQ = "cachedstore_cache_requests_total"
DUR = "cachedstore_request_duration_seconds"
ETCD = "cachedstore_etcd_requests_total"
ETCD_DUR = "cachedstore_etcd_request_duration_seconds"

# (panel, width, height); rows take the full width. Panels flow left to right.
LAYOUT: list[tuple[Panel, int, int]] = [
    (row("Cache"), 24, 1),
    (stat("Hit ratio", "percentunit",
          f"sum({rate(REQ, HITS)}) / sum({rate(REQ)})",
          "Share of requested keys served from the cache (all read operations).",
          [(None, "red"), (0.5, "orange"), (0.9, "green")]), 4, 8),
    (timeseries("Hit ratio by op", "percentunit",
                [(f"sum by (op) ({rate(REQ, HITS)}) / sum by (op) ({rate(REQ)})", "{{op}}")],
                "Share of requested keys served from the cache, per read operation.",
                minimum=0), 10, 8),
    (timeseries("Requests by op and result", "reqps",
                [(f"sum by (op, result) ({rate(REQ)})", "{{op}} {{result}}")],
                "Keys requested per second (mget/amget count each key), hits and misses.",
                stack=True), 10, 8),
    (timeseries("Cache entries, top 10 instances", "short",
                [(f"topk(10, sum by (instance) ({sel('cachedstore_cache_entries')}))",
                  "{{instance}}")],
                "Entries held in the caches (values and absent-key markers): the 10 "
                "instances holding most."),
     12, 8),
    (timeseries("Cache evictions, top 10 instances", "ops",
                [(f"topk(10, sum by (instance) ({rate('cachedstore_cache_evictions_total')}))",
                  "{{instance}}")],
                "Entries evicted per second to keep each cache within its size: the 10 "
                "instances evicting most."), 12, 8),
    (row("Latency"), 24, 1),
    (timeseries("Request latency p50 / p90 / p99", "s",
                [(quantile(0.5, DUR, "op"), "p50 {{op}}"),
                 (quantile(0.9, DUR, "op"), "p90 {{op}}"),
                 (quantile(0.99, DUR, "op"), "p99 {{op}}")],
                "Duration of store operations as callers see them, by operation."), 12, 9),
    (heatmap("Request latency heatmap", DUR,
             "Distribution of store operation durations (all operations)."), 12, 9),
    (row("etcd"), 24, 1),
    (timeseries("etcd RPC rate by method", "reqps",
                [(f"sum by (method) ({rate(ETCD)})", "{{method}}")],
                "RPCs sent to etcd per second, by method (all status codes)."), 8, 8),
    (timeseries("etcd RPC latency", "s",
                [(f"histogram_quantile(0.5, sum by (le) ({rate(ETCD_DUR + '_bucket')}))", "p50"),
                 (f"histogram_quantile(0.99, sum by (le) ({rate(ETCD_DUR + '_bucket')}))",
                  "p99")],
                "Duration of unary RPCs sent to etcd (all methods; etcd's own "
                "grpc_server_handling_seconds has them by method)."), 8, 8),
    (timeseries("etcd errors by code", "reqps",
                [(f"sum by (method, code) ({rate(ETCD, NOT_OK)})",
                  "{{method}} {{code}}")],
                "Failed etcd RPCs per second, by method and gRPC status code."), 8, 8),
    (row("Watch"), 24, 1),
    (stat("Watches down", "none",
          f"count({sel('cachedstore_watch_up')} == 0) or vector(0)",
          "Processes whose watch is down (cachedstore_watch_up == 0): they serve no cached "
          "entries. Any value above 0 is worth a look.",
          [(None, "green"), (1, "red")], decimals=0), 4, 8),
    (timeseries("Watches down by job", "none",
                [(f"count by (job) ({sel('cachedstore_watch_up')} == 0) or "
                  f"0 * count by (job) ({sel('cachedstore_watch_up')})", "{{job}} down"),
                 (f"count by (job) ({sel('cachedstore_watch_up')})", "{{job}} reporting")],
                "Processes whose watch is down, and processes reporting at all, per job."),
     10, 8),
    (timeseries("Watch restarts by reason", "short",
                [(f"sum by (reason) (increase({sel('cachedstore_watch_restarts_total')}[{RI}]))",
                  "{{reason}}")],
                "Watch stream restarts per interval, by reason; each one drops the cache.",
                stack=True), 10, 8),
    (timeseries("Watch events by type", "ops",
                [(f"sum by (type) ({rate('cachedstore_watch_events_total')})", "{{type}}")],
                "Events received on the watch streams per second, by type."), 12, 8),
    (timeseries("Watch lag, top 10 instances", "none",
                [(f"topk(10, scalar(max({sel('cachedstore_watch_revision')})) - "
                  f"max by (instance) ({sel('cachedstore_watch_revision')}))",
                  "{{instance}}")],
                "Revisions each watch is behind the newest revision any watch has confirmed "
                "(etcd's revision, up to one scrape interval): the 10 furthest behind. A "
                "watch learns etcd's revision from its events (and progress answers): one "
                "that only PINGs while quiet, or watches only what its store touched, shows "
                "the revision of its last event, which is not staleness."),
     12, 8),
    (timeseries("Watch scopes, top 10 instances", "none",
                [(f"topk(10, sum by (instance) ({sel('cachedstore_watch_scopes')}))",
                  "{{instance}}")],
                "Watches on each process's streams: 1 per store watching its prefix, one per "
                "scope a store touched with watch_scope=touched (etcd pays per watch and "
                "per event it matches)."), 12, 8),
    (timeseries("Quiet scopes read afresh, top 10 instances", "ops",
                [(f"topk(10, sum by (instance) "
                  f"({rate('cachedstore_watch_quiet_refreshes_total')}))",
                  "{{instance}}")],
                "Scopes read again after a reconnect because nothing in their range changed "
                "meanwhile (no event to end their replay); one read per scope."), 12, 8),
    (timeseries("Watch liveness checks", "ops",
                [(f"sum by (kind) ({rate('cachedstore_watch_liveness_requests_total')})",
                  "{{kind}}")],
                "What quiet watch streams send to learn etcd is still there: HTTP/2 PINGs "
                "(answered by etcd's transport, not an etcd request) or, with grpcio or "
                "after etcd refused PINGs, progress requests (etcd requests)."), 12, 8),
    (row("Blocking and consistency"), 24, 1),
    (timeseries("Waiters, top 10 instances", "short",
                [(f"topk(10, sum by (instance) ({sel('cachedstore_waiters')}))",
                  "{{instance}}")],
                "Blocked gets and waits right now: the 10 instances with most."), 8, 8),
    (timeseries("Fills dropped, top 10 instances", "ops",
                [(f"topk(10, sum by (instance) ({rate('cachedstore_fills_dropped_total')}))",
                  "{{instance}}")],
                "Read-through results refused per second because a newer write was known."),
     8, 8),
    (timeseries("Stale reads, top 10 instances", "ops",
                [(f"topk(10, sum by (instance) ({rate('cachedstore_stale_reads_total')}))",
                  "{{instance}}")],
                "Reads per second served from the cache while the watch was down "
                "(max_staleness mode)."), 8, 8),
]


def _layout(layout: list[tuple[Panel, int, int]]) -> list[Panel]:
    """Give every panel an id and a gridPos, flowing left to right in a 24-column grid."""
    panels: list[Panel] = []
    x = y = row_h = 0
    for pid, (panel, w, h) in enumerate(layout, start=1):
        if x + w > 24 or panel["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        panels.append({"id": pid, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel})
        x += w
        row_h = max(row_h, h)
        if panel["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return panels


def _query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"qryType": 1, "query": query,
                  "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,  # on time range change
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "regex": "",
        "hide": 0,
        "options": [],
    }


def build() -> dict[str, Any]:
    """The dashboard model."""
    return {
        "title": "cachedstore",
        "uid": "cachedstore",
        "description": "Coherent read-through LRU cache in front of etcd v3: cache hit ratio, "
                       "latency, etcd RPCs and watch health.",
        "tags": ["cachedstore", "etcd", "cache"],
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }]},
        "templating": {"list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "includeAll": False,
                "multi": False,
                "options": [],
                "refresh": 1,
                "regex": "",
            },
            _query_variable("job", "Job", "label_values(cachedstore_watch_up, job)"),
            _query_variable("instance", "Instance",
                            'label_values(cachedstore_watch_up{job=~"$job"}, instance)'),
        ]},
        "panels": _layout(LAYOUT),
    }


def render() -> str:
    """The dashboard as the JSON text committed to the repository."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the committed JSON differs")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output file (default {OUT})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
