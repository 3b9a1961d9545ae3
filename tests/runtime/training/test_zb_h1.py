"""ZB-H1 executed for real: the split backward (B = input gradients, W = deferred linear
weight gradients) gives the ordinary gradients, and multi-process gloo pipelines (pp=2 x dp=2
on two pools, pp=3, tp=2 x pp=2) reproduce the single-process reference losses and resume
from a checkpoint onto a different layout."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch
from tests.runtime.checkpoints import rewind
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.runtime.launch import free_port_block, launch_local, wait_all
from hettrain.runtime.model import Linear, defer_weight_grads, lm_loss, whole_model
from hettrain.runtime.trainer import reference_losses

RTOL = 1e-5  # fp32: only summation orders differ


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_split_backward_gives_the_ordinary_gradients():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab, (3, TINY.seq_len), generator=gen)
    ref = torch.nn.Linear(4, 5, bias=False)  # torch's own linear as the oracle
    ours = Linear(4, 5)
    ours.weight.data.copy_(ref.weight.data)
    x = torch.randn(2, 3, 4)
    ref(x).pow(2).sum().backward()
    xs = x.clone().requires_grad_()
    with defer_weight_grads() as store:
        ours(xs).pow(2).sum().backward()
    assert ours.weight.grad is None and len(store.items) == 1  # W not run yet
    x2 = x.clone().requires_grad_()
    torch.nn.functional.linear(x2, ref.weight.detach()).pow(2).sum().backward()
    torch.testing.assert_close(xs.grad, x2.grad)  # B: the input gradient is complete
    store.flush()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    assert not store.items

    whole = whole_model(TINY, seed=3)
    lm_loss(whole(tokens), tokens).backward()
    want = _grads(whole)
    whole.zero_grad(set_to_none=True)
    with defer_weight_grads() as store:
        lm_loss(whole(tokens), tokens).backward()
    linears = {n for n, m in whole.named_modules() if isinstance(m, Linear)}
    for n, p in whole.named_parameters():  # norm / embedding grads are done in B
        assert (p.grad is None) == (n.rsplit(".", 1)[0] in linears), n
    assert len(store.items) == len(linears)
    store.flush()
    for n, p in whole.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)


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
    info = _scrape_schedule(procs, port + scrape_rank) if scrape_rank is not None else None
    codes = wait_all(procs, 150)
    logs = "\n".join(p.read_text() for p in sorted(work.glob("rank-*.log")))
    assert codes == [0] * plan.world_size, logs[-6000:]
    losses = {d["step"]: d["loss"]
              for d in map(json.loads, (work / "loss.jsonl").read_text().splitlines())}
    sums = [json.loads((work / "summary" / f"rank-{r}.json").read_text())
            for r in range(plan.world_size)]
    return (losses, logs, sums) if info is None else (losses, logs, sums, info)


def _assert_ran_zb_h1(logs, sums, plan):
    assert {s["schedule"] for s in sums} == {"zb-h1"}
    assert "not implemented" not in logs
    assert logs.count("executing schedule 'zb-h1'") == plan.world_size


@pytest.mark.slow
def test_zb_h1_pp2_dp2_two_pools_matches_reference_and_resumes(tmp_path):
    steps = 6
    plan = tiny_plan([(0, 3, "pool-a"), (3, 4, "pool-b")], dp=2, steps=steps,
                     schedule="zb-h1")
    ck = tmp_path / "ckpt"
    got, logs, sums = _run(tmp_path / "run1", plan, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                                    "HETTRAIN_CHECKPOINT_INTERVAL": "3"})
    _assert_ran_zb_h1(logs, sums, plan)
    ref = reference_losses(plan, steps)
    assert sorted(got) == list(range(steps)) and ref[-1] < ref[0]
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    # as if it had died after step 3: resume as a 3-stage ZB-H1 pipeline, one replica
    rewind(ck, 3)
    second = tiny_plan([(0, 1, "pool-a"), (1, 2, "pool-a"), (2, 4, "pool-b")], dp=1,
                       steps=steps, num_microbatches=8, schedule="zb-h1")
    after, logs, sums = _run(tmp_path / "run2", second, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                                        "HETTRAIN_RESUME": "1"})
    _assert_ran_zb_h1(logs, sums, second)
    assert sorted(after) == list(range(3, steps))
    for step in range(3, steps):
        assert after[step] == pytest.approx(ref[step], rel=1e-4), step


@pytest.mark.slow
def test_zb_h1_pp3_matches_reference(tmp_path):
    steps = 5
    plan = tiny_plan([(0, 1, "pool-a"), (1, 3, "pool-a"), (3, 4, "pool-b")], dp=1,
                     steps=steps, num_microbatches=6, schedule="zb-h1")
    got, logs, sums, info = _run(tmp_path, plan, {"HETTRAIN_STEP_SLEEP": "0.2"},
                                 scrape_rank=1)
    _assert_ran_zb_h1(logs, sums, plan)
    assert 'planned="zb-h1"' in info and 'schedule="zb-h1"' in info, info
    assert info.endswith(" 1.0"), info
    for step, want in enumerate(reference_losses(plan, steps)):
        assert got[step] == pytest.approx(want, rel=RTOL), step


@pytest.mark.slow
def test_zb_h1_with_tp2_matches_reference(tmp_path):
    """TP linears defer their local weight gradient too (the TP all-reduces stay in B)."""
    steps = 4
    plan = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps, tp=(2, 1),
                     schedule="zb-h1")
    got, logs, sums = _run(tmp_path, plan)
    _assert_ran_zb_h1(logs, sums, plan)
    for step, want in enumerate(reference_losses(plan, steps)):
        assert got[step] == pytest.approx(want, rel=RTOL), step
