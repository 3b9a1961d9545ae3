"""bench/plan_quality.py: the fixed case set, the ideal bound, and the quick subset end to end
(ratio <= 1, the report's format, --json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import loss_as_given, plan_job
from hettrain.planning.profiles import apply_profiles, profile_doc, profile_from_doc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import plan_quality as pq  # noqa: E402
from plan_losses import PARTS, breakdown  # noqa: E402


def test_the_case_set_is_fixed_and_within_its_bounds():
    docs = pq.clusters(40)
    assert docs == pq.clusters(40)  # seeded: the same set every run
    assert docs != pq.clusters(40, seed=pq.SEED + 1)
    for doc in docs:
        inv = load_cluster(doc)
        assert pq.MIN_GPUS <= inv.gpus <= pq.MAX_GPUS
        assert 2 <= len({p.device.name for p in inv.pools}) <= 4
        assert 1 <= len(inv.datacenters) <= 3
    assert {len(load_cluster(d).datacenters) for d in docs} == {1, 2, 3}
    assert len(pq.MODELS) >= 3
    assert {pq.job(m).model.seq_len for m in pq.MODELS} >= {32768, 131072}


def test_ideal_bound_is_the_cost_model_rate_of_every_gpu():
    doc = pq.clusters(1)[0]
    inv = load_cluster(doc)
    spec = pq.job("llama3-8b")
    ideal = pq.ideal_tokens_per_s(spec, inv)
    # brute force: one pool at a time, the sum is the cluster's
    parts = [pq.ideal_tokens_per_s(spec, inv.__class__(pools=(p,), links=inv.links,
                                                       devices=inv.devices)) for p in inv.pools]
    assert ideal == pytest.approx(sum(parts))
    plan = plan_job("q", spec, inv)
    assert 0 < plan.predicted.tokens_per_s / ideal <= 1
    # the asymptote is looser still: it charges attention and elementwise terms too
    assert pq.peak_tokens_per_s(spec, inv) > ideal


def test_tokens_per_step_sets_every_jobs_global_batch():
    """The default job takes ~4Mi tokens per step; ``tokens`` scales the global batch (in whole
    sequences, at least one), and a larger batch never plans a slower step per token on the
    same cluster (more sequences per GPU: fewer bubbles and syncs per token)."""
    assert pq.job("llama3-8b").training.global_batch == 4 * 2**20 // 8192 == 512
    assert pq.job("llama3-8b-128k").training.global_batch == 32
    assert pq.job("llama3-8b", tokens=16 * 2**20).training.global_batch == 2048
    assert pq.job("llama3-8b-128k", tokens=2**16).training.global_batch == 1
    inv = load_cluster(pq.clusters(1)[0])
    small = plan_job("q", pq.job("llama3-8b"), inv)
    large = plan_job("q", pq.job("llama3-8b", tokens=16 * 2**20), inv)
    assert large.global_batch == 4 * small.global_batch
    assert large.predicted.tokens_per_s >= small.predicted.tokens_per_s


@pytest.mark.parametrize("value", ["0", "-4", "nan", "inf", "2048", "four"])
def test_tokens_per_step_rejects_a_bad_value(value):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_quality.py"),
                          "--tokens-per-step", value], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 2 and "--tokens-per-step" in out.stderr
    assert "Traceback" not in out.stderr


def test_percentile_is_nearest_rank():
    assert pq.percentile([5, 1, 4, 2, 3], 10) == 1
    assert pq.percentile([float(x) for x in range(1, 21)], 10) == 2
    assert pq.percentile(list(range(1, 11)), 50) == 5


@pytest.mark.slow
def test_quick_subset_runs_and_reports(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, str(ROOT / "bench" / "plan_quality.py"), "--quick", "--cap", "120"]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    cases = doc["cases"]
    assert len(cases) == pq.QUICK_CLUSTERS * len(pq.QUICK_MODELS)
    assert {c["model"] for c in cases} == set(pq.QUICK_MODELS)
    ok = [c for c in cases if c["status"] == "ok"]
    assert ok, cases
    for c in ok:
        assert 0 < c["ratio"] <= 1 and 0 < c["peak"] < c["ratio"]
        assert 0 < c["used"] <= c["gpus"] and c["plan_s"] > 0
    s = doc["summary"]["all"]
    ratios = sorted(c["ratio"] for c in ok)
    assert s["ratio_min"] == ratios[0] and s["ratio_min"] <= s["ratio_p10"] <= s["ratio_median"]
    assert s["gpus_used"] == sum(c["used"] for c in ok)
    assert s["plan_s_max"] >= s["plan_s_median"] > 0
    # the table form: one row per case, then the summary with its columns
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert text.returncode == 0, text.stderr[-2000:]
    lines = text.stdout.splitlines()
    assert lines[0].split()[:6] == ["cluster", "model", "GPUs", "types", "DCs", "ratio"]
    assert sum(1 for ln in lines if ln.strip().startswith(("c0", "c1"))) == len(cases)
    head = next(ln for ln in lines if ln.split()[:2] == ["model", "cases"])
    assert head.split()[3:6] == ["median", "p10", "min"]
    assert any(ln.split()[0] == "all" for ln in lines if ln.strip())


def test_homogeneous_set_is_one_pool_of_each_device_per_size():
    docs = pq.homogeneous_clusters((64, 256))
    assert len(docs) == 2 * len(pq.DEVICES) == len({d["metadata"]["name"] for d in docs})
    invs = [load_cluster(d) for d in docs]
    assert sorted(inv.pools[0].device.name for inv in invs) == sorted(pq.DEVICES * 2)
    for inv in invs:
        assert len(inv.pools) == 1 and len(inv.datacenters) == 1 and inv.gpus in (64, 256)


def test_homogeneous_run_plans_every_device_and_refuses_a_bad_size():
    """--homogeneous 64: one case per catalog device on one pool of 64 GPUs, each within the
    ideal; a size that is no multiple of 8 is refused with exit 2, naming the flag."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, str(ROOT / "bench" / "plan_quality.py"), "--models", "llama3-8b"]
    out = subprocess.run([*cmd, "--homogeneous", "64", "--json"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["homogeneous"] == [64]
    cases = doc["cases"]
    assert len(cases) == len(pq.DEVICES)
    for c in cases:
        assert c["status"] == "ok" and c["gpus"] == 64 and c["device_types"] == 1
        assert c["datacenters"] == 1 and 0 < c["ratio"] <= 1 and c["idle_unexplained"] == 0
    bad = subprocess.run([*cmd, "--homogeneous", "60"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert bad.returncode == 2 and "--homogeneous" in bad.stderr and "multiples of 8" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_compare_plans_every_case_both_ways_in_one_run():
    """--compare: the before (plain) summary from this run's own plain plans, the after
    (replicaGroups) cases never below them (groups are added only when the step gets faster)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, str(ROOT / "bench" / "plan_quality.py"), "--quick", "--cap", "120",
           "--compare"]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    after = doc["summary"]["all"]
    before = doc["before_summary"]["all"]
    assert before["cases"] == after["cases"] == pq.QUICK_CLUSTERS * len(pq.QUICK_MODELS)
    assert after["ratio_median"] >= before["ratio_median"]
    assert after["ratio_min"] >= before["ratio_min"]
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert text.returncode == 0, text.stderr[-2000:]
    assert "plain (before) → spec.parallelism.replicaGroups (after), same run:" in text.stdout


@pytest.mark.parametrize("w_frac", [None, 0.05, 0.6])
def test_loss_breakdown_rebuilds_a_zb_h1_step_with_a_measured_split(w_frac) -> None:
    """A pinned ZB-H1 plan on a device whose profile measured the B/W split (small W: the
    bubble is most of 1F1B's; large W: a tenth): ``plan_losses.breakdown`` rebuilds its step
    from the same divisor (``step_err`` 0), as with the catalog's third."""
    job = {"model": {"layers": 6, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 8000},
           "training": {"globalBatch": 8, "steps": 1, "recompute": "none", "microBatch": 2},
           "parallelism": {"tp": 1, "pp": 2, "dp": 1, "schedule": "zb-h1"},
           "placement": {"pools": ["h"]}}
    spec = parse_job_spec(job)
    rows = [(b, 0.5e-3 * (1 + b), 1e-3 * (1 + b)) for b in (1, 2, 4)]
    split = None if w_frac is None else [((1 - w_frac) * bw, w_frac * bw) for *_, bw in rows]
    doc = profile_doc("H100-SXM", {}, spec.model, rows, precision="bf16", split=split)
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "t"}, "datacenters": [{"name": "a"}],
               "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 1,
                          "gpusPerNode": 4, "nicGbps": 400}]}
    inv = apply_profiles(load_cluster(cluster), [profile_from_doc(doc, "p")])
    plan = plan_job("j", spec, inv)
    assert plan.schedule == "zb-h1" and plan.pp == 2
    assert breakdown(spec, inv, plan)["step_err"] == pytest.approx(0.0, abs=1e-12)


def test_loss_breakdown_counts_attention_free_recompute() -> None:
    """llama3-8b at 128k tokens on 8 H100s at cp 2, ``recompute: auto``: the plan recomputes
    attention-free; the breakdown rebuilds its step (``step_err`` 0) and charges the re-run
    forward as 'recompute' (the ideal recomputes nothing), while a job that asks for
    attention-free pays it in the ideal instead (all but the chunked loss's re-run head; at
    cp 2 a rank's 64k tokens chunk the loss, at the faster cp 4 they do not)."""
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "t"}, "datacenters": [{"name": "a"}],
               "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 1,
                          "gpusPerNode": 8, "nicGbps": 400}]}
    inv = load_cluster(cluster)
    parts = {}
    for mode in ("auto", "attention-free"):
        spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 131072},
                               "training": {"globalBatch": 8, "steps": 1, "recompute": mode,
                                            "optimizerSharding": True},
                               "parallelism": {"cp": 2}})
        plan = plan_job("j", spec, inv)
        assert plan.training.recompute == "attention-free"
        parts[mode] = breakdown(spec, inv, plan)
        assert parts[mode]["step_err"] == pytest.approx(0.0, abs=1e-9)
    assert parts["auto"]["recompute"] > 0.05 and parts["auto"]["recompute in ideal"] == 0.0
    # beyond the job's mode only the chunked loss's recomputed logits (one head forward GEMM
    # on the last stage; 128k tokens: the plan chunks the loss) ...
    assert plan.training.loss_chunk_tokens > 0
    assert 0.0 < parts["attention-free"]["recompute"] < 0.01
    assert parts["attention-free"]["recompute in ideal"] > 0.05
    # ... and with the whole-sequence loss nothing at all
    with loss_as_given():
        whole = plan_job("j", spec, inv)
    assert whole.training.loss_chunk_tokens == 0
    assert breakdown(spec, inv, whole)["recompute"] == pytest.approx(0.0, abs=1e-12)


