"""Read the runtime's measured stage times from its metrics endpoints (operator side).

The runtime exports them on every rank's Prometheus endpoint (``runtime/stage_timing.py``;
port 9400 + the rank's index in its pod). The operator reads the first rank of every pipeline
stage (of every replica group when the plan has groups): no Kubernetes permission is needed
(plain HTTP to the pod IP on the metrics port, which the job's NetworkPolicy admits from the
scraper namespace and from the operator's own, ``HETTRAIN_OPERATOR_NAMESPACE``, set by the
chart), and nothing is written into the training pods. Parsing and target selection are
plain functions; :func:`scrape` does the HTTP GETs
(short timeouts, failures skipped).
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hettrain.api import constants as c
from hettrain.manifests.builders import RUNTIME_METRICS_PORT
from hettrain.planning.calibration import StageMeasurement
from hettrain.planning.plan import Plan

SCRAPE_TIMEOUT_S = 2.0
SCRAPE_PARALLELISM = 16
_WANTED = {
    "hettrain_runtime_stage_compute_seconds": "compute_s",
    "hettrain_runtime_stage_comm_seconds": "comm_s",
    "hettrain_runtime_stage_layers_seconds": "layers_s",
    "hettrain_runtime_stage_measured_steps": "steps",
    "hettrain_runtime_step": "step",
    "hettrain_runtime_last_checkpoint_step": "checkpoint_step",
}


def parse_stage_metrics(text: str) -> StageMeasurement | None:
    """The stage measurement in one rank's ``/metrics`` text, or None when it has none yet."""
    values: dict[str, float] = {}
    stage = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _WANTED.get(sample.name)
                if key is not None:
                    values[key] = float(sample.value)
                    stage = sample.labels.get("stage", stage)
    except ValueError:
        return None
    if stage is None or "compute_s" not in values or not all(
            math.isfinite(v) for v in values.values()):
        return None
    return StageMeasurement(int(stage), values["compute_s"], values.get("comm_s", 0.0),
                            int(values.get("steps", 0)), int(values.get("step", 0)),
                            int(values.get("checkpoint_step", 0)),
                            values.get("layers_s", 0.0))


def stage_targets(plan: Plan, pods: Sequence[Mapping[str, Any]]
                  ) -> dict[tuple[int, int], str]:
    """``{(group, stage): metrics URL}`` of the first rank of every stage of every replica
    group (group 0 only without ``Plan.groups``) among the running ``pods`` (of the plan's
    attempt): pod IP, port 9400 + the rank's index in its pod. A rank reports the stage index
    of its own group's pipeline, so the key carries the group: a rank of one group never
    stands in for the same stage index of another."""
    by_node: dict[str, tuple[str, int]] = {}
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ip:
            continue
        spec = pod.get("spec") or {}
        labels = (pod.get("metadata") or {}).get("labels") or {}
        try:
            first = int(labels.get(c.LABEL_RANK, ""))
            node = plan.ranks[first].node
        except (ValueError, IndexError):
            continue
        if spec.get("nodeName") in (None, node):
            by_node[node] = (str(ip), first)
    out: dict[tuple[int, int], str] = {}
    for r in plan.ranks:
        key = (r.group, r.stage)
        if key in out or r.node not in by_node:
            continue
        ip, first = by_node[r.node]
        host = f"[{ip}]" if ":" in ip else ip
        out[key] = f"http://{host}:{RUNTIME_METRICS_PORT + r.rank - first}/metrics"
    return out


def _get(key: tuple[int, int], url: str, timeout: float) -> StageMeasurement | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read(1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    m = parse_stage_metrics(text)
    group, stage = key
    return replace(m, group=group) if m is not None and m.stage == stage else None


def scrape(targets: Mapping[tuple[int, int], str], timeout: float = SCRAPE_TIMEOUT_S
           ) -> list[StageMeasurement]:
    """GET every target (up to :data:`SCRAPE_PARALLELISM` at once) and parse it, each
    measurement tagged with its target's replica group; unreachable or empty endpoints are
    left out."""
    items = sorted(targets.items())
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(SCRAPE_PARALLELISM, len(items))) as pool:
        found = list(pool.map(lambda kv: _get(kv[0], kv[1], timeout), items))
    return [m for m in found if m is not None]
