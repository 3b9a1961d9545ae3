"""Heterogeneous replica groups (plan.groups) on real gloo processes: losses and updated
parameters equal the single-process reference on the same global batch (two groups, three
across two datacenters, context parallelism in one or both groups); a checkpoint written by a
2-group plan (with cp 2 in group 0 or not) resumes on a plain plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.runtime.checkpoints import rewind
from tests.runtime.training.plans import grouped_plan, tiny_plan
from tests.runtime.training.runs import sgd_run_and_reference

from hettrain.api.spec import MODEL_PRESETS, ModelSpec
from hettrain.planning.support import group_cp
from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.config import ENV_DP_REDUCTION
from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.model import whole_model
from hettrain.runtime.replica_sync import Cell, cell_sets, shard_span, unit_of
from hettrain.runtime.trainer import reference_losses

pytestmark = pytest.mark.slow

RTOL = 1e-5  # fp32 on CPU: only summation orders differ (as the other parallel runtime tests)
# the parameter checks run plain SGD (HETTRAIN_OPTIMIZER=sgd, "exactness checks"): AdamW's
# normalisation turns summation-order noise in near-zero gradients into update-sized noise
SGD_LR = 0.1
LLAMA = ModelSpec(name="llama-tiny", **{**MODEL_PRESETS["llama-tiny"], "seq_len": 32})


def _losses(path: Path) -> dict[int, float]:
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


def _logs(workdir: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(workdir.glob("rank-*.log")))


def _run(plan, workdir: Path, env: dict[str, str] | None = None) -> dict[int, float]:
    env = {"HETTRAIN_LOSS_LOG": str(workdir / "loss.jsonl"), "HETTRAIN_METRICS_PORT": "0",
           "HETTRAIN_SUMMARY_DIR": str(workdir / "summary"), **(env or {})}
    codes = wait_all(launch_local(plan, workdir, env), 240)
    assert codes == [0] * plan.world_size, _logs(workdir)
    return _losses(workdir / "loss.jsonl")


def _checkpoint_params(root: Path, spec: ModelSpec, step: int) -> dict[str, torch.Tensor]:
    """The whole model's parameters from checkpoint ``step`` (any layout)."""
    model = whole_model(spec, seed=0)
    targets = ckpt.job_state(model, None, for_save=False)
    ckpt.load(ckpt.CheckpointStore.open(f"file://{root}"), step, targets,
              model=ckpt.model_meta(spec))
    return {n: p.detach() for n, p in model.named_parameters()}


