"""Real gloo processes: the DP gradient sync overlapped with the backward (bucketed async
all-reduces, runtime/grad_sync.py) trains exactly as the sync-after-backward path and as the
single-process reference, for dp2, dp2 x pp2 (1F1B, interleaved and ZB-H1), dp2 x tp2 (ZeRO-1),
dp2 ZeRO-1, dp2 bf16 and cp2 (the DP x CP gradient group)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tests.runtime.cp.plans import with_cp
from tests.runtime.training.plans import tiny_plan

from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.trainer import reference_losses

pytestmark = pytest.mark.slow

STEPS = 4
BUCKET_MB = "0.004"  # ~4 KiB: the tiny model's stage is cut into several buckets
# fp32: the reference sums the replicas' gradients in another order (1e-5, as the other
# training tests); bf16: a flipped rounding of a bf16 parameter (test_zero1_resume.py)
RTOL = {"fp32": 1e-5, "bf16": 2e-4}


def _run(plan, workdir: Path, env: dict[str, str]) -> tuple[list[float], list[dict]]:
    log = workdir / "loss.jsonl"
    codes = wait_all(launch_local(plan, workdir, {
        "HETTRAIN_LOSS_LOG": str(log), "HETTRAIN_METRICS_PORT": "0",
        "HETTRAIN_SUMMARY_DIR": str(workdir / "summary"), **env}), 300)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(workdir.glob("rank-*.log")))
    assert codes == [0] * plan.world_size, logs
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    summaries = [json.loads((workdir / "summary" / f"rank-{r}.json").read_text())
                 for r in range(plan.world_size)]
    return losses, summaries


CASES = {
    "dp2": dict(splits=[(0, 4, "pool-a")], optimizer_sharding=False),
    "dp2-pp2": dict(splits=[(0, 2, "pool-a"), (2, 4, "pool-b")], optimizer_sharding=False),
    "dp2-pp2-zb": dict(splits=[(0, 2, "pool-a"), (2, 4, "pool-b")], optimizer_sharding=False,
                       schedule="zb-h1"),
    "dp2-pp2-interleaved": dict(splits=[(0, 2, "pool-a"), (2, 4, "pool-b")],
                                optimizer_sharding=False, schedule="interleaved"),
    "dp2-tp2": dict(splits=[(0, 4, "pool-a")], optimizer_sharding=True, tp=2),
    "dp2-zero1": dict(splits=[(0, 4, "pool-a")], optimizer_sharding=True),
    # context parallelism: the gradient group is DP x CP (here 1 x 2)
    "dp1-cp2": dict(splits=[(0, 4, "pool-a")], optimizer_sharding=False, dp=1, cp=2),
    "dp2-bf16": dict(splits=[(0, 4, "pool-a")], optimizer_sharding=False, precision="bf16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_sync_equals_sync_after_backward_and_reference(tmp_path, case):
    kw = dict(CASES[case])
    splits, dp, cp = kw.pop("splits"), kw.pop("dp", 2), kw.pop("cp", 1)
    plan = tiny_plan(splits, dp=dp, steps=STEPS, lr_schedule="constant", **kw)
    if cp > 1:
        plan = with_cp(plan, cp)
    if plan.schedule == "interleaved":  # 2 model chunks of one layer per stage
        plan = replace(plan, virtual_stages=2)
    assert plan.training.overlap_grad_reduce  # the default
    on, on_sum = _run(plan, tmp_path / "on", {"HETTRAIN_DP_BUCKET_MB": BUCKET_MB})
    off_plan = replace(plan, training=replace(plan.training, overlap_grad_reduce=False))
    off, off_sum = _run(off_plan, tmp_path / "off", {})
    # overlapped: every rank cut its stage into several buckets and launched them all during
    # the backward; the plan that says false syncs after the backward
    for s in on_sum:
        ov = s["dp_overlap"]
        assert ov["buckets"] >= 2 and ov["launched_in_backward"] == ov["buckets"], ov
    assert all(s["dp_overlap"] == {} for s in off_sum)
    # two replicas: the same sums, bucket by bucket -> the same bits
    assert on == off
    assert [s["param_checksum"] for s in on_sum] == [s["param_checksum"] for s in off_sum]
    ref = reference_losses(plan, STEPS)
    assert on == pytest.approx(ref, rel=RTOL[plan.training.precision])
    # the DP bytes are the same: per bucket 2(n-1)/n of its bytes, summed
    for a, b in zip(on_sum, off_sum, strict=True):
        assert a["bytes"]["intra_pool"] == b["bytes"]["intra_pool"]
