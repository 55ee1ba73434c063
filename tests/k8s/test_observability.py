"""The Grafana dashboard and Prometheus alerts in deploy/ only query metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from orchestrator.frontend.metrics import Metrics
from router.metrics import RouterMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\bweir_[a-z_]+\b")
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names as Prometheus scrapes them from the frontend, the router and workers."""
    import orchestrator.runtime.worker_metrics  # noqa: F401  (registers on the default registry)

    registries = [Metrics().registry, REGISTRY]
    RouterMetrics(registry=(router := CollectorRegistry()))
    registries.append(router)
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        if family.name.startswith("weir_")
        for suffix in SUFFIXES.get(family.type, [""])
    }


def _balanced(expr: str) -> bool:
    depth = 0
    for char in expr:
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def test_alert_rules(exported: set[str]) -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "weir-alerts.yaml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    names = {rule["alert"] for rule in alerts}
    # What the issue asks for: high TTFT, no workers, error rate.
    assert {"WeirHighTimeToFirstToken", "WeirNoWorkers", "WeirHighErrorRate"} <= names
    assert len(names) == len(alerts)
    for rule in alerts:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert _balanced(rule["expr"]), rule["alert"]
        used = set(METRIC.findall(rule["expr"]))
        assert used and used <= exported, f"{rule['alert']} uses unknown metrics {used - exported}"


def test_grafana_dashboard(exported: set[str]) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "weir-dashboard.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = {p["title"] for p in panels if p["type"] == "row"}
    assert titles == {"Frontend", "Router", "Workers"}
    used: set[str] = set()
    for panel in (p for p in panels if p["type"] != "row"):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert _balanced(target["expr"]), panel["title"]
            used |= set(METRIC.findall(target["expr"]))
    assert used <= exported, f"the dashboard queries unknown metrics {used - exported}"
    # The signals an operator scales on are all there.
    assert {
        "weir_frontend_time_to_first_token_seconds_bucket",
        "weir_frontend_inter_token_latency_seconds_bucket",
        "weir_frontend_requests_total",
        "weir_frontend_workers",
        "weir_router_decisions_total",
        "weir_worker_kv_blocks_active",
        "weir_worker_waiting_requests",
    } <= used
