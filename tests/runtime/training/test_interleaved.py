"""Interleaved 1F1B (virtual pipeline stages) executed for real: the chunk-major layer mapping,
the Megatron operation order (equal to the plan figure's), chunked stage models that compose to
the whole model, and multi-process gloo pipelines (pp=2 v=2 x dp=2, pp=3 v=2 on uneven layers,
tp=2 x pp=2 v=2) that reproduce the single-process reference losses, account the chunk
boundary traffic, and resume from a checkpoint across interleaved <-> plain 1F1B layouts."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import urllib.request

import pytest
import torch
from tests.runtime.checkpoints import rewind
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.planning import cost
from hettrain.planning.layers import chunk_counts, chunk_layer_ranges
from hettrain.render.schedule import build_timeline, interleaved_order
from hettrain.runtime.launch import free_port_block, launch_local, wait_all
from hettrain.runtime.model import StageModel, whole_model
from hettrain.runtime.pipeline import StageRunner, executed_schedule
from hettrain.runtime.schedules import chunk_actions, interleaved_actions
from hettrain.runtime.trainer import reference_losses

RTOL = 1e-5  # fp32: only summation orders differ
SEVEN = dataclasses.replace(TINY, layers=7, name="gpt-tiny-7")


def _interleaved(splits, dp, v=2, schedule="interleaved", **kw):
    """A plan on one of the chunked schedules (interleaved, interleaved-zb) with ``v`` chunks."""
    return dataclasses.replace(tiny_plan(splits, dp, schedule=schedule, **kw), virtual_stages=v)


# ---------------------------------------------------------------- layer mapping


def _brute_force_ranges(counts, v):
    """Walk the chunk-major visiting order one layer at a time."""
    sizes = {(c, s): counts[s] // v + (c < counts[s] % v) for s in range(len(counts))
             for c in range(v)}
    out, layer = [[None] * v for _ in counts], 0
    for c in range(v):
        for s in range(len(counts)):
            out[s][c] = (layer, layer + sizes[(c, s)])
            layer += sizes[(c, s)]
    return out


@pytest.mark.parametrize("counts,v", [([2, 2], 2), ([2, 3, 2], 2), ([3, 5, 4], 3),
                                      ([4, 4], 4), ([1, 1, 1], 1), ([5, 2], 2)])
def test_chunk_layer_ranges_are_chunk_major_and_cover_every_layer(counts, v):
    model = dataclasses.replace(TINY, layers=sum(counts))
    bounds = list(itertools.accumulate([0, *counts]))
    splits = [(a, b, "p") for a, b in itertools.pairwise(bounds)]
    plan = _interleaved(splits, 1, v=v, model=model, num_microbatches=len(counts))
    got = chunk_layer_ranges(plan)
    assert got == _brute_force_ranges(counts, v)
    assert [sum(b - a for a, b in chunks) for chunks in got] == counts  # n_s per stage kept
    for s, chunks in enumerate(got):
        sizes = [b - a for a, b in chunks]
        assert sizes == chunk_counts(counts[s], v) and max(sizes) - min(sizes) <= 1
    layers = sorted(i for chunks in got for a, b in chunks for i in range(a, b))
    assert layers == list(range(sum(counts)))
    if v == 1:  # no virtual stages: the plan's own ranges
        assert got == [[(a, b)] for a, b, _ in splits]


def test_chunk_layer_ranges_without_interleaving_are_the_plan_ranges():
    plan = tiny_plan([(0, 3, "a"), (3, 4, "b")], dp=1)
    assert chunk_layer_ranges(dataclasses.replace(plan, virtual_stages=2)) == [[(0, 3)], [(3, 4)]]


def test_a_stage_with_fewer_layers_than_chunks_is_named():
    plan = _interleaved([(0, 3, "a"), (3, 4, "b")], 1, v=2)
    with pytest.raises(ValueError, match=r"plan.stages\[1\] has 1 layers.*virtual_stages=2"):
        chunk_layer_ranges(plan)


# ---------------------------------------------------------------- operation order


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (3, 6, 2), (3, 3, 2),
                                    (4, 8, 2), (4, 4, 3), (2, 6, 1)])
def test_runtime_order_equals_the_plan_figure_order_and_is_complete(pp, m, v):
    for s in range(pp):
        acts = interleaved_actions(s, pp, m, v)
        assert acts == [(k, mb, c) for k, _, mb, c in interleaved_order(s, pp, m, v)]
        assert acts == chunk_actions("interleaved", s, pp, m, v)
        for kind in "FB":
            assert sorted((i, c) for k, i, c in acts if k == kind) == \
                sorted(itertools.product(range(m), range(v)))
        pos = {(k, i, c): n for n, (k, i, c) in enumerate(acts)}
        assert all(pos[("F", i, c)] < pos[("B", i, c)] for i in range(m) for c in range(v))
        # each (source, tag) stream is consumed in microbatch order: gloo's in-order matching
        for kind in "FB":
            for c in range(v):
                mbs = [i for k, i, cc in acts if k == kind and cc == c]
                assert mbs == sorted(mbs)
    # the timed replay of the same orders completes (no deadlock) and beats 1F1B's bubble
    inter = build_timeline([3.0] * pp, m, "interleaved", chunks=v)
    plain = build_timeline([3.0] * pp, m, "1f1b")
    assert inter.makespan_ms <= plain.makespan_ms + 1e-9


def test_interleaved_needs_a_multiple_of_pp_microbatches():
    with pytest.raises(ValueError, match=r"num_microbatches=5.*multiple of pp=2"):
        interleaved_actions(0, 2, 5, 2)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        chunk_actions("1f1b", 0, 2, 4, 2)


# ---------------------------------------------------------------- chunked models


def test_chunked_stage_models_compose_to_the_whole_model():
    plan = _interleaved([(0, 2, "a"), (2, 5, "b"), (5, 7, "c")], 1, model=SEVEN,
                        num_microbatches=3)
    ranges = chunk_layer_ranges(plan)
    assert ranges == [[(0, 1), (4, 5)], [(1, 3), (5, 6)], [(3, 4), (6, 7)]]
    stages = [StageModel(SEVEN, 0, 0, has_embedding=s == 0, has_head=s == 2, seed=4,
                         chunks=ranges[s]) for s in range(3)]
    whole = whole_model(SEVEN, seed=4)
    ref = dict(whole.named_parameters())
    for st in stages:  # global names, identical initial weights
        for name, p in st.named_parameters():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=0)
    assert sorted(n for st in stages for n, _ in st.named_parameters()) == sorted(ref)
    tokens = torch.randint(0, SEVEN.vocab, (2, SEVEN.seq_len), generator=torch.Generator()
                           .manual_seed(0))
    x = tokens
    for c in range(2):  # chunk-major: (0,0) (0,1) (0,2) (1,0) (1,1) (1,2)
        for st in stages:
            x = st.forward_chunk(c, x)
    torch.testing.assert_close(x, whole(tokens), rtol=1e-5, atol=1e-6)


def test_runner_rejects_inconsistent_interleaved_setups():
    plan = _interleaved([(0, 2, "a"), (2, 4, "b")], 1)
    chunks = chunk_layer_ranges(plan)[0]
    model = StageModel(TINY, 0, 0, has_embedding=True, has_head=False, seed=3, chunks=chunks)
    runner = StageRunner(plan, 0, model)
    assert (runner.planned, runner.schedule, runner.v) == ("interleaved", "interleaved", 2)
    assert executed_schedule("interleaved") == "interleaved"
    with pytest.raises(ValueError, match=r"num_microbatches=3.*multiple of pp=2"):
        StageRunner(dataclasses.replace(plan, num_microbatches=3), 0, model)
    flat = StageModel(TINY, 0, 2, has_embedding=True, has_head=False, seed=3)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        StageRunner(plan, 0, flat)
    with pytest.raises(ValueError, match="set schedule: interleaved"):
        StageRunner(dataclasses.replace(plan, schedule="1f1b"), 0, model)
    one = _interleaved([(0, 4, "a")], 1)
    with pytest.raises(ValueError, match=r"plan.pp=1"):
        StageRunner(one, 0, StageModel(TINY, 0, 0, has_embedding=True, has_head=True, seed=3,
                                       chunks=chunk_layer_ranges(one)[0]))


# ---------------------------------------------------------------- real pipelines


def _scrape_schedule(procs, port):
    """The ``hettrain_runtime_schedule_info`` line served on ``port`` while ``procs`` run."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=2).read().decode()
        except OSError:
            text = ""
        lines = [x for x in text.splitlines() if x.startswith("hettrain_runtime_schedule_info{")]
        if lines:
            return lines[0]
        time.sleep(0.2)
    return ""


