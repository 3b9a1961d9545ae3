"""The helix schedule in the planner: a pinned job gets one layer per chunk on equal stages
without TP or CP, its price is its order replayed with the plan's hop (the order the runtime
builds from the same plan), its memory bound holds every order it may run, its pipeline bytes
are its order's messages, and bad pins are refused naming the field."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.planning import cost, helix
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import helix_capped_only, plan_job, split_costs
from hettrain.planning.support import helix_errors, unsupported
from hettrain.runtime.helix import plan_costs


def _cluster(gpus: int = 4, nic: float = 400):
    return load_cluster({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                         "metadata": {"name": "c"}, "datacenters": [{"name": "a"}],
                         "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM",
                                    "nodes": 1, "gpusPerNode": gpus, "nicGbps": nic}]})


def _spec(seq: int = 8192, pp: int | None = 4, **par):
    job = {"model": {"layers": 8, "hidden": 1024, "heads": 16, "kvHeads": 4, "seqLen": seq,
                     "vocab": 32000},
           "training": {"globalBatch": 8, "steps": 1, "recompute": "attention-free"},
           "parallelism": {"schedule": "helix", **({"pp": pp} if pp else {}), **par}}
    return parse_job_spec(job)


def test_a_pinned_job_gets_one_layer_per_chunk_on_equal_stages_without_tp():
    plan = plan_job("j", _spec(), _cluster())
    assert (plan.schedule, plan.pp, plan.virtual_stages) == ("helix", 4, 2)
    assert [s.layer_end - s.layer_start for s in plan.stages] == [2, 2, 2, 2]
    assert {s.tp for s in plan.stages} == {1} and {s.cp for s in plan.stages} == {1}
    assert plan.num_microbatches <= helix.MAX_MICROBATCHES_PER_STAGE * plan.pp
    again = Plan.from_json(plan.to_json())
    assert again.helix_hop == plan.helix_hop and again == plan
    other = plan_job("j", dataclasses.replace(
        _spec(), parallelism=dataclasses.replace(_spec().parallelism, schedule="1f1b")),
        _cluster())
    assert "helix_hop" not in other.to_dict()  # other plans serialise as before


def _replay(orders, layers, part_s, extra_s, hop_s):
    """The orders replayed (dependencies as ``helix.makespan``) with ``part_s[s][kind]``
    seconds per part on stage ``s`` plus ``extra_s(action)`` (the embedding on layer 0's Fq/Bq,
    the head on the last layer's Fo/Bo) and ``hop_s`` per transfer between stages."""
    pp = len(orders)
    where = {a: s for s, actions in enumerate(orders) for a in actions}
    done, pos, free = {}, [0] * pp, [0.0] * pp
    while len(done) < len(where):
        for s in range(pp):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                deps = helix._deps(a, layers)
                if any(d not in done for d in deps):
                    break
                start = max([free[s]] + [done[d] + (hop_s if where[d] != s else 0.0)
                                         for d in deps])
                free[s] = done[a] = start + part_s[s][a[0]] + extra_s(a)
                pos[s] += 1
    return max(free)


def test_the_price_is_the_order_the_runtime_builds_replayed():
    """The planner's pipelined time against the helix order the runtime builds from the same
    plan (its costs and hop), replayed with the plan's own stage times: each stage's layers
    split into parts by the FLOP shares, the embedding and head where they run, and the hop in
    seconds (the hop the plan carries, as the runtime orders by). The planner's price, whose
    equal-stage divisor comes from that replay, is within 5% of it."""
    spec = _spec(seq=16384)
    inv = _cluster()
    plan = plan_job("j", spec, inv)
    stage_s, hops, _ = split_costs(spec, inv, plan, [2] * 4)
    m, layers, pp = plan.num_microbatches, spec.model.layers, plan.pp
    layer_s = min(stage_s[1:-1]) / (layers / pp)  # a middle stage: layers only
    emb_s, head_s = stage_s[0] - stage_s[1], stage_s[-1] - stage_s[1]
    assert emb_s >= 0 and head_s > 0
    costs = plan_costs(plan)
    unit = layer_s / sum(costs.values())
    orders = helix.helix_orders(pp, layers, m, costs, plan.helix_hop)

    def extra(a):
        kind, _, k = a
        if k == 0 and kind in ("Fq", "Bq"):
            return emb_s / 3 * (1 if kind == "Fq" else 2)
        if k == layers - 1 and kind in ("Fo", "Bo"):
            return head_s / 3 * (1 if kind == "Fo" else 2)
        return 0.0

    replay = _replay(orders, layers, [{k: c * unit for k, c in costs.items()}] * pp, extra,
                     plan.helix_hop * unit)
    priced, _ = cost.pipeline_time_s(stage_s, hops, m, "helix", plan.virtual_stages,
                                     model=spec.model, helix_hop=plan.helix_hop)
    assert max(hops) * plan.virtual_stages < max(stage_s)  # no link busier than a stage
    assert priced == pytest.approx(replay, rel=0.05)
    assert plan.predicted.pp_bytes_per_step == pytest.approx(
        plan.dp * cost.helix_bytes_per_step(spec.model, plan.micro_batch, 2, m, pp,
                                            plan.helix_hop))


@pytest.mark.parametrize("pp,layers", [(2, 4), (3, 6), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("filo", [False, True], ids=["capped", "filo"])
def test_the_memory_bound_holds_every_order(pp, layers, filo):
    """Brute force over microbatches, sequence lengths (the part costs) and hops: no stage
    of any order holds more layers than ``in_flight_bound`` stages' worth."""
    for m, seq, hop in itertools.product(range(1, 4 * pp + 1), (1024, 32768, 131072),
                                         (0.0, 0.2, 1.0)):
        costs = helix.part_costs(seq, 4096, 32, 8, 14336)
        orders = helix.helix_orders(pp, layers, m, costs, hop, filo)
        bound = helix.in_flight_bound(pp, m, filo) * layers / pp
        for s, actions in enumerate(orders):
            held = peak = 0
            for kind, _, k in actions:
                mine = helix.owner(k, pp) == s
                held += (kind == "Fq") + (kind == "Fa" and not mine)
                held -= (kind == "Bq") + (kind == "Ba" and not mine)
                peak = max(peak, held)
            assert peak <= bound, (pp, layers, m, seq, hop, s)


def test_a_slow_link_keeps_cores_home():
    """The order weighs the transfer a moved core costs: with hops as long as a layer's
    forward no core leaves its owner; with free hops some do (128k: the core dominates)."""
    costs = helix.part_costs(131072, 4096, 32, 8, 14336)
    assert helix.transfers(helix.helix_orders(4, 32, 4, costs, 0.0), 32)["qkv"] > 0
    assert helix.transfers(helix.helix_orders(4, 32, 4, costs, 1.0), 32)["qkv"] == 0


def test_bad_pins_name_the_field():
    with pytest.raises(SpecError, match=r"virtualStages.*one layer per model chunk"):
        _spec(virtualStages=2)
    with pytest.raises(SpecError, match=r"schedule.*without tensor or context parallelism"):
        _spec(tp=2)
    with pytest.raises(SpecError, match=r"schedule.*without tensor or context parallelism"):
        _spec(cp=2)


def test_layers_that_do_not_divide_leave_no_helix_layout():
    spec = parse_job_spec({"model": {"layers": 7, "hidden": 1024, "heads": 16, "seqLen": 2048,
                                     "vocab": 32000},
                           "training": {"globalBatch": 8, "steps": 1},
                           "parallelism": {"schedule": "helix", "pp": 2}})
    with pytest.raises(PlanningError, match=r"no feasible layout .* 7 layers"):
        plan_job("j", spec, _cluster())
    # 7 stages of one layer each do: pp is searched when not pinned (helix needs pp >= 2)
    free = dataclasses.replace(spec, parallelism=dataclasses.replace(spec.parallelism, pp=None))
    assert plan_job("j", free, _cluster(gpus=8)).pp == 7


def test_the_runtime_side_check_names_what_helix_cannot_run():
    plan = plan_job("j", _spec(), _cluster())
    assert helix_errors(plan) == []
    uneven = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], layer_end=3),
        dataclasses.replace(plan.stages[1], layer_start=3), *plan.stages[2:]))
    assert "a multiple of plan.pp" in helix_errors(uneven)[0]
    zero3 = dataclasses.replace(plan, training=dataclasses.replace(plan.training,
                                                                   sharding="full"))
    assert helix_errors(zero3) == []  # refused by the sharding check, once
    assert [e for e in unsupported(zero3) if "helix" in e and "ZeRO-2/3" in e]
    with pytest.raises(SpecError, match=r"replicaGroups.*one pipeline shape"):
        _spec(replicaGroups=True)
    with pytest.raises(SpecError, match=r"parallelism.pp.*pp >= 2"):
        _spec(pp=1)
    one = dataclasses.replace(plan, pp=1, stages=plan.stages[:1])
    assert "plan.pp=1" in helix_errors(one)[0]
    other = dataclasses.replace(plan, schedule="1f1b", virtual_stages=1, helix_filo=True)
    assert helix_errors(other) == ["plan.helix_filo=true with plan.schedule=1f1b: only the "
                                   "helix schedule has that order; set it false or plan with "
                                   "schedule: helix"]
    assert helix_errors(dataclasses.replace(other, helix_filo=False)) == []
    job = {"model": {"layers": 8, "hidden": 1024, "heads": 16, "seqLen": 2048, "vocab": 32000},
           "training": {"globalBatch": 8, "steps": 1, "sharding": "full"},
           "parallelism": {"schedule": "helix"}}
    with pytest.raises(SpecError, match=r"sharding: full cannot combine .* helix"):
        parse_job_spec(job)


