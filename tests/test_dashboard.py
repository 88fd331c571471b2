"""Static checks of the Grafana dashboard ``grafana/cachedstore.json``.

Every panel query is expanded (Grafana variables replaced by plain values) and parsed with
``promql-parser``; the metric names it selects must be cachedstore's (see
:data:`cachedstore.metrics.METRIC_NAMES`), its selectors must carry the ``$job``/``$instance``
filters and its range vectors must use ``$__rate_interval``. The helpers at the top are also
used by ``tests/test_prometheus_e2e.py``, which runs the same queries against a real Prometheus.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client import CollectorRegistry

from cachedstore.metrics import METRIC_NAMES, make_metrics

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "cachedstore.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

#: Panels the dashboard must have: title -> panel type.
REQUIRED_PANELS: dict[str, str] = {
    "Hit ratio": "stat",
    "Hit ratio by op": "timeseries",
    "Requests by op and result": "timeseries",
    "Request latency p50 / p90 / p99": "timeseries",
    "Request latency heatmap": "heatmap",
    "etcd RPC rate by method": "timeseries",
    "etcd RPC latency": "timeseries",
    "etcd errors by code": "timeseries",
    "Cache entries, top 10 instances": "timeseries",
    "Cache evictions, top 10 instances": "timeseries",
    "Watches down": "stat",
    "Watch restarts by reason": "timeseries",
    "Watch lag, top 10 instances": "timeseries",
    "Waiters, top 10 instances": "timeseries",
    "Fills dropped, top 10 instances": "timeseries",
    "Stale reads, top 10 instances": "timeseries",
}

# $name, ${name}, ${name:format} and the deprecated [[name]].
_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w-]+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def expand(expr: str, values: Mapping[str, str] | None = None, rate_interval: str = "1m") -> str:
    """``expr`` with every Grafana variable replaced, ready for a PromQL parser or server.

    Defaults: ``$__rate_interval``/``$__interval``/``$__range`` become ``rate_interval`` and
    ``$job``/``$instance`` become ``.*`` (what the "All" option sends). ``values`` overrides or
    adds variables. An unknown variable raises :class:`KeyError`.
    """
    table = {
        "__rate_interval": rate_interval,
        "__interval": rate_interval,
        "__range": rate_interval,
        "job": ".*",
        "instance": ".*",
        **(values or {}),
    }

    def sub(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g is not None)
        if name not in table:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return table[name]

    return _VARIABLE.sub(sub, expr)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard model."""
    return json.loads(path.read_text(encoding="utf-8"))


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(panel title, refId, raw expr)`` of every panel target."""
    return [(p["title"], t["refId"], t["expr"]) for p in iter_panels(dashboard)
            for t in p.get("targets", [])]


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every vector selector in a PromQL expression (including those inside range vectors)."""
    found: list[promql_parser.VectorSelector] = []
    promql_parser.walk(
        promql_parser.parse(expr),
        pre_visit=lambda node: found.append(node)
        if isinstance(node, promql_parser.VectorSelector) else None,
    )
    return found


def selector_name(vs: promql_parser.VectorSelector) -> str | None:
    """The metric name a selector selects (``foo`` or ``{__name__="foo"}``)."""
    if vs.name:
        return vs.name
    for m in vs.matchers.matchers:
        if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal:
            return m.value
    return None


def metric_names(expr: str) -> set[str | None]:
    """Metric names selected by ``expr`` (None for a selector without a fixed name)."""
    return {selector_name(vs) for vs in selectors(expr)}


def _family_types() -> dict[str, str]:
    registry = CollectorRegistry()
    make_metrics(registry)
    types = {}
    for family in registry.collect():
        # prometheus-client strips _total from counter family names.
        name = family.name + "_total" if family.type == "counter" else family.name
        types[name] = family.type
    return types


def allowed_names() -> dict[str, str]:
    """Every series name a query may select -> the family in METRIC_NAMES it belongs to."""
    types = _family_types()
    allowed = {}
    for name in METRIC_NAMES:
        allowed[name] = name
        if types.get(name) == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                allowed[name + suffix] = name
    return allowed


# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def test_json_is_what_the_generator_writes() -> None:
    proc = subprocess.run(
        [sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_metric_names_are_known_to_the_metrics_module() -> None:
    types = _family_types()
    assert set(METRIC_NAMES) == set(types), "METRIC_NAMES and the registry disagree"
    assert types["cachedstore_request_duration_seconds"] == "histogram"


def test_no_inputs_and_a_datasource_variable(dashboard: dict[str, Any]) -> None:
    assert "__inputs" not in dashboard
    assert "__requires" not in dashboard
    text = DASHBOARD.read_text(encoding="utf-8")
    assert "${DS_" not in text, "an exported-for-sharing datasource placeholder is left"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource"
    assert ds["query"] == "prometheus"
    for name in ("job", "instance"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"] == DATASOURCE
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert query.startswith("label_values(") and "cachedstore_watch_up" in query
        assert query.rstrip(")").endswith(name)
        assert var["includeAll"] and var["allValue"] == ".*"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] == "cachedstore"


def test_every_panel_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in iter_panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for t in panel["targets"]:
            assert t.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]


def test_every_panel_has_a_unit(dashboard: dict[str, Any]) -> None:
    for panel in iter_panels(dashboard):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert unit, f"{panel['title']}: no unit"
        if panel["type"] == "heatmap":
            assert panel["options"]["yAxis"]["unit"] == "s"


def test_panel_ids_and_ref_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]] + [
        p["id"] for r in dashboard["panels"] for p in r.get("panels", [])]
    assert len(ids) == len(set(ids))
    for panel in iter_panels(dashboard):
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])