def _run(work, plan, env=None, scrape_rank=None):
    port = free_port_block(plan.world_size) if scrape_rank is not None else 0
    env = {"HETTRAIN_LOSS_LOG": str(work / "loss.jsonl"), "HETTRAIN_METRICS_PORT": str(port),
           "HETTRAIN_SUMMARY_DIR": str(work / "summary"), **(env or {})}
    procs = launch_local(plan, work, env)
    info = _scrape_schedule(procs, port + scrape_rank) if scrape_rank is not None else ""
    codes = wait_all(procs, 150)
    logs = "\n".join(p.read_text() for p in sorted(work.glob("rank-*.log")))
    assert codes == [0] * plan.world_size, logs[-6000:]
    losses = {d["step"]: d["loss"]
              for d in map(json.loads, (work / "loss.jsonl").read_text().splitlines())}
    sums = [json.loads((work / "summary" / f"rank-{r}.json").read_text())
            for r in range(plan.world_size)]
    return losses, logs, sums, info


def _resumed(work, plan, ck, schedule):
    """Run ``plan`` resuming from the checkpoints under ``ck``; asserts it ran ``schedule``;
    returns its losses by step."""
    got, logs, sums, _ = _run(work, plan, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                           "HETTRAIN_RESUME": "1"})
    _assert_ran(logs, sums, plan, schedule)
    return got


