"""Trace replay is exact: every second of a hand-computed schedule, for every policy.

Cluster: 8 H100 nodes (``--generate 64:H100-SXM``), Llama 3 8B, every node in use. Recovery:
detection 50 s, restart 200 s, re-plan 10 s, checkpoint 100 s every 1000 s of training,
8000 s simulated. Trace (examples/sim/trace-8-nodes.csv): node 3 fails at 1500 s for 10 s,
a software crash at 3000 s, node 5 fails at 5000 s for 1000 s.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from tests.sim.conftest import oracle_for

from hettrain.sim.engine import simulate
from hettrain.sim.model import RecoveryModel, SimInputError
from hettrain.sim.timeline import load_trace

TRACE = Path(__file__).parents[2] / "examples" / "sim" / "trace-8-nodes.csv"
REC = RecoveryModel(detection_s=50, restart_s=200, plan_s=10, wait_threshold_s=1800)
HORIZON = 8000.0


@pytest.fixture(scope="module")
def oracle():
    return oracle_for("64:H100-SXM")


def _run(oracle, policy, rec=REC, trace=TRACE):
    tl = load_trace(trace, oracle.topo, HORIZON)
    return simulate(tl, oracle, policy, rec, checkpoint_s=100.0, interval_s=1000.0)


def test_restart_replay_matches_hand_schedule(oracle):
    # run 0-1000, ckpt -1100, run -1500 (fail: lose 400), detect -1550, restart -1750,
    # run -2750, ckpt -2850, run -3000 (crash: lose 150), detect -3050, restart -3250,
    # run -4250, ckpt -4350, run -5000 (fail: lose 650), detect -5050, wait for node 5
    # until 6000, restart -6200, run -7200, ckpt -7300, run -8000 (kept at the end)
    r = _run(oracle, "restart")
    assert r.time_s == {"productive": 4700.0, "checkpoint": 400.0, "lost_work": 1200.0,
                        "detection": 150.0, "waiting": 950.0, "planning": 0.0,
                        "restart": 600.0, "grow_back": 0.0}
    assert r.interruptions == {"node": 2, "software": 1}
    assert (r.checkpoints, r.restarts, r.replans, r.grow_backs) == (4, 3, 0, 0)
    assert r.degraded_s == 0.0
    assert math.isclose(r.tokens, r.full_tokens_per_s * 4700.0)
    assert [t for t, _ in r.marks] == [1500.0, 3000.0, 5000.0]


def test_replan_replay_matches_hand_schedule(oracle):
    # as above, but every detection is followed by a 10 s re-plan; at 5050 the plan shrinks
    # to 7 nodes, runs degraded 5260-6260, node 5 is back at 6000, so after the checkpoint
    # at 6260-6360 it grows back (re-plan + restart 210 s) and runs the full plan from 6570
    r = _run(oracle, "replan")
    assert r.time_s == {"productive": 5330.0, "checkpoint": 500.0, "lost_work": 1180.0,
                        "detection": 150.0, "waiting": 0.0, "planning": 30.0,
                        "restart": 600.0, "grow_back": 210.0}
    assert (r.replans, r.grow_backs, r.checkpoints) == (4, 1, 5)
    small = oracle.capacity((7,))
    assert small is not None and small.nodes_used == (7,)
    assert math.isclose(r.degraded_s, 1000.0 * (1 - small.tokens_per_s / r.full_tokens_per_s))
    assert math.isclose(r.tokens, r.full_tokens_per_s * 4330.0 + small.tokens_per_s * 1000.0)


def test_wait_shrink_follows_the_threshold(oracle):
    # node 5 is due 950 s after detection, within 1800 s: wait, exactly like restart (the
    # first two interruptions need no re-plan either: the full plan fits again at once)
    wait = _run(oracle, "wait-shrink")
    assert wait.time_s == _run(oracle, "restart").time_s and wait.replans == 0
    # with a 600 s threshold it shrinks at 5050 like replan; the first two restart directly
    shrink = _run(oracle, "wait-shrink", replace(REC, wait_threshold_s=600))
    replan = _run(oracle, "replan")
    assert shrink.time_s["waiting"] == 0.0 and shrink.grow_backs == 1
    assert shrink.time_s["planning"] == 10.0 and replan.time_s["planning"] == 30.0
    assert shrink.time_s["productive"] == replan.time_s["productive"] - 0.0


def test_jsonl_trace_equals_csv(oracle, tmp_path):
    rows = [{"time_s": 1500, "target": "node:h100-sxm-dc0-003", "kind": "fail", "duration_s": 10},
            {"time_s": 3000, "target": "job", "kind": "software"},
            {"time_s": 5000, "target": "node:h100-sxm-dc0-005", "kind": "fail",
             "duration_s": 1000}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_trace(path, oracle.topo, HORIZON) == load_trace(TRACE, oracle.topo, HORIZON)
    assert _run(oracle, "replan", trace=path).time_s == _run(oracle, "replan").time_s


def test_rack_dc_and_straggler_rows(oracle, tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time_s,target,kind,duration_s,slowdown\n"
                    "100,node:h100-sxm-dc0-001,straggle,400,2\n"
                    "1500,rack:h100-sxm-dc0/1,fail,100,\n"
                    "3000,dc:dc0,fail,500,\n")
    tl = load_trace(path, oracle.topo, HORIZON)
    downs = [e for e in tl.events if e.kind == "down"]
    assert [(e.cause, e.counts) for e in downs] == [("rack", ((0, 2),)), ("dc", ((0, 8),))]
    r = simulate(tl, oracle, "restart", REC, checkpoint_s=100.0, interval_s=1000.0)
    # the straggler halves throughput for 400 s of the first (kept) segment
    assert math.isclose(r.degraded_s, 200.0)
    assert r.interruptions == {"rack": 1, "dc": 1}
    assert r.time_s["waiting"] == (1600.0 - 1550.0) + (3500.0 - 3050.0)


@pytest.mark.parametrize(("row", "field"), [
    ("1,node:nope-000,fail,10,", "node"),
    ("1,node:h100-sxm-dc0-001,explode,10,", ".kind"),
    ("x,job,software,0,", ".time_s"),
    ("1,rack:h100-sxm-dc0/9,fail,10,", ".target"),
    ("1,node:h100-sxm-dc0-001,fail,0,", ".duration_s"),
    ("1,node:h100-sxm-dc0-001,straggle,10,0.5", ".slowdown"),
])
def test_bad_trace_rows_name_the_field(oracle, tmp_path, row, field):
    path = tmp_path / "bad.csv"
    path.write_text("time_s,target,kind,duration_s,slowdown\n" + row + "\n")
    with pytest.raises(SimInputError) as exc:
        load_trace(path, oracle.topo, HORIZON)
    assert field in exc.value.field or field in str(exc.value)


def test_wait_shrink_stops_waiting_when_the_eta_slips(oracle, tmp_path):
    """Waiting for node 5 (due in 950 s < 1800 s) until node 6 fails for 5000 s: shrink then."""
    path = tmp_path / "t.csv"
    path.write_text("time_s,target,kind,duration_s,slowdown\n"
                    "5000,node:h100-sxm-dc0-005,fail,1000,\n"
                    "5500,node:h100-sxm-dc0-006,fail,5000,\n")
    r = _run(oracle, "wait-shrink", trace=path)
    assert r.time_s["waiting"] == 5500.0 - 5050.0
    assert r.time_s["planning"] == 10.0  # one shrink at 5500; node 5 back at 6000 → grow to 7
    assert (r.replans, r.grow_backs) == (2, 1) and r.interruptions == {"node": 1}