def test_required_panels_exist(dashboard: dict[str, Any]) -> None:
    panels = {p["title"]: p for p in iter_panels(dashboard)}
    for title, kind in REQUIRED_PANELS.items():
        assert title in panels, f"missing panel {title!r}"
        assert panels[title]["type"] == kind, title


def test_latency_quantiles_and_heatmap(dashboard: dict[str, Any]) -> None:
    panels = {p["title"]: p for p in iter_panels(dashboard)}
    exprs = [t["expr"] for t in panels["Request latency p50 / p90 / p99"]["targets"]]
    for q in ("0.5", "0.9", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q}, sum by (le, op) (rate(") for e in exprs)
    assert all("cachedstore_request_duration_seconds_bucket" in e for e in exprs)
    (target,) = panels["Request latency heatmap"]["targets"]
    assert target["format"] == "heatmap"
    assert metric_names(expand(target["expr"])) == {"cachedstore_request_duration_seconds_bucket"}
    assert "by (le)" in target["expr"]
    (errors,) = panels["etcd errors by code"]["targets"]
    assert 'code!="ok"' in errors["expr"]


def test_every_query_parses_and_selects_known_metrics(dashboard: dict[str, Any]) -> None:
    allowed = allowed_names()
    used = set()
    queries = dashboard_queries(dashboard)
    assert len(queries) >= len(REQUIRED_PANELS)
    for title, ref, raw in queries:
        expr = expand(raw)
        try:
            names = metric_names(expr)
        except Exception as exc:  # promql-parser raises ValueError-like errors
            pytest.fail(f"{title}/{ref}: {expr!r} does not parse: {exc}")
        assert names, f"{title}/{ref}: selects nothing"
        for name in names:
            assert name in allowed, f"{title}/{ref}: unknown metric {name!r}"
            used.add(allowed[name])
    # Every exported family is on the dashboard.
    assert used == set(METRIC_NAMES), f"not on the dashboard: {set(METRIC_NAMES) - used}"


def test_every_selector_is_filtered_by_job_and_instance(dashboard: dict[str, Any]) -> None:
    sentinels = {"job": "JOB_SENTINEL", "instance": "INSTANCE_SENTINEL"}
    for title, ref, raw in dashboard_queries(dashboard):
        for vs in selectors(expand(raw, sentinels)):
            for label, value in sentinels.items():
                assert any(m.name == label and m.op == promql_parser.MatchOp.Re
                           and m.value == value for m in vs.matchers.matchers), (
                    f"{title}/{ref}: {selector_name(vs)} lacks {label}=~\"${label}\"")


def test_every_range_uses_rate_interval(dashboard: dict[str, Any]) -> None:
    sentinel = "17m31s"  # a duration no panel would write by hand
    expected = datetime.timedelta(minutes=17, seconds=31)
    ranges = 0
    for title, ref, raw in dashboard_queries(dashboard):
        ast = promql_parser.parse(expand(raw, rate_interval=sentinel))
        found: list[Any] = []
        promql_parser.walk(ast, pre_visit=lambda n, found=found: found.append(n))
        for node in found:
            assert not isinstance(node, promql_parser.SubqueryExpr), f"{title}/{ref}: subquery"
            if isinstance(node, promql_parser.MatrixSelector):
                ranges += 1
                assert node.range == expected, f"{title}/{ref}: range is not $__rate_interval"
            if isinstance(node, promql_parser.Call) and node.func.name in (
                    "rate", "irate", "increase", "delta", "idelta", "deriv"):
                assert isinstance(node.args[0], promql_parser.MatrixSelector), f"{title}/{ref}"
        # The raw text too: nothing like [5m] hard-coded next to the variable.
        assert not re.search(r"\[\s*\d+[smhdwy]", raw), f"{title}/{ref}: fixed range in {raw!r}"
    assert ranges > 0


def test_expand() -> None:
    assert expand('rate(x{job=~"$job"}[$__rate_interval])') == 'rate(x{job=~".*"}[1m])'
    assert expand("${job:regex} [[instance]]", {"job": "a"}) == "a .*"
    with pytest.raises(KeyError):
        expand("$nope")


def test_provisioning_files() -> None:
    import yaml  # the test extra installs PyYAML
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1
    assert any(d["type"] == "prometheus" for d in ds["datasources"])
    dash = yaml.safe_load((GRAFANA / "provisioning/dashboards/cachedstore.yaml").read_text())
    assert dash["apiVersion"] == 1
    assert dash["providers"][0]["type"] == "file"
    scrape = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "cachedstore"]
    assert job["scrape_interval"] == "5s"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"localhost:{port}" for port in range(9464, 9472)]


def test_fleet_scale_queries(dashboard: dict[str, Any]) -> None:
    """With 8,000 instances: watches down is a count of == 0 (not a sum that one healthy
    watch turns green), per-instance panels are topk, and the watch lag has a panel."""
    panels = {p["title"]: p for p in iter_panels(dashboard)}
    down = panels["Watches down"]["targets"][0]["expr"]
    assert down.startswith("count(") and "cachedstore_watch_up" in down and "== 0" in down
    assert "sum(" not in down
    for title, panel in panels.items():
        for t in panel.get("targets", []):
            if "by (instance)" in t["expr"]:
                assert t["expr"].startswith("topk("), title
    lag = panels["Watch lag, top 10 instances"]["targets"][0]["expr"]
    assert "max(" in lag and " - " in lag and "cachedstore_watch_revision" in lag
