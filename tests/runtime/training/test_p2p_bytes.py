"""Pipeline transfers: what crosses each boundary, counted, against what the plan charges.

Pure: the TP piece map (every element of a boundary tensor delivered exactly once to every
receiving TP rank's slice, the busiest rank at ``1/min(tp_send, tp_recv)``) against a brute-force
walk, and ``planning.cost`` against the piece map. Real gloo processes: the per-boundary byte
counts every rank writes to its summary equal ``cost.activation_bytes`` per microbatch,
direction and replica (bf16 → 2 bytes per element, fp32 → 4), for tp=2 → tp=2 over the dedicated
stream groups of a same-vendor pair and tp=2 → tp=1 over the host-staged world group of a
cross-vendor pair, and the planner's ``pp_bytes_per_step`` for a plan it made."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.api.spec import parse_job_manifest
from hettrain.planning import cost
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.runtime.collectives import communicator
from hettrain.runtime.collectives.p2p import (
    ACTIVATION,
    GRADIENT,
    boundary_pieces,
    chunk_boundaries,
    plan_streams,
    wire_dtype,
)
from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.pipeline import KIND_NAMES
from hettrain.runtime.trainer import reference_losses

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("ts", "tr"), list(itertools.product([1, 2, 3, 4], repeat=2)))
def test_pieces_deliver_every_element_once_to_each_receiver_slice(ts, tr):
    plan = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, tp=(ts, tr))
    senders = [r.rank for r in plan.ranks if r.stage == 0]
    receivers = [r.rank for r in plan.ranks if r.stage == 1]
    numel = 24 * ts * tr
    owner = {}  # element -> (sender, receiver), brute force over every element
    pieces = boundary_pieces(plan, 0, 1, dp=0)
    assert len({(p.sender, p.receiver) for p in pieces}) == len(pieces)  # one message a pair
    for p in pieces:
        a, b = p.span(numel)
        for e in range(a, b):
            assert e not in owner, e
            owner[e] = (p.sender, p.receiver)
    assert sorted(owner) == list(range(numel))
    for e, (s, r) in owner.items():  # each receiver gets exactly its contiguous 1/tr slice ...
        assert receivers.index(r) == e * tr // numel
        assert senders.index(s) == e * ts // numel  # ... cut from the sender's own 1/ts slice
    sent, got = Counter(), Counter()
    for s, r in owner.values():
        sent[s] += 1
        got[r] += 1
    busiest = max(max(sent.values()), max(got.values()))
    assert busiest == numel / min(ts, tr)  # what the planner's boundary time charges:
    assert busiest / numel == (cost.boundary_link_bytes(TINY, 1, 2, ts, tr)
                               / cost.activation_bytes(TINY, 1, 2))


@pytest.mark.parametrize(("pp", "v", "dp", "tps"), [(2, 1, 1, (2, 1)), (3, 1, 2, (1, 2, 4)),
                                                    (2, 2, 1, (2, 2)), (3, 2, 2, (1, 3, 2))])
def test_cost_model_bytes_equal_the_piece_map(pp, v, dp, tps):
    splits = [(2 * s, 2 * s + 2, f"p{s}") for s in range(pp)]
    model = dataclasses.replace(TINY, layers=2 * pp, heads=12, kv_heads=12, hidden=48)
    plan = tiny_plan(splits, dp=dp, tp=tps, model=model, num_microbatches=pp * 2,
                     schedule="interleaved" if v > 1 else "1f1b")
    plan = dataclasses.replace(plan, virtual_stages=v)
    streams = plan_streams(plan)
    assert len(streams) == 2 * dp * (pp * v - 1) == 2 * dp * len(chunk_boundaries(pp, v))
    numel = plan.micro_batch * model.seq_len * model.hidden
    for precision in ("fp32", "bf16"):
        eb = wire_dtype(precision).itemsize
        per_mb = sum((p.span(numel)[1] - p.span(numel)[0]) * eb
                     for st in streams for p in st.pieces)
        assert per_mb * plan.num_microbatches == dp * cost.pipeline_bytes_per_step(
            model, plan.micro_batch, eb, plan.num_microbatches, pp, v)


def _run(work, plan, env=None):
    env = {"HETTRAIN_LOSS_LOG": str(work / "loss.jsonl"), "HETTRAIN_METRICS_PORT": "0",
           "HETTRAIN_SUMMARY_DIR": str(work / "summary"), **(env or {})}
    codes = wait_all(launch_local(plan, work, env), 180)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(work.glob("rank-*.log")))
    assert codes == [0] * plan.world_size, logs
    losses = [json.loads(line)["loss"] for line in (work / "loss.jsonl").read_text().splitlines()]
    sums = [json.loads((work / "summary" / f"rank-{r}.json").read_text())
            for r in range(plan.world_size)]
    return losses, sums


def _by_boundary(sums, field="bytes"):
    """{(boundary, kind): summed field over ranks}."""
    out = Counter()
    for s in sums:
        for row in s["p2p"]:
            out[(row["boundary"], row["kind"])] += row[field]
    return out


def _check_bytes(plan, sums, steps):
    """Per boundary and direction: exactly one boundary tensor per microbatch and replica at
    the plan's precision; each rank sends its 1/tp_send share; TP all-gathers on receipt."""
    eb = cost.precision_bytes(plan.training)
    act = cost.activation_bytes(plan.model, plan.micro_batch, eb)
    per_dir = act * plan.num_microbatches * plan.dp * steps
    got = _by_boundary(sums)
    assert got == {(0, "activation"): per_dir, (0, "gradient"): per_dir}, got
    assert sum(got.values()) == plan.dp * steps * cost.pipeline_bytes_per_step(
        plan.model, plan.micro_batch, eb, plan.num_microbatches, plan.pp)
    for s in sums:
        (row,) = s["p2p_sent"]
        tp_send = plan.stages[s["stage"]].tp
        tp_recv = plan.stages[1 - s["stage"]].tp
        assert row["bytes"] == per_dir / plan.dp / tp_send, (s["rank"], row)
        assert row["messages"] == plan.num_microbatches * steps * len(
            [p for p in boundary_pieces(plan, s["stage"], 1 - s["stage"], s["dp"])
             if p.sender == s["rank"]])
        # what this rank receives per step: its 1/tp slice; the busiest rank of the boundary
        # sends or receives the 1/min(tp_send, tp_recv) the planner times
        received = per_dir / plan.dp / plan.stages[s["stage"]].tp
        busiest = cost.boundary_link_bytes(plan.model, plan.micro_batch, eb, tp_send, tp_recv)
        assert max(row["bytes"], received) <= busiest * plan.num_microbatches * steps
    return got


