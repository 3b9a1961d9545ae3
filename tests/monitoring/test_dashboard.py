"""The Grafana dashboard: structure, and every query answered by a real Prometheus."""

from __future__ import annotations

import itertools

import pytest
from dashboard import load, plain, targets
from promserver import Prometheus

CONTRACT_METRICS = {
    "hettrain_jobs", "hettrain_job_phase", "hettrain_job_predicted_tokens_per_second",
    "hettrain_runtime_tokens_per_second", "hettrain_job_predicted_mfu", "hettrain_runtime_mfu",
    "hettrain_runtime_collective_seconds_total", "hettrain_repairs_total",
}


def test_dashboard_structure() -> None:
    d = load()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for a, b in itertools.combinations(d["panels"], 2):
        ga, gb = a["gridPos"], b["gridPos"]
        overlap = (ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"]
                   and ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"])
        assert not overlap, f"panels {a['title']!r} and {b['title']!r} overlap"
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "job"}


def test_dashboard_covers_the_contract_metrics() -> None:
    exprs = " ".join(e for _, _, e in targets(load()))
    assert all(m in exprs for m in CONTRACT_METRICS), CONTRACT_METRICS - {
        m for m in CONTRACT_METRICS if m in exprs}


@pytest.mark.slow
@pytest.mark.parametrize(("panel", "ref", "expr"), targets(load()),
                         ids=[f"{p}{r}" for p, r, _ in targets(load())])
def test_every_panel_query_returns_data(prometheus: Prometheus, panel: int, ref: str,
                                        expr: str) -> None:
    res = prometheus.query(plain(expr))
    assert res["status"] == "success", res
    assert res["data"]["result"], f"panel {panel}{ref} returned no series: {expr}"
    values = [float(s["value"][1]) for s in res["data"]["result"]]
    assert all(v == v for v in values), f"NaN in panel {panel}{ref}"  # NaN != NaN


@pytest.mark.slow
def test_template_variable_query_lists_the_job(prometheus: Prometheus) -> None:
    res = prometheus.api("label/job/values", **{"match[]": "hettrain_job_phase"})
    assert set(res["data"]) == {"llama", "broken"}


@pytest.mark.slow
def test_predicted_vs_achieved_values_come_through(prometheus: Prometheus) -> None:
    pred = prometheus.query('max by (job) (hettrain_job_predicted_mfu{job="llama"})')
    assert float(pred["data"]["result"][0]["value"][1]) == pytest.approx(0.42)
    ach = prometheus.query('avg by (job) (hettrain_runtime_mfu{job="llama"})')
    # exporters: flops = 4e13 * secs * (0.35 +- 0.02) over peak 1e14 -> 0.14 +- 0.008
    assert 0.13 <= float(ach["data"]["result"][0]["value"][1]) <= 0.15
    ranks = prometheus.query("count(hettrain_runtime_step)")
    assert float(ranks["data"]["result"][0]["value"][1]) == 2
