"""Load the Grafana dashboard and turn its templated PromQL into plain queries."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "dashboards" / "hettrain.json"


def load() -> dict:
    """The dashboard JSON."""
    return json.loads(DASHBOARD.read_text())


def plain(expr: str) -> str:
    """Substitute the dashboard variables the way Grafana does for 'All'."""
    return expr.replace("$job", ".*")


def targets(d: dict) -> list[tuple[int, str, str]]:
    """(panel id, refId, expr) of every target."""
    return [(p["id"], t["refId"], t["expr"]) for p in d["panels"] for t in p["targets"]]
