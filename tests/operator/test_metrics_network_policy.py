"""The job NetworkPolicy admits the runtime metrics ports from the scraper's namespace and the
operator's own (calibration scrapes every stage's first rank), and nothing else to them."""

from __future__ import annotations

import importlib

import pytest
from optest_helpers import hetero_nodes, job_body

from hettrain.manifests.builders import (
    METRICS_PORTS_PER_POD,
    RUNTIME_METRICS_PORT,
    JobRef,
    build_network_policy,
)
from hettrain.reconcile import Observed, reconcile


def _metrics_rule(np: dict) -> dict:
    (rule,) = [r for r in np["spec"]["ingress"]
               if any(p["port"] == RUNTIME_METRICS_PORT for p in r["ports"])]
    return rule


def _namespaces(rule: dict) -> list[str]:
    return [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            for peer in rule["from"]]


def test_metrics_ports_admit_the_scraper_and_the_operator_namespace() -> None:
    rule = _metrics_rule(build_network_policy(JobRef("j", "ns", "u"), "prom", "hettrain-system"))
    assert _namespaces(rule) == ["prom", "hettrain-system"]
    assert all(set(peer) == {"namespaceSelector"} for peer in rule["from"])  # whole namespaces
    assert rule["ports"] == [{"protocol": "TCP", "port": RUNTIME_METRICS_PORT,
                              "endPort": RUNTIME_METRICS_PORT + METRICS_PORTS_PER_POD - 1}]


@pytest.mark.parametrize("operator_ns,expect", [("", ["prom"]), ("prom", ["prom"])])
def test_no_or_same_operator_namespace_adds_no_peer(operator_ns: str, expect: list[str]) -> None:
    rule = _metrics_rule(build_network_policy(JobRef("j", "ns", "u"), "prom", operator_ns))
    assert _namespaces(rule) == expect


def test_reconcile_puts_the_operator_namespace_into_the_jobs_policy() -> None:
    d = reconcile(job_body(), Observed([], hetero_nodes(), None, now=1.0,
                                       scraper_namespace="prom",
                                       operator_namespace="hettrain-system"))
    assert d.plan is not None
    (np,) = [o for o in d.create if o["kind"] == "NetworkPolicy"]
    assert _namespaces(_metrics_rule(np)) == ["prom", "hettrain-system"]


def test_the_operator_reads_its_namespace_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = importlib.import_module("hettrain.handlers.job")
    for name in ("_workers", "_watchdog", "_events", "_priority_classes",
                 "_unschedulable_seconds", "_scraper_namespace", "_operator_namespace"):
        monkeypatch.setattr(job, name, getattr(job, name))  # restored after the test
    monkeypatch.setenv("HETTRAIN_SCRAPER_NAMESPACE", "prom")
    monkeypatch.setenv("HETTRAIN_OPERATOR_NAMESPACE", "hettrain-system")
    monkeypatch.setattr(job, "PlanWorkers", lambda budget: type(
        "W", (), {"warm": lambda self: None})())
    job._configure_shared_cluster()
    assert (job._scraper_namespace, job._operator_namespace) == ("prom", "hettrain-system")
    monkeypatch.delenv("HETTRAIN_OPERATOR_NAMESPACE")
    job._configure_shared_cluster()
    assert job._operator_namespace == ""