CASES = {
    # pp 2 (1+3 layers) beside pp 1: different stage counts and splits, shares 8 : 4
    "pp2-vs-pp1": [{"splits": [(0, 1, "a"), (1, 4, "b")], "dp": 1, "num_microbatches": 4},
                   {"splits": [(0, 4, "c")], "dp": 1, "num_microbatches": 2}],
    # 2 replicas of a 3+1 pipeline + 1 replica of a 2+2 pipeline, unequal microbatches
    "2x-plus-1x": [{"splits": [(0, 3, "a"), (3, 4, "b")], "dp": 2, "num_microbatches": 3},
                   {"splits": [(0, 2, "c"), (2, 4, "d")], "dp": 1, "num_microbatches": 2}],
    # TP 2 in both groups, pp 2 vs pp 1
    "tp2-both": [{"splits": [(0, 2, "a"), (2, 4, "b")], "tp": 2, "num_microbatches": 3},
                 {"splits": [(0, 4, "c")], "tp": 2, "num_microbatches": 1}],
    # mixed TP along the pipeline, as the planner's extra groups follow the plan's TP runs
    # (planning/replica_groups.tp_runs): layers 0-1 at TP 1 and 2-3 at TP 2 in both groups,
    # cut into 2 stages in group 0 and 3 in group 1
    "mixed-tp-runs": [{"splits": [(0, 2, "a"), (2, 4, "b")], "tp": [1, 2],
                       "num_microbatches": 3},
                      {"splits": [(0, 1, "c"), (1, 2, "d"), (2, 4, "e")], "tp": [1, 1, 2],
                       "num_microbatches": 1}],
    # different TP per layer between groups: TP 2 (2 stages) beside TP 1 (1 stage), each half
    # of a sharded weight summed with the TP-1 rank's matching half, the norms (held by both
    # TP-2 ranks) counted once
    "tp2-vs-tp1": [{"splits": [(0, 2, "a"), (2, 4, "b")], "tp": 2, "num_microbatches": 3},
                   {"splits": [(0, 4, "c")], "tp": 1, "num_microbatches": 1}],
    # TP 1 then 2 along group 0's pipeline beside TP 2 throughout, 2 replicas of group 1
    "tp-runs-vs-tp2": [{"splits": [(0, 2, "a"), (2, 4, "b")], "tp": [2, 1],
                        "num_microbatches": 2},
                       {"splits": [(0, 4, "c")], "tp": 2, "dp": 2, "num_microbatches": 1}],
    # groups in two datacenters (2 replicas in dc1, 1 in dc2): the hierarchical sum, and the
    # unsharded optimizer
    "two-dcs-no-zero": [{"splits": [(0, 2, "a"), (2, 4, "b")], "dp": 2, "dc": "dc1"},
                        {"splits": [(0, 4, "c")], "dp": 1, "num_microbatches": 4, "dc": "dc2"}],
    # three groups (what the planner's one-group-per-idle-pool layout builds): pp 2, two pp-1
    # replicas and a 2+2 pipeline in a second datacenter, shares 6 : 4 : 4 microbatches
    "three-groups": [{"splits": [(0, 1, "a"), (1, 4, "b")], "dp": 1, "num_microbatches": 6},
                     {"splits": [(0, 4, "c")], "dp": 2, "num_microbatches": 2},
                     {"splits": [(0, 2, "d"), (2, 4, "e")], "dp": 1, "num_microbatches": 4,
                      "dc": "dc2"}],
    # three replicas beside two: the two-level sum cuts each set into k = 2 chunks, the third
    # replica of group 0 owns none (it zeros its copy and gets the sum from its group)
    "dp3-vs-dp2": [{"splits": [(0, 4, "a")], "dp": 3, "num_microbatches": 2},
                   {"splits": [(0, 4, "b")], "dp": 2, "num_microbatches": 1}],
    # context parallelism in group 0 (cp 2 on a 2-stage pipeline) beside two cp-1 replicas:
    # each CP rank a replica of its own in the sum, weighted by half its group's share
    "cp2-vs-cp1": [{"splits": [(0, 2, "a"), (2, 4, "b")], "cp": 2, "num_microbatches": 3},
                   {"splits": [(0, 4, "c")], "dp": 2, "num_microbatches": 1}],
    # cp 2 in both groups, TP 2 x CP 2 beside TP 1 x CP 2: halves of the sharded weights and
    # the norms (one contribution per TP pair) summed over every CP rank; unclipped, so a
    # gradient scaled alike in both groups would show
    "cp2-tp2-vs-cp2": [{"splits": [(0, 4, "a")], "tp": 2, "cp": 2, "num_microbatches": 2},
                       {"splits": [(0, 4, "b")], "cp": 2, "num_microbatches": 2}],
    # short replicas in both groups (ReplicaGroup.short_replicas): 3 replicas run 3, 3 and 2
    # microbatches beside a 2-stage pipeline whose 2 replicas run 2 and 1, shares 8 : 3; each
    # replica's gradient weighted by its own share, the validation rows split alike
    "short-dp3-vs-pp2": [{"splits": [(0, 4, "a")], "dp": 3, "num_microbatches": 3, "short": 1},
                         {"splits": [(0, 2, "b"), (2, 4, "c")], "dp": 2,
                          "num_microbatches": 2, "short": 1}],
    # a short replica with context parallelism: group 0's 2 replicas (cp 2) run 2 and 1
    # microbatches, its CP ranks each a replica of their own in the sum
    "short-cp2": [{"splits": [(0, 2, "a"), (2, 4, "b")], "dp": 2, "cp": 2, "num_microbatches": 2,
                   "short": 1},
                  {"splits": [(0, 4, "c")], "dp": 1, "num_microbatches": 2}],
}
# a clip far below the gradient norm: every step is clipped by the global norm, so a norm that
# counted a parameter twice (or missed one) would change the update
TRAINING = {"two-dcs-no-zero": {"optimizer_sharding": False}, "2x-plus-1x": {"grad_clip": 0.05},
            "tp2-both": {"grad_clip": 0.05}, "mixed-tp-runs": {"grad_clip": 0.05},
            "tp2-vs-tp1": {"grad_clip": 0.05}, "tp-runs-vs-tp2": {"grad_clip": 0.05},
            "three-groups": {"grad_clip": 0.05}, "cp2-vs-cp1": {"grad_clip": 0.05},
            "dp3-vs-dp2": {"grad_clip": 0.05},
            "cp2-tp2-vs-cp2": {"grad_clip": 0.0},
            "pp2-vs-pp1": {"validation_interval": 2, "validation_batches": 2},
            "short-dp3-vs-pp2": {"grad_clip": 0.05, "validation_interval": 2,
                                 "validation_batches": 2},
            "short-cp2": {"grad_clip": 0.05}}


