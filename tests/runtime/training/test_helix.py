"""The helix schedule (HelixPipe's attention-parallel partition) ordered and executed for real.

The pure order (``planning/helix.py``) is checked by brute force: every part of every layer
of every microbatch once, in dependency order on the stage that owns it (cores and their
backwards together, on the owner or a stage that would idle), at most ``pp`` microbatches in
flight, replayable with any costs. The runtime's three layer parts compose to the decoder
layer bit for bit, and multi-process gloo pipelines (pp=4 with cores moved to idle stages,
pp=2 × dp=2, recompute) reproduce the single-process reference losses, send exactly the
messages the order implies, and resume from a checkpoint into a 1F1B layout.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tests.runtime.checkpoints import rewind
from tests.runtime.training.plans import TINY, tiny_plan
from tests.runtime.training.test_interleaved import (
    RTOL,
    _assert_matches,
    _assert_ran,
    _p2p_sent,
    _resumed,
    _run,
)

from hettrain.planning.helix import (
    FORWARD,
    KINDS,
    bubble_divisor,
    check_layout,
    helix_orders,
    makespan,
    owner,
    part_costs,
    placement,
    transfers,
)
from hettrain.planning.layers import chunk_layer_ranges
from hettrain.runtime.helix import (
    attention_core,
    plan_costs,
    post_attention,
    pre_attention,
)
from hettrain.runtime.model import StageModel, whole_model
from hettrain.runtime.pipeline import StageRunner
from hettrain.runtime.trainer import reference_losses

LONG = part_costs(131072, 4096, 32, 8, 14336)  # llama3-8b at 128k: the core is 71%
SHORT = part_costs(2048, 4096, 32, 8, 14336)
LONGER = dataclasses.replace(TINY, seq_len=96, name="gpt-tiny-96")
GRID = [(pp, layers, m) for pp, layers in ((1, 3), (2, 4), (3, 6), (4, 8), (4, 12))
        for m in (1, 2, pp, pp + 1, 2 * pp + 1)]


def _helix(splits, dp, **kw):
    """A helix plan: one layer per chunk, ``layers / pp`` chunks per stage."""
    plan = tiny_plan(splits, dp, schedule="helix", **kw)
    return dataclasses.replace(plan, virtual_stages=plan.model.layers // plan.pp)


# ---------------------------------------------------------------- the order


def _in_flight_peak(orders, m):
    """Most microbatches entered (first Fq ran) and not finished (last Bq ran), replayed
    with unit costs on the one timeline of stage 0 (which both enters and finishes them)."""
    live = peak = 0
    for kind, _, k in orders[0]:
        if (kind, k) == ("Fq", 0):
            live += 1
            peak = max(peak, live)
        elif (kind, k) == ("Bq", 0):
            live -= 1
    return peak


@pytest.mark.parametrize("pp,layers,m", GRID)
@pytest.mark.parametrize("costs", [LONG, SHORT], ids=["128k", "2k"])
@pytest.mark.parametrize("filo", [False, True], ids=["capped", "filo"])
def test_every_part_once_in_dependency_order_on_its_stage(pp, layers, m, costs, filo):
    orders = helix_orders(pp, layers, m, costs, filo=filo)
    every = sorted((k, j, layer) for k in KINDS for j in range(m) for layer in range(layers))
    assert sorted(a for actions in orders for a in actions) == every
    place = placement(orders)
    for s, actions in enumerate(orders):
        for kind, j, k in actions:
            if kind in ("Fa", "Ba"):  # a core and its backward on one stage
                assert place[(j, k)] == s
            else:
                assert owner(k, pp) == s
    # the orders realise the dependencies: a replay with random costs finishes
    rng = random.Random(pp * 100 + m)
    for _ in range(3):
        per = [{k: rng.uniform(0.1, 2.0) for k in KINDS} for _ in range(pp)]
        assert makespan(orders, layers, per, hop_s=rng.uniform(0, 0.5)) > 0
    assert _in_flight_peak(orders, m) <= (m if filo else pp)
    if filo:  # first in, last out: every forward first, then the latest microbatch's backward
        for s, actions in enumerate(orders):
            kinds = [kind in FORWARD for kind, _, _ in actions]
            assert kinds == sorted(kinds, reverse=True)
            for k in range(s, layers, pp):
                assert [j for kind, j, kk in actions if (kind, kk) == ("Bo", k)] == \
                    list(reversed(range(m)))
        assert all(s == owner(k, pp) for (_, k), s in placement(orders).items())
    # within a stage, each microbatch's parts run in chain order
    chain = [(f, k) for k in range(layers) for f in FORWARD] + \
        [(b, k) for k in reversed(range(layers)) for b in ("Bo", "Ba", "Bq")]
    rank = {step: n for n, step in enumerate(chain)}
    for actions in orders:
        for j in range(m):
            mine = [rank[(kind, k)] for kind, jj, k in actions if jj == j]
            assert mine == sorted(mine)


def test_layers_must_divide_by_pp():
    with pytest.raises(ValueError, match=r"model.layers=6 must be a positive multiple of "
                                         r"plan.pp=4"):
        check_layout(6, 4, 2)


def test_cores_move_to_idle_stages_where_attention_dominates():
    """At 128k the fill's idle stages take cores (two transfers each, and their gradients);
    the replayed bubble is a fraction of 1F1B's; at 2k with more microbatches the cores
    stay home."""
    orders = helix_orders(4, 32, 4, LONG)
    moved = [(j, k) for (j, k), s in placement(orders).items() if s != owner(k, 4)]
    assert moved
    # every message by brute force: a part whose producer ran on another stage received one
    where = {a: s for s, actions in enumerate(orders) for a in actions}
    feeds = {"Fq": ("Fo", -1, "hidden"), "Fa": ("Fq", 0, "qkv"), "Fo": ("Fa", 0, "core"),
             "Bo": ("Bq", 1, "hidden"), "Ba": ("Bo", 0, "core"), "Bq": ("Ba", 0, "qkv")}
    counted = {"hidden": 0, "qkv": 0, "core": 0}
    for (kind, j, k), s in where.items():
        src_kind, dk, payload = feeds[kind]
        src = (src_kind, j, k + dk)
        if src in where and where[src] != s:
            counted[payload] += 1
    assert transfers(orders, 32) == counted
    assert counted["qkv"] == 2 * len(moved)
    assert bubble_divisor(4, 32, 4, LONG) > 4  # 1F1B's bubble over more than 4
    short = helix_orders(4, 32, 8, SHORT)
    assert transfers(short, 32)["qkv"] == 0


@pytest.mark.parametrize("filo", [False, True], ids=["capped", "filo"])
def test_the_bubble_divisor_restates_the_replayed_makespan(filo):
    for pp, layers, m in [(2, 8, 4), (4, 16, 6), (8, 32, 8)]:
        for hop in (0.0, 0.2):
            div = bubble_divisor(pp, layers, m, LONG, hop, filo)
            stage = sum(LONG.values()) * layers / pp
            t = makespan(helix_orders(pp, layers, m, LONG, hop, filo), layers, [LONG] * pp, hop)
            assert t == pytest.approx((m + (pp - 1) / div) * stage)
            if hop == 0:
                assert t < (m + pp - 1) * stage  # beats 1F1B on equal stages (free hops)


def test_first_in_last_out_hides_hops_behind_more_microbatches():
    """With more microbatches than stages and a hop per transfer, the first-in-last-out order
    replays faster than the capped one (each hop hidden behind the same layer's other
    microbatches): llama3-8b shapes at 32k and 128k, 32 layers."""
    for seq in (32768, 131072):
        costs = part_costs(seq, 4096, 32, 8, 14336)
        for pp, m in ((2, 8), (4, 16), (8, 32)):
            for hop in (0.2, 0.5):
                capped = makespan(helix_orders(pp, 32, m, costs, hop), 32, [costs] * pp, hop)
                filo = makespan(helix_orders(pp, 32, m, costs, hop, filo=True), 32,
                                [costs] * pp, hop)
                ideal = m * sum(costs.values()) * 32 / pp
                assert filo < 0.9 * capped
                assert filo < 1.08 * ideal


# ---------------------------------------------------------------- the layer parts


def test_the_three_parts_compose_to_the_decoder_layer_exactly():
    model = whole_model(TINY, seed=3)
    x = torch.randn(2, TINY.seq_len, TINY.hidden, generator=torch.Generator().manual_seed(1))
    cos, sin = model._cos_sin(x)
    for k in range(TINY.layers):
        layer = model.model.layers[str(k)]
        qkv = pre_attention(layer, x, cos, sin)
        assert qkv.shape == (2, TINY.heads + 2 * TINY.kv_heads, TINY.seq_len, TINY.head_dim)
        got = post_attention(layer, x, attention_core(qkv, TINY.heads, TINY.kv_heads))
        assert torch.equal(got, layer(x, cos, sin))


def test_runner_rejects_layouts_helix_cannot_run():
    plan = _helix([(0, 2, "a"), (2, 4, "b")], 1)
    assert chunk_layer_ranges(plan) == [[(0, 1), (2, 3)], [(1, 2), (3, 4)]]
    model = StageModel(TINY, 0, 0, has_embedding=True, has_head=False, seed=3,
                       chunks=chunk_layer_ranges(plan)[0])
    runner = StageRunner(plan, 0, model)
    assert (runner.schedule, runner.v, runner.helix is not None) == ("helix", 2, True)
    with pytest.raises(ValueError, match="one layer per chunk"):
        StageRunner(dataclasses.replace(plan, virtual_stages=1), 0,
                    StageModel(TINY, 0, 2, has_embedding=True, has_head=False, seed=3))
    tp2 = dataclasses.replace(_helix([(0, 2, "a"), (2, 4, "b")], 1, tp=(2, 1)))
    with pytest.raises(ValueError, match="without tensor or context parallelism"):
        StageRunner(tp2, 0, model)
    assert plan_costs(plan) == part_costs(TINY.seq_len, TINY.hidden, TINY.heads,
                                          TINY.kv_heads, TINY.ffn_hidden, TINY.gated_mlp)


# ---------------------------------------------------------------- real pipelines


def _message_bytes(plan, steps):
    """Bytes one replica's helix step sends between stages (fp32 plans), from the order."""
    spec, b, m = plan.model, plan.micro_batch, plan.num_microbatches
    orders = helix_orders(plan.pp, spec.layers, m, plan_costs(plan), plan.helix_hop,
                          plan.helix_filo)
    n = transfers(orders, spec.layers)
    hidden = b * spec.seq_len * spec.hidden
    qkv = b * (spec.heads + 2 * spec.kv_heads) * spec.seq_len * spec.head_dim
    core = b * spec.heads * spec.seq_len * spec.head_dim
    return 4 * (n["hidden"] * hidden + n["qkv"] * qkv + n["core"] * core) * plan.dp * steps


