import math

from hettrain.sim.reference import simulate_restart


def test_time_conservation_and_closed_form():
    lam, restart, tau, delta = 1 / 3600, 120.0, 600.0, 10.0
    ettrs = []
    for seed in range(20):
        r = simulate_restart(30 * 86400, lam, restart, tau, delta, seed=seed)
        assert math.isclose(r.productive_s + sum(r.lost_s.values()), r.wall_s, rel_tol=1e-9)
        assert all(v >= 0 for v in r.lost_s.values())
        ettrs.append(r.ettr)
    mean = sum(ettrs) / len(ettrs)
    first_order = 1 - delta / tau - lam * (restart + tau / 2)
    assert abs(mean - first_order) < 0.02


def test_deterministic_with_seed():
    a = simulate_restart(86400, 1 / 3600, 60, 600, 10, seed=3)
    b = simulate_restart(86400, 1 / 3600, 60, 600, 10, seed=3)
    assert a == b