def test_the_planner_keeps_the_faster_helix_order_that_fits():
    """Both orders are searched, each with its memory: the plan is the faster of the capped
    one (``helix_capped_only``) and the first-in-last-out one, which wins with more
    microbatches than stages (m 8 on 4 stages) and is priced, stored, restated and charged
    its memory (``m`` microbatches in flight) as such."""
    spec, inv = _spec(seq=16384), _cluster()
    plan = plan_job("j", spec, inv)
    with helix_capped_only():
        capped = plan_job("j", spec, inv)
    assert not capped.helix_filo
    assert plan.helix_filo and plan.num_microbatches > plan.pp
    assert plan.predicted.step_time_s < capped.predicted.step_time_s
    assert Plan.from_json(plan.to_json()) == plan and "helix_filo" not in capped.to_dict()
    assert any(n.startswith("helix order: first in, last out") for n in plan.notes)
    assert any(n.startswith("helix order: at most 4 microbatches") for n in capped.notes)
    m = plan.num_microbatches
    stage_s, hops, dp_s = split_costs(spec, inv, plan, [2] * 4)
    pipe, _ = cost.pipeline_time_s(stage_s, hops, m, "helix", plan.virtual_stages,
                                   model=spec.model, helix_hop=plan.helix_hop, helix_filo=True)
    assert plan.predicted.step_time_s == pytest.approx(pipe + dp_s, rel=1e-9)
    assert plan.predicted.pp_bytes_per_step == pytest.approx(
        plan.dp * cost.helix_bytes_per_step(spec.model, plan.micro_batch, 2, m, plan.pp,
                                            plan.helix_hop, filo=True))
    # every stage's memory is the FILO order's (m in flight), within the device
    for s, st in enumerate(plan.stages):
        args = cost.schedule_memory_args(s, plan.pp, m, "helix", plan.virtual_stages, True)
        assert args["in_flight"] == m + 1
        mem = cost.stage_memory(spec.model, plan.training, tp=1, dp=plan.dp,
                                micro_batch=plan.micro_batch, first=s == 0,
                                last=s == plan.pp - 1, **args)
        assert st.memory_gib == pytest.approx(mem.bytes_for(2) / cost.GIB, abs=0.005)
        low = cost.stage_memory(spec.model, plan.training, tp=1, dp=plan.dp,
                                micro_batch=plan.micro_batch, first=s == 0,
                                last=s == plan.pp - 1, **cost.schedule_memory_args(
                                    s, plan.pp, m, "helix", plan.virtual_stages))
        assert low.bytes_for(2) / cost.GIB < st.memory_gib - 0.1  # the capped order's
        assert mem.bytes_for(2) <= inv.pools[0].device.hbm_bytes * cost.MEMORY_HEADROOM


def test_a_plan_with_a_bad_filo_flag_is_refused_naming_it():
    plan = plan_job("j", _spec(seq=16384), _cluster())
    d = plan.to_dict()
    d["helix_filo"] = "yes"
    with pytest.raises(ValueError, match=r"plan.helix_filo='yes': must be true or false"):
        Plan.from_dict(d)