def test_loss_breakdown_rebuilds_a_helix_plan() -> None:
    """A ``schedule: helix`` plan (llama3-8b at 8k, pp 4 on 4×8 H100): the breakdown prices
    its pipeline with the helix order (which needs the model: it raised before) and rebuilds
    the plan's step exactly, its parts adding up to the gap."""
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "t"}, "datacenters": [{"name": "a"}],
               "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 4,
                          "gpusPerNode": 8, "nicGbps": 3200}]}
    inv = load_cluster(cluster)
    spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 8192},
                           "training": {"globalBatch": 64, "steps": 1},
                           "parallelism": {"schedule": "helix", "pp": 4}})
    plan = plan_job("j", spec, inv)
    assert plan.schedule == "helix" and plan.helix_hop > 0
    parts = breakdown(spec, inv, plan)
    assert parts["step_err"] == pytest.approx(0.0, abs=1e-9)
    assert parts["bubble"] > 0
    assert sum(parts[k] for k in PARTS) == pytest.approx(parts["gap"], abs=1e-9)


def test_unpriced_crossings_counts_hops_placed_across_a_link():
    """0 on the planner's plan (three stages over two datacenters: one hop across the link,
    priced so, and one inside a datacenter); moving one replica of the stage after the
    inside hop to the other datacenter counts that replica's hop."""
    from dataclasses import replace as dc_replace

    doc = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "m"},
           "datacenters": [{"name": "a"}, {"name": "b"}],
           "links": [{"between": ["a", "b"], "bandwidthGbps": 800, "latencyMs": 5}],
           "pools": [{"name": f"h{dc}", "datacenter": dc, "device": "H100-SXM", "nodes": 4,
                      "gpusPerNode": 8, "nicGbps": 3200} for dc in "ab"]}
    inv = load_cluster(doc)
    spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 4096},
                           "training": {"globalBatch": 64, "steps": 1},
                           "parallelism": {"tp": 8, "pp": 3}})
    plan = plan_job("q", spec, inv)
    assert pq.unpriced_crossings(plan, inv) == 0
    pools = [st.pools[0] for st in plan.stages]
    (hop,) = [i for i in range(2) if pools[i] == pools[i + 1]]  # the hop priced inside
    other = "b" if inv.pool(pools[hop]).datacenter == "a" else "a"
    moved = tuple(dc_replace(r, datacenter=other) if (r.stage, r.dp) == (hop + 1, 0) else r
                  for r in plan.ranks)
    assert pq.unpriced_crossings(dc_replace(plan, ranks=moved), inv) == 1