# the two-level sum's in-group steps as a reduce-scatter and an all-gather (what auto picks on
# NCCL/HCCL; on gloo it all-reduces twice): slices of 3 beside 2 cut into four chunk rings,
# CP ranks as members of the DP×CP group, three groups in two datacenters
REDUCE_SCATTER = ["dp3-vs-dp2", "cp2-vs-cp1", "three-groups", "tp-runs-vs-tp2",
                  "short-dp3-vs-pp2"]


# the most chunk rings each rank has in flight at once. three-groups: layer sets [0, 1), [1, 2)
# and [2, 4) (cut where group 0's and group 2's stages start); group 1's two replicas cut each
# set into two slices, so each set runs two rings. Group 1's ranks own one ring of each of
# their three sets and start all three before waiting; the other groups' ranks, alone in
# their DP×CP groups, own both rings of a set and sum their sets one at a time.
# pp2-vs-pp1: every rank alone in its group, group 1's rank sums its two sets one by one
RINGS_IN_FLIGHT = {"pp2-vs-pp1": {0: 1, 1: 1, 2: 1},
                   "three-groups": {0: 2, 1: 2, 2: 3, 3: 3, 4: 2, 5: 2}}


@pytest.mark.parametrize(("case", "reduction"), [(c, "auto") for c in CASES]
                         + [(c, "reduce_scatter") for c in REDUCE_SCATTER])