def _annotate(plan, sums):
    """Split each rank's p2p rows into what it sent and what its receipt all-gathered."""
    for s in sums:
        s["p2p_sent"] = [r for r in s["p2p"] if r["bytes"]]
        kind = "activation" if s["stage"] == 1 else "gradient"  # what this rank receives
        gathered = [r["gather_bytes"] for r in s["p2p"] if r["kind"] == kind]
        s["p2p_gather"] = sum(gathered)


@pytest.mark.slow
def test_tp2_to_tp2_bf16_same_vendor_sends_one_bf16_copy_over_stream_groups(tmp_path):
    steps = 2
    plan = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps, tp=2,
                     num_microbatches=4, vendors=("nvidia", "nvidia"))
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training,
                                                                  precision="bf16"))
    losses, sums = _run(tmp_path, plan)
    _annotate(plan, sums)
    _check_bytes(plan, sums, steps)
    act = cost.activation_bytes(plan.model, plan.micro_batch, 2)
    for s in sums:  # nccl on a GPU host; here the CPU resolves the pair's group to gloo
        assert {r["route"] for r in s["p2p_sent"]} == {"stream:gloo"}, s["p2p"]
        # each receiver all-gathers the other half: (tp-1)/tp of a tensor per microbatch
        assert s["p2p_gather"] == act / 2 * plan.num_microbatches * steps
    ref = reference_losses(plan, steps)  # fp32 model; only the boundary is rounded to bf16
    dev = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
    print(f"bf16 boundary vs fp32 reference: max rel loss deviation {dev:.1e}")
    assert losses == pytest.approx(ref, rel=1e-2)


@pytest.mark.slow
def test_tp2_to_tp1_fp32_cross_vendor_is_host_staged_and_exact(tmp_path):
    steps = 2
    plan = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps, tp=(2, 1),
                     num_microbatches=4, vendors=("nvidia", "amd"))
    losses, sums = _run(tmp_path, plan)
    _annotate(plan, sums)
    _check_bytes(plan, sums, steps)
    act = cost.activation_bytes(plan.model, plan.micro_batch, 4)
    for s in sums:
        assert {r["route"] for r in s["p2p_sent"]} == {"world"}, s["p2p"]
    # the single stage-1 rank receives two halves (no gather); each stage-0 rank receives its
    # half of the gradient from it and all-gathers the other half
    assert [s["p2p_gather"] for s in sums] == [act / 2 * 4 * steps] * 2 + [0]
    assert losses == pytest.approx(reference_losses(plan, steps), rel=1e-5)


