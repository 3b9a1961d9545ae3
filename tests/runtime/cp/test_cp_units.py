"""Context parallelism, pure parts: shard positions, the communicator view, the plan checks and
the plan JSON (cp fields left out at their defaults)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.runtime.cp.plans import cp_plan
from tests.runtime.training.plans import tiny_plan

from hettrain.planning.plan import Plan
from hettrain.planning.support import unsupported
from hettrain.runtime.context_parallel import attention_flops_share, comm_view, shard_positions


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_cover_every_position_once_and_balance_causal_work(cp):
    seq = 8 * cp * 2
    got = sorted(p for c in range(cp) for p in shard_positions(seq, cp, c).tolist())
    assert got == list(range(seq))
    # brute force: query-key pairs under the causal mask, per rank
    pairs = [sum(q + 1 for q in shard_positions(seq, cp, c).tolist()) for c in range(cp)]
    assert max(pairs) - min(pairs) == 0  # chunk c pairs with chunk 2cp-1-c: equal work
    shares = [attention_flops_share(cp, c) for c in range(cp)]
    assert sum(shares) == pytest.approx(1.0)
    assert all(s == pytest.approx(1 / cp) for s in shares)


def test_seq_len_must_split_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match=r"plan.model.seq_len=30 must be a multiple of 2·cp=4"):
        shard_positions(30, 2, 0)


def test_comm_view_renumbers_dp_cp_pairs_as_replicas():
    plan = cp_plan([(0, 2, "a"), (2, 4, "b")], dp=2, cp=2, tp=2)
    view = comm_view(plan)
    assert view.dp == 4 and all(s.cp == 1 for s in view.stages)
    for r, v in zip(plan.ranks, view.ranks, strict=True):
        assert (v.stage, v.tp, v.dp, v.cp) == (r.stage, r.tp, r.dp * 2 + r.cp, 0)
    assert comm_view(tiny_plan([(0, 4, "a")], dp=2)).dp == 2


def test_plan_json_keeps_old_form_without_cp_and_round_trips_with_it():
    old = tiny_plan([(0, 4, "a")], dp=1)
    d = json.loads(old.to_json())
    assert "cp" not in d["stages"][0] and "cp" not in d["ranks"][0]
    new = cp_plan([(0, 4, "a")], dp=1, cp=2)
    back = Plan.from_json(new.to_json())
    assert back == new and [r.cp for r in back.ranks] == [0, 1]
    assert back.fingerprint() != old.fingerprint()


def test_bad_cp_plans_are_refused_naming_the_field():
    assert unsupported(cp_plan([(0, 2, "a"), (2, 4, "b")], dp=1, cp=2)) == []
    odd = cp_plan([(0, 4, "a")], dp=1, cp=3)  # seq_len 32
    assert "2·cp=6" in unsupported(odd)[0]
    plan = cp_plan([(0, 2, "a"), (2, 4, "b")], dp=1, cp=2)
    mixed = dataclasses.replace(plan, stages=(plan.stages[0],
                                              dataclasses.replace(plan.stages[1], cp=1)))
    assert "plan.stages[].cp=[1, 2]" in unsupported(mixed)[0]
    missing = dataclasses.replace(plan, ranks=plan.ranks[:-1])
    assert "plan.ranks: with cp=2" in unsupported(missing)[0]
    stray = tiny_plan([(0, 4, "a")], dp=2)
    stray = dataclasses.replace(stray, ranks=(stray.ranks[0],
                                              dataclasses.replace(stray.ranks[1], cp=1)))
    assert "plan.ranks[].cp" in unsupported(stray)[0]


def test_runtime_refuses_a_bad_cp_plan_in_one_line(tmp_path):
    plan = cp_plan([(0, 4, "a")], dp=1, cp=3)  # seq_len 32 is not a multiple of 6
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "HETTRAIN_PLAN_PATH": str(path), "WORLD_SIZE": str(plan.world_size),
           "PYTHONPATH": f"{root / 'operator'}{os.pathsep}{root}"}
    out = subprocess.run([sys.executable, "-m", "hettrain.runtime"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: plan.stages[].cp=3: plan.model.seq_len=32 must be a multiple of 2·cp=6 "
        "(two load-balanced chunks per CP rank)"]