@pytest.mark.slow
def test_helix_pp4_moves_cores_matches_reference_and_resumes_as_1f1b(tmp_path):
    """96 tokens, 3 microbatches: this order moves cores to idle stages."""
    steps = 4
    const = {"lr_schedule": "constant"}
    plan = _helix([(k, k + 1, f"pool-{k}") for k in range(4)], dp=1, steps=2,
                  num_microbatches=3, model=LONGER, **const)
    orders = helix_orders(4, TINY.layers, 3, plan_costs(plan))
    assert any(s != owner(k, 4) for (_, k), s in placement(orders).items())
    ref = reference_losses(plan, steps)
    ck = tmp_path / "ckpt"
    got, logs, sums, _ = _run(tmp_path / "run1", plan, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                                        "HETTRAIN_CHECKPOINT_INTERVAL": "2"})
    _assert_ran(logs, sums, plan, "helix")
    _assert_matches(got, ref, range(2))
    sent = sum(b for s in sums for b in s["bytes"].values())
    assert sent == _message_bytes(plan, 2)
    rewind(ck, 2)
    second = tiny_plan([(0, 2, "pool-0"), (2, 4, "pool-1")], dp=1, steps=steps,
                       num_microbatches=3, model=LONGER, **const)
    after = _resumed(tmp_path / "run2", second, ck, "1f1b")
    _assert_matches(after, ref, range(2, steps), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("recompute,chunk,filo", [("none", 0, False),
                                                  ("attention-free", 0, False),
                                                  ("attention-free", 7, False),
                                                  ("attention-free", 0, True)])
def test_helix_pp2_dp2_matches_reference(tmp_path, recompute, chunk, filo):
    """Training losses and the validation losses (the forward-only pass over the chunk
    streams) match the single-process reference, also with the loss in chunks of 7 tokens
    (``loss_chunk_tokens``) and in the first-in-last-out order (``helix_filo``)."""
    steps = 3
    plan = _helix([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=2, steps=steps,
                  num_microbatches=3, recompute=recompute, validation_interval=2,
                  validation_batches=2, loss_chunk_tokens=chunk)
    plan = dataclasses.replace(plan, helix_filo=filo)
    got, logs, sums, _ = _run(tmp_path, plan)
    _assert_ran(logs, sums, plan, "helix")
    validation: dict[int, float] = {}
    _assert_matches(got, reference_losses(plan, steps, validation=validation), range(steps))
    assert sorted(validation) == [2]
    last = max(s["rank"] for s in sums)
    rec = next(s for s in sums if s["rank"] == last)
    assert rec["validation"]["2"] == pytest.approx(validation[2], rel=RTOL)
    p2p = _p2p_sent(sums)
    # validation: forward only over the chunk boundaries (pp·v − 1), validation_batches
    # global batches, i.e. that many times m microbatches per replica, fp32
    act = plan.micro_batch * plan.model.seq_len * plan.model.hidden * 4
    val = (plan.dp * (plan.pp * plan.virtual_stages - 1) * plan.training.validation_batches
           * plan.num_microbatches * act)
    assert p2p == _message_bytes(plan, steps) + val