@pytest.mark.slow
def test_planner_plan_bytes_per_step_are_what_the_runtime_sends(tmp_path):
    doc = yaml.safe_load((ROOT / "examples/jobs/gpt-tiny-local.yaml").read_text())
    name, spec = parse_job_manifest(doc)
    steps = 2
    spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training, steps=steps,
                                                                  precision="bf16"))
    plan = plan_job(name, spec, load_cluster(ROOT / "examples/clusters/local-cpu.yaml"))
    assert plan.pp >= 2, plan.to_json()
    assert plan.predicted.pp_bytes_per_step == plan.dp * cost.pipeline_bytes_per_step(
        plan.model, plan.micro_batch, 2, plan.num_microbatches, plan.pp, plan.virtual_stages)
    _, sums = _run(tmp_path, plan)
    measured = sum(_by_boundary(sums).values())
    assert measured == plan.predicted.pp_bytes_per_step * steps
    # every chunk boundary (p·v − 1 of them: the interleaved schedules' too) in both directions
    assert {(row["boundary"], row["kind"]) for s in sums for row in s["p2p"]} == {
        (b, KIND_NAMES[k]) for b in range(plan.pp * plan.virtual_stages - 1)
        for k in (ACTIVATION, GRADIENT)}


def _connect_as(monkeypatch, plan, rank, resolve):
    """Run the communicator's p2p group set-up as ``rank`` with dist faked: returns the
    ``new_group`` calls, the probes sent/received and the rank's stream groups."""
    calls, probes = [], []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: calls.append(
        (tuple(ranks), backend)) or object())
    monkeypatch.setattr(dist, "send", lambda t, dst, group: probes.append(("send", dst)))
    monkeypatch.setattr(dist, "recv", lambda t, src, group: probes.append(("recv", src)))
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    comm = object.__new__(communicator.HetCommunicator)
    comm.plan, comm.rank, comm.device = plan, rank, torch.device("cpu")
    comm.pool_backends = {p: st.backend for st in plan.stages for p in st.pools}
    comm._groups = communicator._Groups(resolve)
    comm.p2p_groups = {}
    comm._connect_p2p({r.rank: r.pool for r in plan.ranks})
    return calls, probes, comm


def test_stream_groups_same_sequence_on_every_host_one_per_same_vendor_piece(monkeypatch):
    plan = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=2, tp=(2, 1),
                     vendors=("nvidia", "nvidia"))
    pieces = [(p.sender, p.receiver, st.tag) for st in plan_streams(plan) for p in st.pieces]
    on_gpu, probes, comm = _connect_as(monkeypatch, plan, 0, lambda b: "nccl")
    on_cpu, cpu_probes, cpu_comm = _connect_as(monkeypatch, plan, 4, lambda b: "gloo")
    assert [r for r, _ in on_gpu] == [r for r, _ in on_cpu]  # torch names groups by call count
    assert [r for r, _ in on_gpu] == [tuple(sorted(p[:2])) for p in pieces]
    assert {b for _, b in on_gpu} == {"nccl"} and {b for _, b in on_cpu} == {"gloo"}
    mine = [p for p in pieces if 0 in p[:2]]  # rank 0: stage 0, replica 0, TP 0
    assert sorted(comm.p2p_groups) == sorted(mine)
    assert all(comm.backend(g) == "nccl" for g in comm.p2p_groups.values())
    # a vendor group is connected at start-up by one probe per stream, in plan_streams order
    assert probes == [("send", r) if s == 0 else ("recv", s) for s, r, _ in mine]
    assert cpu_probes == [] and all(cpu_comm.backend(g) == "gloo"
                                    for g in cpu_comm.p2p_groups.values())
    across = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, tp=2,
                       vendors=("nvidia", "intel"))
    calls, probes, comm = _connect_as(monkeypatch, across, 0, lambda b: b)
    assert calls == [] and probes == [] and comm.p2p_group(0, 2, 0) is None  # world, staged
