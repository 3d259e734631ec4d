"""deploy/grafana's dashboard: well formed, and querying only metrics that a live gateway (in front of
model-free workers) exports, under the series names Prometheus stores for them."""
from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from deploy_harness import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "inference-dashboard.json"

pytestmark = pytest.mark.timeout(180)


# ---- the dashboard ----------------------------------------------------------------------------------
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
             "group_left", "group_right", "start", "end"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    aggregations, keywords, label names (in matchers or clauses) or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = _CLAUSE.sub(" ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w$:.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        if not m.group(2) and m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names


def grafana_query_metrics(query: str) -> set[str]:
    """A template variable's query: label_values(METRIC{...}, label), metrics(...), or PromQL."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
    return promql_metrics(m.group(1)) if m else promql_metrics(query)


def test_promql_metrics():
    assert promql_metrics('histogram_quantile(0.9, sum by (le, bucket) (rate(a_seconds_bucket{ns=~"$ns", '
                          'w="x(y)"}[$__rate_interval])))') == {"a_seconds_bucket"}
    assert promql_metrics("sum by (worker) (rate(hits_total[5m])) / sum(rate(queries_total[5m])) by (worker)") == {
        "hits_total", "queries_total"}
    assert promql_metrics("1 - max(free_bytes offset 5m) > bool 0 and on(worker) group_left(kind) up") == {
        "free_bytes", "up"}
    assert promql_metrics('max_over_time(gauge_a[1h:5m]) or vector(0)') == {"gauge_a"}
    assert grafana_query_metrics('label_values(worker_up{namespace=~"$namespace"}, worker)') == {"worker_up"}


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))  # collapsed rows hold their panels
    walk(dashboard["panels"])
    return exprs


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            # Brackets balance, and every variable used is defined (or Grafana's own).
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            for var in re.findall(r"\$(\w+)", expr):
                assert var.startswith("__") or var in variables, (panel["title"], var)


def _exported_series(text: str) -> tuple[set[str], set[str]]:
    """The series names Prometheus stores from a /metrics page: a counter `x` as x_total, a
    histogram as x_bucket/_sum/_count; and, of those, the ones with samples now."""
    from prometheus_client.parser import text_string_to_metric_families
    declared, sampled = set(), set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created")}
    for family in text_string_to_metric_families(text):
        declared |= {family.name + s for s in suffixes.get(family.type, ("",))}
        sampled |= {s.name for s in family.samples}
    return declared, sampled


def test_dashboard_metrics_exist_in_a_live_gateway(served_checkpoint):
    from gateway_fake_cluster import FakeCluster, request
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set().union(*map(promql_metrics, dashboard_queries(dashboard)))
    queried |= set().union(*(grafana_query_metrics(v["definition"]) for v in dashboard["templating"]["list"]
                             if v["type"] == "query"))
    assert len(queried) >= 20
    # Two workers (so routing has a choice); the same long prompt twice, so the second finds the
    # first's blocks in the prefix cache.
    with FakeCluster(served_checkpoint, num_workers=2, step_ms=5) as cluster:
        for i in range(2):
            for _ in cluster.stub.Generate(request(prompt_token_ids=range(5, 45), request_id=f"dash-{i}",
                                                   sampling=dict(max_tokens=4, ignore_eos=True)), timeout=30):
                pass
        time.sleep(1.0)  # a few heartbeats, with the prefix-cache counters of both requests
        text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    declared, sampled = _exported_series(text)
    missing = sorted(queried - declared)
    assert not missing, f"the dashboard queries series the gateway does not export: {missing}"
    # What one served request must have put on every panel's main series: the latency histograms,
    # throughput, status, queues, KV, watchdog, readiness, routing and the prefix cache.
    expected_live = {n for n in queried if n.endswith("_bucket")} | {
        "inference_generation_tokens_total", "inference_request_status_total", "inference_request_success_total",
        "inference_kv_cache_usage_perc", "inference_worker_memory_level", "inference_worker_ready",
        "inference_routing_decisions_total", "inference_prefix_cache_queries_total",
        "inference_prefix_cache_hits_total", "inference_num_requests_running"}
    assert not sorted(expected_live - sampled), f"no samples yet for {sorted(expected_live - sampled)}"