def test_groups_match_the_single_process_reference(tmp_path, case, reduction):
    plan = grouped_plan(CASES[case], steps=4, model=LLAMA, lr=SGD_LR, **TRAINING.get(case, {}))
    run = sgd_run_and_reference(plan, tmp_path, env={ENV_DP_REDUCTION: reduction})
    # the in-group step each rank ran (a DP×CP group of one has none to run)
    logs = {r.rank: (tmp_path / f"rank-{r.rank}.log").read_text() for r in plan.ranks}
    for r in plan.ranks:
        grp = plan.groups[r.group]
        flat = reduction == "reduce_scatter" and grp.dp * group_cp(grp.stages) > 1
        step = "reduce-scatter" if flat else "all-reduce"
        assert f"summed with the other replica groups; inside the group {step}" in logs[r.rank]
    got, ref, final, validation, ck = run.got, run.ref, run.final, run.validation, run.ckpt
    assert sorted(got) == list(range(plan.training.steps))
    clip = TRAINING.get(case, {}).get("grad_clip")
    assert clip or ref[-1] < ref[0]  # it learns (unclipped)
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), (step, got, ref)
    if plan.training.validation_interval:  # the groups' validation losses, combined
        last = plan.world_size - 1  # a rank of the last group: every rank has the job's value
        rec = json.loads((tmp_path / "summary" / f"rank-{last}.json").read_text())
        assert sorted(validation) == [2, 4]
        for done, want in validation.items():
            assert rec["validation"][str(done)] == pytest.approx(want, rel=RTOL), done
    norms = [json.loads(line)["grad_norm"]
             for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    if clip:
        assert min(norms) > plan.training.grad_clip  # every step was clipped
    # the updated parameters: group 0 wrote the checkpoint ...
    params = _checkpoint_params(ck, LLAMA, plan.training.steps)
    assert set(params) == set(final)
    for name, want in final.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # ... and every rank of every group holds the same weights (checksums of its stage)
    if any(s.tp > 1 for g in plan.groups for s in g.stages):
        return
    units = {n: unit_of(n) for n in final}
    held_bytes = {}  # fp32 gradient bytes of each rank's stage
    for r in plan.ranks:
        rec = json.loads((tmp_path / "summary" / f"rank-{r.rank}.json").read_text())
        st = plan.stage_of(r)
        held = {f"layer {i}" for i in range(st.layer_start, st.layer_end)}
        held |= {u for u, on in (("embedding", st.index == 0), ("head", st.has_head)) if on}
        want = sum(float(p.double().sum()) for n, p in final.items() if units[n] in held)
        held_bytes[r.rank] = 4 * sum(p.numel() for n, p in final.items() if units[n] in held)
        assert rec["group"] == r.group
        # no DP sync of its own beside the sum (the planner charges none: own_grad_sync_s)
        assert rec["dp_overlap"] == {}
        if case in RINGS_IN_FLIGHT:  # every set's chunk rings started before any is waited on
            assert rec["replica_rings_in_flight"] == RINGS_IN_FLIGHT[case][r.rank], r
        assert rec["param_checksum"] == pytest.approx(want, rel=1e-5, abs=1e-4), r
    if case == "two-dcs-no-zero":
        # the DC link carries each gradient byte once each way per step: group 1's replica
        # sends its whole model, group 0's two replicas half of their stage each (the slice
        # each owns after its group's sum), 2(G - 1)/G = 1 of what each sums
        sent = {r.rank: json.loads((tmp_path / "summary" / f"rank-{r.rank}.json").read_text())
                ["bytes"]["cross_dc"] for r in plan.ranks}
        steps = plan.training.steps
        assert sent[4] == steps * held_bytes[4]
        for r in range(4):
            assert sent[r] == pytest.approx(steps * held_bytes[r] / 2, abs=8 * steps), r


@pytest.mark.parametrize("case", ["2x-plus-1x", "cp2-vs-cp1"])
def test_two_group_checkpoint_resumes_on_a_plain_plan(tmp_path, case):
    steps = 6
    first = grouped_plan(CASES[case], steps=steps, model=LLAMA)
    ck = tmp_path / "ckpt"
    env = {"HETTRAIN_CHECKPOINT_URI": f"file://{ck}", "HETTRAIN_CHECKPOINT_INTERVAL": "3"}
    before = _run(first, tmp_path / "run1", env)
    rewind(ck, 3)  # as if the 2-group job had died after checkpoint 3
    # the same global batch on one plain 2-stage replica (no CP)
    second = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, steps=steps, model=LLAMA,
                       num_microbatches=first.global_batch // first.micro_batch)
    assert second.global_batch == first.global_batch
    after = _run(second, tmp_path / "run2", {**env, "HETTRAIN_RESUME": "1"})
    ref = reference_losses(first, steps)
    assert sorted(after) == [3, 4, 5]
    for step in range(steps):
        got = after.get(step, before[step])
        assert got == pytest.approx(ref[step], rel=RTOL), step


def test_cells_pair_equal_shards_and_split_unequal_ones():
    plan = grouped_plan(CASES["tp2-both"], model=LLAMA)
    # group 0: stage 0 (layers 0-1) ranks 0, 1; stage 1 (layers 2-3) ranks 2, 3; group 1: 4, 5
    q = "model.layers.1.self_attn.q_proj.weight"
    dim, a, b = shard_span(LLAMA, q, 2, 1)
    assert dim == 0 and b - a == LLAMA.hidden // 2
    assert [(c.start, m, set(w)) for c, m, w in cell_sets(plan, q)] == [
        (0, (0, 4), {0, 4}), (a, (1, 5), {1, 5})]
    # equal TP: the norms pair by TP index, every holder contributing (as before)
    norm = "model.layers.2.input_layernorm.weight"
    assert [(m, set(w)) for _, m, w in cell_sets(plan, norm)] == [
        ((2, 4), {2, 4}), ((3, 5), {3, 5})]
    mixed = grouped_plan(CASES["tp2-vs-tp1"], model=LLAMA)  # group 1 is rank 4 at TP 1
    o = "model.layers.3.self_attn.o_proj.weight"  # row-parallel: columns
    half = LLAMA.hidden // 2
    assert cell_sets(mixed, o) == [(Cell(o, 1, 0, half), (2, 4), frozenset({2, 4})),
                                   (Cell(o, 1, half, 2 * half), (3, 4), frozenset({3, 4}))]
    # a norm both TP-2 ranks hold: one set, one contribution per replica
    assert cell_sets(mixed, norm) == [(Cell(norm, None, 0, 0), (2, 3, 4), frozenset({2, 4}))]
    # context parallelism: each CP rank is a replica of its own (group 0: cp 2, TP 2, ranks
    # 0-3 as (tp, cp) = (0, 0), (0, 1), (1, 0), (1, 1); group 1: cp 2, TP 1, ranks 4, 5)
    cp = grouped_plan(CASES["cp2-tp2-vs-cp2"], model=LLAMA)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [(c.start, m, set(w)) for c, m, w in cell_sets(cp, q)] == [
        (0, (0, 1, 4, 5), {0, 1, 4, 5}), (a, (2, 3, 4, 5), {2, 3, 4, 5})]
    assert cell_sets(cp, norm) == [(Cell(norm, None, 0, 0), tuple(range(6)),
                                    frozenset({0, 1, 4, 5}))]
    assert {unit_of("model.layers.12.mlp.up_proj.weight"), unit_of("lm_head.weight"),
            unit_of("model.norm.weight")} == {"layer 12", "head"}
