"""Extra warm-up over a datacenter link (``cost.link_warmups``, ``StagePlan.link_warmup``).

A pipeline whose hop crosses a slow link waits, on 1F1B's usual warm-up, for the link's round
trip on every microbatch. The runtime's action lists with the plan's extra warm-up
(``schedules.stage_actions``) are replayed here with that latency on the crossing hops: their
makespan must stay within the cost model's step (``cost.pipeline_time_s`` with the delay paid
once), and without the warm-up it does not. The peak activations the replay holds are the
planner's ``in_flight_microbatches``."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from tests.runtime.training.plans import tiny_plan
from tests.runtime.training.runs import run_losses

from hettrain.planning import cost
from hettrain.planning.replay import replay
from hettrain.runtime.memory import measure_stage, predicted_stage_bytes
from hettrain.runtime.schedules import chunk_actions, stage_actions, warmup_count
from hettrain.runtime.trainer import reference_losses


def _replay(schedule: str, costs: list[dict[str, float]], m: int, latency: list[float],
            warm: tuple[int, ...]) -> float:
    """Makespan of the stages' action lists with ``latency[k]`` added to each transfer over
    hop ``k → k + 1`` (both directions), ``warm[s]`` extra warm-up forwards on stage ``s``."""
    pp = len(costs)
    orders = [stage_actions(schedule, s, pp, m, warm[s]) for s in range(pp)]

    def deps(a, s):
        kind, i = a
        if kind == "F":
            return [("F", s - 1, i)] if s else []
        if kind == "B":
            return [("F", s, i)] + ([("B", s + 1, i)] if s < pp - 1 else [])
        return [("B", s, i)]

    def delay(dep, s):
        _, t, _ = dep
        if t == s:
            return 0.0
        return latency[min(s, t)]  # F from s - 1: hop s - 1; B from s + 1: hop s

    times = replay(orders, deps, lambda a, s: costs[s][a[0]], delay,
                   key=lambda a, s: (a[0], s, a[1]))
    return max(end for _, _, end in times.values())


def _model(schedule: str, costs: list[dict[str, float]], m: int, latency: list[float]
           ) -> float:
    """The cost model's step: stage times ``F + B + W``, no transfer time, the links' round
    trips once (``link_delay_s``); ZB-H1 at the catalog divisor (F = B = W)."""
    stage_s = [c["F"] + c["B"] + c["W"] for c in costs]
    total, _ = cost.pipeline_time_s(stage_s, [0.0] * (len(costs) - 1), m, schedule,
                                    link_delay_s=2 * sum(latency))
    return total


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        pp = rng.randint(2, 6)
        m = rng.randint(pp, 4 * pp)
        base = [rng.uniform(0.5, 1.5) for _ in range(pp)]
        latency = [0.0] * (pp - 1)
        for k in rng.sample(range(pp - 1), rng.randint(1, min(2, pp - 1))):
            latency[k] = rng.uniform(0.5, 12.0)
        yield pp, m, base, latency


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_warmup_hides_link_latency_within_the_model(schedule):
    """Random pipelines (2-6 stages, one or two slow hops): with the planned warm-up the
    replayed step is at most the model's (1F1B: stage time F + 2F; ZB-H1: F = B = W, its
    catalog divisor), and the warm-up is what makes it so on most of them."""
    worse_without = 0
    cases = list(_cases(7, 60))
    for pp, m, base, latency in cases:
        if schedule == "1f1b":
            costs = [{"F": t, "B": 2 * t, "W": 0.0} for t in base]
        else:
            costs = [{"F": t, "B": t, "W": t} for t in base]
        period = min(c["F"] + c["B"] + c["W"] for c in costs)  # a lower bound on the period
        warm = cost.link_warmups([2 * x for x in latency], period, m)
        model = _model(schedule, costs, m, latency)
        got = _replay(schedule, costs, m, latency, warm)
        assert got <= model * (1 + 1e-9), (pp, m, base, latency, warm, got, model)
        if _replay(schedule, costs, m, latency, (0,) * pp) > model * (1 + 1e-9):
            worse_without += 1
    assert worse_without >= len(cases) // 2


def test_link_warmups_brute_force():
    """Each stage runs the warm-up of every slow hop after it, capped so it never starts more
    forwards than the step has (the runtime's cap): checked against the definition."""
    rng = random.Random(3)
    for _ in range(200):
        pp = rng.randint(1, 8)
        m = rng.randint(1, 20)
        delays = [rng.choice([0.0, 0.0, rng.uniform(0, 5)]) for _ in range(pp - 1)]
        period = rng.uniform(0.1, 2.0)
        got = cost.link_warmups(delays, period, m)
        for s in range(pp):
            # (ceil with the same tolerance as the code: exact multiples do not round up)
            need = sum(max(0, round(d / period) if abs(d / period - round(d / period)) < 1e-9
                           else int(d // period) + 1) for d in delays[s:] if d)
            assert got[s] == max(0, min(need, m - (pp - s)))
            assert warmup_count("1f1b", s, pp, m, got[s]) <= m
    with pytest.raises(ValueError, match="period_s"):
        cost.link_warmups([1.0], 0.0, 4)


@pytest.mark.parametrize("pp,m,extra", [(2, 4, 1), (3, 8, 3), (4, 6, 5), (5, 12, 2)])
def test_actions_with_warmup_and_their_in_flight_peak(pp, m, extra):
    """With ``extra`` warm-up every microbatch still gets one F, one B and one W, in order;
    the stage starts ``pp − s − 1 + extra`` forwards first (at most ``m``), and the most
    activations it holds (F done, B not) is the planner's ``in_flight_microbatches``."""
    for schedule, s in itertools.product(("1f1b", "zb-h1"), range(pp)):
        acts = stage_actions(schedule, s, pp, m, extra)
        assert sorted(acts) == sorted((k, i) for k in "FBW" for i in range(m))
        first_b = acts.index(("B", 0))
        assert first_b == min(pp - s + extra, m)  # the warm-up, then (if any left) one F
        held = peak = 0
        for kind, _ in acts:
            held += {"F": 1, "B": -1, "W": 0}[kind]
            peak = max(peak, held)
        assert peak == cost.in_flight_microbatches(s, pp, m, schedule, link_warmup=extra)


def test_warmup_refused_where_the_schedule_has_none():
    with pytest.raises(ValueError, match="link_warmup"):
        chunk_actions("interleaved", 0, 2, 4, 2, link_warmup=1)
    with pytest.raises(ValueError, match="link_warmup"):
        warmup_count("1f1b", 0, 2, 4, -1)


def _warm(plan, warm):
    """``plan`` with ``warm[s]`` extra warm-up on stage ``s``."""
    return replace(plan, stages=tuple(replace(s, link_warmup=w)
                                      for s, w in zip(plan.stages, warm, strict=True)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_measured_memory_with_warmup_stays_within_the_plan(schedule):
    """The runtime's stage run with the plan's extra warm-up (``runtime/memory.py`` replays
    the same action lists) holds more activations than without, and never more bytes than the
    plan predicts; the prediction grows by what the extra microbatches keep."""
    plan = tiny_plan([(0, 2, "pool-a"), (2, 3, "pool-b"), (3, 4, "pool-b")], dp=1,
                     num_microbatches=8, schedule=schedule, precision="bf16")
    warm = _warm(plan, (3, 1, 0))
    before, after = measure_stage(plan, 0), measure_stage(warm, 0)
    assert after.activations > before.activations
    for stage in range(warm.pp):
        got = measure_stage(warm, stage).total
        want = predicted_stage_bytes(warm, stage)
        assert got <= want, (stage, got, want)
    assert predicted_stage_bytes(warm, 0) > predicted_stage_bytes(plan, 0)
    # stage 1 receives the inputs stage 0 runs ahead (3 − 1): counted, one activation each
    spec = plan.model
    extra = predicted_stage_bytes(warm, 1) - predicted_stage_bytes(_warm(plan, (0, 1, 0)), 1)
    assert extra == pytest.approx(2 * plan.micro_batch * spec.seq_len * spec.hidden * 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_with_warmup_matches_the_reference(tmp_path, schedule):
    """Three real gloo stages running the plan's extra warm-up (stage 0 three forwards ahead,
    stage 1 one: two more of stage 0's activations received ahead) train exactly as the
    single-process reference: the order changes, the numbers do not."""
    steps = 4
    plan = _warm(tiny_plan([(0, 1, "pool-a"), (1, 3, "pool-a"), (3, 4, "pool-b")], dp=1,
                           steps=steps, num_microbatches=6, schedule=schedule), (3, 1, 0))
    got = run_losses(plan, tmp_path, {"HETTRAIN_METRICS_PORT": "0"}, tmp_path / "loss.jsonl",
                     timeout=180)
    ref = reference_losses(plan, steps)
    assert sorted(got) == list(range(steps))
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=1e-5), step


def _replay_interleaved(pp: int, v: int, m: int, latency: float, dcs: str) -> float:
    """Makespan of the runtime's interleaved orders (``chunk_actions``) on ``pp`` equal stages
    (F = 1, B = 2 per microbatch, over ``v`` chunks) with ``latency`` on every transfer between
    stages in different datacenters (``dcs[s]``), the last stage's hop back to stage 0
    included."""
    orders = [chunk_actions("interleaved", s, pp, m, v) for s in range(pp)]

    def deps(a, s):
        kind, i, c = a
        if kind == "F":
            if s:
                return [("F", s - 1, i, c)]
            return [("F", pp - 1, i, c - 1)] if c else []
        out = [("F", s, i, c)]
        if s < pp - 1:
            out.append(("B", s + 1, i, c))
        elif c < v - 1:
            out.append(("B", 0, i, c + 1))
        return out

    times = replay(orders, deps, lambda a, s: (1.0 if a[0] == "F" else 2.0) / v,
                   lambda dep, s: latency if dcs[dep[1]] != dcs[s] else 0.0,
                   key=lambda a, s: (a[0], s, a[1], a[2]))
    return max(end for _, _, end in times.values())


def _interleaved_model(pp: int, v: int, m: int, latency: float, dcs: str) -> float:
    """The cost model's interleaved pipeline with the per-hop charge ``2·latency`` on each
    crossing hop (the hop back from the last stage to stage 0 included)."""
    hops = [2 * latency if dcs[k] != dcs[(k + 1) % pp] else 0.0 for k in range(pp)]
    total, _ = cost.pipeline_time_s([3.0] * pp, hops, m, "interleaved", v)
    return total


# (pp, v, m, latency, datacenters): replay / model, as docs/planning.md §Known limits quotes
INTERLEAVED_ACROSS = [((2, 2, 8, 0.5, "ab"), 1.056), ((2, 2, 8, 1.0, "ab"), 0.986),
                      ((2, 2, 16, 1.4, "ab"), 0.805), ((4, 2, 16, 1.0, "aabb"), 0.866),
                      ((4, 3, 16, 2.0, "aabb"), 0.535), ((4, 2, 32, 0.3, "aabb"), 1.009)]


@pytest.mark.parametrize(("case", "ratio"), INTERLEAVED_ACROSS)
def test_interleaved_across_a_link_keeps_the_per_hop_charge(case, ratio):
    """Interleaved runs no link warm-up (known limit): its charge of the link as a stage of
    ``2·L`` per hop is exact without latency, and with it the replayed runtime order lands on
    either side of it: a little slower where the latency is small against a stage, much faster
    where it is large (the charge is paid per microbatch, the replay overlaps it)."""
    pp, v, m, latency, dcs = case
    assert _replay_interleaved(pp, v, m, 0.0, dcs) == pytest.approx(
        _interleaved_model(pp, v, m, 0.0, dcs), rel=1e-12)
    got = _replay_interleaved(pp, v, m, latency, dcs) / _interleaved_model(pp, v, m, latency,
                                                                          dcs)
    assert got == pytest.approx(ratio, abs=5e-4)