def _p2p_sent(sums):
    """Bytes the ranks sent over any link but a pool's own (the pipeline's, where each stage
    has its own pool: the DP sync stays inside a pool)."""
    return sum(b for s in sums for b in s["bytes"].values()) - sum(
        s["bytes"].get("intra_pool", 0) for s in sums)


def _assert_ran(logs, sums, plan, schedule):
    assert {s["schedule"] for s in sums} == {schedule}
    assert "not implemented" not in logs
    assert logs.count(f"executing schedule {schedule!r}") == plan.world_size


def _p2p_bytes(plan, steps):
    """Activation + gradient bytes of ``steps`` steps: every chunk boundary of every replica
    (``pp * v - 1`` of them) carries one activation and one gradient per microbatch, each ONCE
    (split over the TP pairs) at the plan's precision: what ``cost.pipeline_bytes_per_step``
    charges."""
    act = plan.micro_batch * plan.model.seq_len * plan.model.hidden * 4  # fp32 plans
    v = plan.virtual_stages
    per_mb = 2 * act * (plan.pp * v - 1)
    assert per_mb * plan.num_microbatches == cost.pipeline_bytes_per_step(
        plan.model, plan.micro_batch, 4, plan.num_microbatches, plan.pp, v)
    return per_mb * plan.num_microbatches * plan.dp * steps


def _assert_matches(got, ref, steps, rel=RTOL):
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(ref[step], rel=rel), step


