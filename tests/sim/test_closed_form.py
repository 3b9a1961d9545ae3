"""The engine against closed-form ETTR for Poisson failures with a fixed restart cost.

Setup: one 8-GPU node, only job-level (software) failures at rate λ = 1/h, detection D and
restart R (so each failure costs D + R after the rolled-back work), checkpoints of C seconds
every τ seconds of training. Renewal argument (see ``renewal_ettr``): a segment of τ + C must
run failure-free, the expected wall time per segment is (e^{λ(τ+C)} − 1)(1/λ + D + R), so
ETTR = τ / that. Tolerance: the mean over 40 seeds of 20 days each (≈ 480 failures per seed;
per-seed ETTR sd ≈ 0.006, so the mean's sd ≈ 0.001) must be within 0.005 of the formula.
"""

from __future__ import annotations

import math
import statistics

from tests.sim.conftest import oracle_for

from hettrain.sim.engine import simulate
from hettrain.sim.model import FailureModel, RecoveryModel
from hettrain.sim.reference import renewal_ettr, simulate_restart
from hettrain.sim.timeline import sample_timeline

LAM, D, R, TAU, C = 1 / 3600, 30.0, 90.0, 600.0, 10.0
DAYS = 20


def _software_only(gpus: int) -> FailureModel:
    return FailureModel(gpu_mtbf_h=0.0, rack_mtbf_h=0.0, software_gpu_mtbf_h=gpus * 1.0)


def test_engine_matches_renewal_formula():
    oracle = oracle_for("8:H100-SXM", global_batch=8)
    model = _software_only(8)
    rec = RecoveryModel(detection_s=D, restart_s=R, plan_s=0.0)
    ettrs, rates = [], []
    for seed in range(40):
        tl = sample_timeline(oracle.topo, model, DAYS * 86400, seed)
        r = simulate(tl, oracle, "restart", rec, checkpoint_s=C, interval_s=TAU)
        ettrs.append(r.ettr)
        training = r.time_s["productive"] + r.time_s["checkpoint"] + r.time_s["lost_work"]
        rates.append(r.total_interruptions / training)
    expected = renewal_ettr(LAM, D + R, TAU, C)
    assert abs(statistics.fmean(ettrs) - expected) < 0.005, (statistics.fmean(ettrs), expected)
    # failures arrive at λ per second of training (none while the job is down)
    assert abs(statistics.fmean(rates) / LAM - 1) < 0.02
    # and the first-order formula (Young/Daly style) is close for λ(τ+C) ≪ 1
    first_order = TAU / (TAU + C) / (1 + LAM * (D + R + (TAU + C) / 2))
    assert abs(expected - first_order) < 0.01


def test_replan_equals_restart_when_no_node_is_lost():
    """Software failures lose no node: replan differs from restart only by plan_s per failure."""
    oracle = oracle_for("8:H100-SXM", global_batch=8)
    tl = sample_timeline(oracle.topo, _software_only(8), 5 * 86400, 7)
    rec = RecoveryModel(detection_s=D, restart_s=R, plan_s=0.0)
    a = simulate(tl, oracle, "restart", rec, checkpoint_s=C, interval_s=TAU)
    b = simulate(tl, oracle, "replan", rec, checkpoint_s=C, interval_s=TAU)
    assert a.time_s == b.time_s and a.tokens == b.tokens
    assert b.replans == b.total_interruptions > 0 and a.replans == 0


def test_reference_simulator_matches_renewal_formula():
    ettrs = [simulate_restart(DAYS * 86400, LAM, R, TAU, C, seed=s).ettr for s in range(40)]
    assert abs(statistics.fmean(ettrs) - renewal_ettr(LAM, R, TAU, C)) < 0.005


def test_no_failures_gives_checkpoint_overhead_only():
    oracle = oracle_for("8:H100-SXM", global_batch=8)
    model = FailureModel(gpu_mtbf_h=0.0, rack_mtbf_h=0.0, software_gpu_mtbf_h=0.0)
    tl = sample_timeline(oracle.topo, model, 86400, 0)
    assert tl.events == ()
    r = simulate(tl, oracle, "restart", RecoveryModel(), checkpoint_s=C, interval_s=TAU)
    cycles = 86400 // (TAU + C)
    assert r.checkpoints == cycles
    assert math.isclose(r.time_s["checkpoint"], cycles * C + max(0.0, 86400 - cycles * (TAU + C)
                                                                 - TAU))
    assert math.isclose(r.ettr, (86400 - r.time_s["checkpoint"]) / 86400)
    assert math.isclose(r.ettr, renewal_ettr(0.0, R, TAU, C), rel_tol=2e-3)