@pytest.mark.slow
def test_interleaved_pp2_v2_dp2_matches_reference_and_resumes_across_layouts(tmp_path):
    """interleaved pp=2 v=2 x dp=2 -> (checkpoint at 2) plain 1F1B pp=3 -> (at 4) interleaved
    pp=2 v=2 again; one loss curve, the single-process reference's."""
    steps = 6
    # a constant LR: the three runs stop at different step counts, a cosine would follow them
    const = {"lr_schedule": "constant"}
    plan = _interleaved([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=2, steps=4, **const)
    ref = reference_losses(plan, steps)
    assert ref[-1] < ref[0]
    ck = tmp_path / "ckpt"
    got, logs, sums, _ = _run(tmp_path / "run1", plan, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                                        "HETTRAIN_CHECKPOINT_INTERVAL": "2"})
    _assert_ran(logs, sums, plan, "interleaved")
    _assert_matches(got, ref, range(4))
    assert _p2p_sent(sums) == _p2p_bytes(plan, 4)  # pools differ per stage: p2p is all inter-pool
    # as if it had died after step 2: resume as a plain 3-stage 1F1B pipeline, one replica
    rewind(ck, 2)
    second = tiny_plan([(0, 1, "pool-a"), (1, 2, "pool-a"), (2, 4, "pool-b")], dp=1,
                       steps=4, num_microbatches=8, **const)
    after = _resumed(tmp_path / "run2", second, ck, "1f1b")
    _assert_matches(after, ref, range(2, 4), rel=1e-4)
    # and back: the 1F1B checkpoint of step 4 into interleaved pp=2 v=2, one replica
    third = _interleaved([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps,
                         num_microbatches=8, **const)
    last = _resumed(tmp_path / "run3", third, ck, "interleaved")
    _assert_matches(last, ref, range(4, steps), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "interleaved-zb"])
def test_interleaved_pp3_v2_uneven_layers_matches_reference(tmp_path, schedule):
    steps = 4
    plan = _interleaved([(0, 2, "pool-a"), (2, 5, "pool-b"), (5, 7, "pool-c")], dp=1,
                        steps=steps, num_microbatches=6, model=SEVEN, schedule=schedule)
    got, logs, sums, info = _run(tmp_path, plan, {"HETTRAIN_STEP_SLEEP": "0.2"},
                                 scrape_rank=1)
    _assert_ran(logs, sums, plan, schedule)
    assert f'planned="{schedule}"' in info and f'schedule="{schedule}"' in info, info
    assert info.endswith(" 1.0"), info
    _assert_matches(got, reference_losses(plan, steps), range(steps))
    assert sum(b for s in sums for b in s["bytes"].values()) == _p2p_bytes(plan, steps)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "interleaved-zb"])
def test_interleaved_with_tp2_matches_reference(tmp_path, schedule):
    """interleaved-zb: TP linears defer their local weight gradients per chunk (the
    all-reduces stay in B)."""
    steps = 3
    plan = _interleaved([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps, tp=(2, 1),
                        schedule=schedule)
    got, logs, sums, _ = _run(tmp_path, plan)
    _assert_ran(logs, sums, plan, schedule)
    _assert_matches(got, reference_losses(plan, steps), range(steps))


@pytest.mark.slow
def test_interleaved_across_two_dcs_diloco_h1_is_sync_and_int8_stays_close(tmp_path):
    """pp=2 v=2, one replica per datacenter: DiLoCo with H=1, outer lr 1, no momentum and SGD
    is synchronous DP exactly; int8 compression of the DC hop stays within 1e-2 of it."""
    steps = 4
    # no clipping: each DC would clip its own gradient, sync DP the averaged one
    kw = dict(dp=2, steps=steps, lr=0.3, replica_dcs=("dc1", "dc2"), grad_clip=0.0)
    splits = [(0, 2, "pool-a"), (2, 4, "pool-b")]
    plan = _interleaved(splits, cross_dc=dict(mode="diloco", compression="none", outer_steps=1,
                                              outer_lr=1.0, outer_momentum=0.0), **kw)
    ref = reference_losses(plan, steps, optimizer="sgd")
    assert ref[-1] < ref[0]
    got, logs, sums, _ = _run(tmp_path / "diloco", plan, {"HETTRAIN_OPTIMIZER": "sgd"})
    _assert_ran(logs, sums, plan, "interleaved")
    assert all(s["outer_syncs"] == steps for s in sums)
    _assert_matches(got, ref, range(steps))
    comp = _interleaved(splits, cross_dc=dict(mode="compress", compression="int8"), **kw)
    got, logs, sums, _ = _run(tmp_path / "int8", comp, {"HETTRAIN_OPTIMIZER": "sgd"})
    _assert_ran(logs, sums, comp, "interleaved")
    assert sum(s["bytes"]["cross_dc"] for s in sums) > 0
    assert [got[i] for i in range(steps)] == pytest.approx(ref, rel=1e-2)
    assert len({s["param_checksum"] for s in sums if s["stage"] == 0}) == 1
