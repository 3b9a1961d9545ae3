"""Plan quality: each plan's predicted throughput as a fraction of the ideal bound.

The ideal bound of a job on a cluster is every GPU of the cluster busy at its efficiency: no
pipeline bubble, no communication, no memory limit. It is computed from the same cost model
functions the planner uses (``planning/cost.py``): a GPU's best tokens per second is
``b·seq / (layers·layer_compute_s(model, b, tp=1, device, recompute) + head_time_s(...))`` with
``b`` the whole global batch as one microbatch (the fixed per-kernel time amortised as far as
it can be), the job's recompute mode (a user choice; ``auto``: none) and a device's measured
profile where it matches; the ideal is the sum over every GPU of the cluster. A plan's
``ratio`` is ``plan.predicted.tokens_per_s / ideal``: at most 1 (checked on every case; more
would be a cost model inconsistency, as would a pipeline hop priced inside a datacenter that
the plan's placement puts across a link: :func:`unpriced_crossings`, also checked), lower for
the bubble, exposed TP/PP/DP communication, smaller microbatches, TP's per-GPU overheads and
GPUs the plan leaves idle: what a better layout can recover. ``peak`` is the same throughput
against the efficiency asymptote (``min_seconds_per_flop`` × the MFU FLOPs per token), which
also charges the attention and elementwise terms the cost model puts on every plan.

Cases: a FIXED seeded set of generated heterogeneous clusters (48–1016 GPUs, 2–4 device types
from the catalog, 1–3 datacenters; :func:`clusters`) × models (llama3-8b, llama3-70b, and
llama3-8b at 32k and 128k tokens; about 4M tokens per step each, ``--tokens-per-step`` to
change it). Each plan runs in a planning worker with a wall-clock cap
(``hettrain.planguard``, the operator's own mechanism): a plan over the cap is reported as
``timeout`` (and counted), never waited for.

Printed: one line per case (ratio, GPUs used/available, idle and partly idle pools, layout,
planning seconds), then per model and overall the median, p10 and min ratio, GPUs used, idle
pools and the planning time (median, max). ``--json`` prints one JSON document instead.

Usage: python bench/plan_quality.py [--clusters 40] [--models all] [--cap 60] [--json]
       python bench/plan_quality.py --quick        # 4 small clusters x 2 models (CI)
       python bench/plan_quality.py --replica-groups   # with spec.parallelism.replicaGroups
       python bench/plan_quality.py --compare   # plain and replicaGroups, side by side
       python bench/plan_quality.py --recompute auto   # the planner picks the recompute mode
       python bench/plan_quality.py --tokens-per-step 16   # 16Mi tokens per step (batch x4)
       python bench/plan_quality.py --homogeneous   # one device, one datacenter (reference)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hettrain.api.spec import RECOMPUTE_SPEC_MODES, JobSpec, parse_job_spec
from hettrain.planguard import Budget, PlanBudgetError, PlanWorkers
from hettrain.planning.catalog import CATALOG
from hettrain.planning.cost import (
    min_seconds_per_flop,
    model_flops_per_step,
)
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import ClusterInventory, load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.units import build_units
from plan_losses import PARTS, breakdown, device_rate

SEED = 17
TOKENS_PER_STEP = 4 * 2**20  # ~4M tokens per optimizer step (Llama 3 8B/70B pre-training)
MIN_GPUS, MAX_GPUS = 48, 1016
DEVICES = sorted(n for n, d in CATALOG.items() if d.vendor != "cpu")
# name -> (preset, sequence length)
MODELS = {"llama3-8b": ("llama3-8b", 8192), "llama3-70b": ("llama3-70b", 8192),
          "llama3-8b-32k": ("llama3-8b", 32768), "llama3-8b-128k": ("llama3-8b", 131072)}
QUICK_MODELS = ("llama3-8b", "llama3-8b-32k")
QUICK_CLUSTERS = 4
QUICK_MAX_GPUS = 256
DEFAULT_RECOMPUTE = "selective"  # the jobs' spec.training.recompute (--recompute)


# ---------------------------------------------------------------- cases


def clusters(count: int, seed: int = SEED, max_gpus: int = MAX_GPUS) -> list[dict]:
    """``count`` cluster documents (the cluster YAML form), the same for the same seed: 2–4
    catalog device types, one or two pools each, 1–3 datacenters, 48..``max_gpus`` GPUs."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        dcs = [f"dc{k}" for k in range(rng.randint(1, 3))]
        types = rng.sample(DEVICES, rng.randint(2, 4))
        specs = []  # (device, datacenter, gpus per node, weight)
        for dev in types:
            for _ in range(rng.choice((1, 1, 2))):
                specs.append((dev, rng.choice(dcs), rng.choice((8, 8, 8, 4)), rng.random() + .2))
        target = rng.randint(MIN_GPUS, max_gpus)
        total_w = sum(s[3] for s in specs)
        pools = []
        for k, (dev, dc, gpn, w) in enumerate(specs):
            nodes = max(1, round(target * w / total_w / gpn))
            pools.append({"name": f"p{k}-{dev.lower()}", "datacenter": dc, "device": dev,
                          "nodes": nodes, "gpusPerNode": gpn,
                          "nicGbps": rng.choice((400, 800, 1600, 3200))})
        _fit(pools, max_gpus)
        used = sorted({p["datacenter"] for p in pools})
        links = [{"between": [a, b], "bandwidthGbps": rng.choice((100, 200, 400, 800)),
                  "latencyMs": rng.choice((5, 10, 30, 60))}
                 for j, a in enumerate(used) for b in used[j + 1:]]
        out.append({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                    "metadata": {"name": f"c{i:02d}"}, "datacenters": [{"name": d} for d in used],
                    "links": links, "pools": pools})
    return out


HOMOGENEOUS_SIZES = (64, 256, 1024)
HOMOGENEOUS_NIC_GBPS = 3200  # 8 x 400 Gb/s per 8-GPU node


def homogeneous_clusters(sizes: tuple[int, ...] = HOMOGENEOUS_SIZES) -> list[dict]:
    """One cluster per catalog device and size: a single pool of 8-GPU nodes in one
    datacenter (``--homogeneous``). What the same jobs reach there, against the same ideal,
    tells how much of the generated set's gap is mixed devices, pool sizes and datacenter
    links rather than the cost model of one device."""
    out = []
    for dev in DEVICES:
        for gpus in sizes:
            out.append({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                        "metadata": {"name": f"{dev.lower()}-x{gpus}"},
                        "datacenters": [{"name": "dc0"}], "links": [],
                        "pools": [{"name": f"p0-{dev.lower()}", "datacenter": "dc0",
                                   "device": dev, "nodes": gpus // 8, "gpusPerNode": 8,
                                   "nicGbps": HOMOGENEOUS_NIC_GBPS}]})
    return out


def _sizes(text: str) -> tuple[int, ...]:
    """``--homogeneous``'s comma-separated GPU counts (multiples of 8)."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 8 or n % 8 or n > 65536 for n in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give GPU counts that are multiples of 8 up to 65536, e.g. 64,256,1024")
    return sizes


def _fit(pools: list[dict], max_gpus: int) -> None:
    """Grow or shrink node counts (largest pool first) until MIN_GPUS <= GPUs <= max_gpus."""
    def gpus() -> int:
        return sum(p["nodes"] * p["gpusPerNode"] for p in pools)
    while gpus() > max_gpus:
        big = max((p for p in pools if p["nodes"] > 1), key=lambda p: p["nodes"])
        big["nodes"] -= 1
    while gpus() < MIN_GPUS:
        min(pools, key=lambda p: p["nodes"])["nodes"] += 1


def job(model: str, replica_groups: bool = False, recompute: str = DEFAULT_RECOMPUTE,
        tokens: int = TOKENS_PER_STEP) -> JobSpec:
    """The job of one model case: bf16, ZeRO-1, ``recompute`` (default selective), ``tokens``
    per step (default ~4M; the global batch is ``tokens // seqLen`` sequences, at least one;
    ``replica_groups``: spec.parallelism.replicaGroups)."""
    preset, seq = MODELS[model]
    return parse_job_spec({"model": {"preset": preset, "seqLen": seq},
                           "training": {"globalBatch": max(1, tokens // seq),
                                        "steps": 1, "recompute": recompute},
                           "parallelism": {"replicaGroups": replica_groups}})


# ---------------------------------------------------------------- measures


def ideal_tokens_per_s(spec: JobSpec, inv: ClusterInventory) -> float:
    """Every GPU busy computing at the cost model's best rate (see the module docstring):
    each at its device's ``plan_losses.device_rate``, the rate the loss breakdown charges."""
    return sum(p.gpus * device_rate(spec, p.device)[0] for p in inv.pools)


def peak_tokens_per_s(spec: JobSpec, inv: ClusterInventory) -> float:
    """Every GPU at its efficiency asymptote on the MFU FLOPs (``min_seconds_per_flop``)."""
    flops_per_token = model_flops_per_step(spec.model, 1) / spec.model.seq_len
    return sum(p.gpus / (min_seconds_per_flop(p.device, spec.model) * flops_per_token)
               for p in inv.pools)


def timed_plan(name: str, spec: JobSpec, inv: ClusterInventory, previous: Plan | None
               ) -> tuple[Plan, float, float]:
    """``plan_job``, its wall seconds and its process CPU seconds, measured inside the
    planning worker (CPU time is what other load on a shared host inflates least)."""
    from hettrain.planning.planner import plan_job

    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_job(name, spec, inv, previous=previous)
    return plan, time.perf_counter() - t0, time.process_time() - c0


@dataclass
class Case:
    """One (cluster, model) result."""

    cluster: str
    model: str
    gpus: int
    device_types: int
    datacenters: int
    status: str  # ok | no plan | timeout | memory (over the worker's budget) | error
    ratio: float = math.nan  # predicted tokens/s / ideal
    peak: float = math.nan  # predicted tokens/s / efficiency asymptote
    used: int = 0
    idle_pools: int = 0
    idle_unexplained: int = 0  # wholly idle pools no plan note names with "idle"
    idle_notes: tuple[str, ...] = ()  # the plan's "pool NAME idle: WHY" notes
    partly_idle_pools: int = 0
    plan_s: float = math.nan
    plan_cpu_s: float = math.nan
    layout: str = ""
    detail: str = ""
    losses: dict[str, float] = field(default_factory=dict)  # plan_losses.breakdown
    unpriced_hops: int = 0  # unpriced_crossings: 0 for a plan placed as priced


def run_case(workers: PlanWorkers, doc: dict, model: str, replica_groups: bool = False,
             recompute: str = DEFAULT_RECOMPUTE, tokens: int = TOKENS_PER_STEP) -> Case:
    """Plan one case in a worker (capped) and measure it."""
    inv = load_cluster(doc)
    spec = job(model, replica_groups, recompute, tokens)
    case = Case(doc["metadata"]["name"], model, inv.gpus, len({p.device.name for p in inv.pools}),
                len(inv.datacenters), "ok")
    t0 = time.perf_counter()
    try:
        plan, case.plan_s, case.plan_cpu_s = workers.plan((case.cluster, model), "q", spec,
                                                          inv, None)
    except PlanBudgetError as err:
        case.status = "timeout" if "longer than" in err.message else "memory"
        case.plan_s, case.detail = time.perf_counter() - t0, err.message
        return case
    except PlanningError as err:
        case.status, case.plan_s, case.detail = "no plan", time.perf_counter() - t0, err.message
        return case
    except RuntimeError as err:  # a planner bug reported by the worker
        case.status, case.detail = "error", str(err)
        return case
    case.ratio = plan.predicted.tokens_per_s / ideal_tokens_per_s(spec, inv)
    case.peak = plan.predicted.tokens_per_s / peak_tokens_per_s(spec, inv)
    case.used = plan.world_size
    case.losses = breakdown(spec, inv, plan)
    case.unpriced_hops = unpriced_crossings(plan, inv)
    per_pool: dict[str, int] = {}
    for r in plan.ranks:
        per_pool[r.pool] = per_pool.get(r.pool, 0) + 1
    idle = [p.name for p in inv.pools if p.name not in per_pool]
    case.idle_pools = len(idle)
    case.idle_unexplained = sum(1 for name in idle if not explained(name, plan.notes))
    case.idle_notes = tuple(n for n in plan.notes if n.startswith("pool ") and " idle: " in n)
    case.partly_idle_pools = sum(1 for p in inv.pools if 0 < per_pool.get(p.name, 0) < p.gpus)
    tps = "/".join(str(s.tp) for s in plan.stages)
    cp = plan.stages[0].cp
    case.layout = (f"dp={plan.dp} pp={plan.pp} tp={tps} " + (f"cp={cp} " if cp > 1 else "")
                   + f"mb={plan.micro_batch} "
                   f"m={plan.num_microbatches} {plan.schedule}")
    for g in plan.groups[1:]:
        gcp = g.stages[0].cp
        case.layout += (f" + group {g.index}: dp={g.dp} pp={g.pp} tp={g.stages[0].tp} "
                        + (f"cp={gcp} " if gcp > 1 else "") + f"m={g.num_microbatches}")
    return case


def unpriced_crossings(plan: Plan, inv: ClusterInventory) -> int:
    """Replica hops of ``plan``'s pipelines that the planner prices inside a datacenter (the
    two stages' units share one: ``planner._boundary_s``) but whose placed ranks sit in two
    datacenters: 0 for a plan placed as priced (checked on every case). Group 0's units are
    its grouping's (``merged``: a device's pools of every datacenter as one); an extra
    replica group's stages each sit on one pool."""
    merged = plan.cross_dc.get("grouping") == "merged"
    span = {p.name: u.datacenters for u in build_units(inv.pools, merged) for p in u.pools}
    where: dict[tuple[int, int, int, int], str] = {}
    for r in plan.ranks:
        where[(r.group, r.stage, r.dp, r.cp)] = r.datacenter
    count = 0
    for g, stages in enumerate([plan.stages] + [grp.stages for grp in plan.groups[1:]]):
        for s in range(len(stages) - 1):
            a, b = stages[s].pools[0], stages[s + 1].pools[0]
            dcs_a = span[a] if g == 0 else (inv.pool(a).datacenter,)
            dcs_b = span[b] if g == 0 else (inv.pool(b).datacenter,)
            if not set(dcs_a) & set(dcs_b):
                continue  # priced across the link
            count += sum(1 for (gg, st, d, c), dc in where.items()
                         if gg == g and st == s and where.get((g, s + 1, d, c), dc) != dc)
    return count


def explained(pool: str, notes: tuple[str, ...]) -> bool:
    """Whether some plan note says why ``pool`` is idle: it names the pool and says "idle"
    (the planner's ``pool NAME idle: WHY``, replicaGroups' "idle nodes of pool(s) ...")."""
    return any(pool in n and "idle" in n for n in notes)


IDLE_KINDS = (("excluded by spec.placement", "placement"), ("device group", "group used"),
              ("does not fit", "memory"), ("maxGPUs", "maxGPUs"),
              ("cannot host a stage", "few GPUs"), ("is the slowest step", "link"),
              ("slower with it", "slower"), ("faster with it", "faster"))


def idle_reason_kind(note: str) -> str:
    """The kind of one ``pool NAME idle: WHY`` note (``planning/idle_pools.py``)."""
    return next((kind for text, kind in IDLE_KINDS if text in note), "other")


# ---------------------------------------------------------------- summary


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values`` (nan when empty)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summarise(cases: list[Case]) -> dict:
    """Median, p10 and min ratio, GPU use, idle pools, planning time over ``cases``."""
    ok = [c for c in cases if c.status == "ok"]
    ratios = [c.ratio for c in ok]
    times = [c.plan_s for c in cases if not math.isnan(c.plan_s)]
    return {"cases": len(cases), "planned": len(ok),
            "no_plan": sum(c.status == "no plan" for c in cases),
            "timeout": sum(c.status == "timeout" for c in cases),
            "error": sum(c.status == "error" for c in cases),
            "ratio_median": statistics.median(ratios) if ratios else math.nan,
            "ratio_p10": percentile(ratios, 10), "ratio_min": min(ratios, default=math.nan),
            "peak_median": statistics.median(c.peak for c in ok) if ok else math.nan,
            "gpus_used": sum(c.used for c in ok), "gpus_available": sum(c.gpus for c in ok),
            "plans_with_idle_pool": sum(c.idle_pools > 0 for c in ok),
            "plans_with_unexplained_idle_pool": sum(c.idle_unexplained > 0 for c in ok),
            "idle_reasons": dict(sorted(Counter(idle_reason_kind(n) for c in ok
                                                for n in c.idle_notes).items())),
            "plans_with_partly_idle_pool": sum(c.partly_idle_pools > 0 for c in ok),
            "plan_s_median": statistics.median(times) if times else math.nan,
            "plan_s_max": max(times, default=math.nan),
            "plan_cpu_s_median": statistics.median(c.plan_cpu_s for c in ok) if ok else math.nan,
            "loss_median": {k: statistics.median(c.losses[k] for c in ok) for k in LOSS_KEYS}
            if ok else {},
            "loss_mean": {k: statistics.fmean(c.losses[k] for c in ok) for k in LOSS_KEYS}
            if ok else {}}


# plan_losses.breakdown: the gap, its parts (ratio units) and, not a part, the share of the
# ideal's own time it spends on the job's recompute (the ideal pays it, so 'recompute' is the
# plan's recompute beyond the job's mode)
LOSS_KEYS = ("gap", *PARTS, "recompute in ideal")


def print_breakdown(cases: list[Case], summary: dict[str, dict], per_case: bool) -> None:
    """The gap to the ideal split into its parts (``bench/plan_losses.py``), in points of the
    ideal: per model and overall the median of each part over the plans and (``mean``) the
    mean, whose parts add up to the mean gap; with ``per_case`` one line per plan too."""
    head = " ".join(f"{k[:9]:>9}" for k in LOSS_KEYS)
    print()
    print("gap = 1 - ratio, split into parts (points of the ideal; bench/plan_losses.py); "
          "'rest' = gap - sum of parts; 'recompute' = beyond the job's mode, which the ideal "
          "pays too ('recompute in ideal', not a part)")
    if per_case:
        w = _cluster_width(cases)
        print(f"{'cluster':>{w}} {'model':>15} {head}")
        for c in cases:
            if c.status == "ok":
                print(f"{c.cluster:>{w}} {c.model:>15} "
                      + " ".join(f"{c.losses[k]:>9.4f}" for k in LOSS_KEYS))
    print(f"{'model':>15} {'stat':>6} {head}")
    for name, s in summary.items():
        for stat in ("median", "mean"):
            row = s[f"loss_{stat}"]
            if row:
                print(f"{name:>15} {stat:>6} " + " ".join(f"{row[k]:>9.4f}" for k in LOSS_KEYS))


def _cluster_width(cases: list[Case]) -> int:
    """The cluster column's width: the longest name (``--homogeneous``'s are long), at least 7."""
    return max([7, *(len(c.cluster) for c in cases)])


def _fmt(x: float, spec: str) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def print_table(cases: list[Case], summary: dict[str, dict], cap: float) -> None:
    """The human-readable report."""
    w = _cluster_width(cases)
    print(f"{'cluster':>{w}} {'model':>15} {'GPUs':>5} {'types':>5} {'DCs':>3} {'ratio':>6} "
          f"{'peak':>5} {'used':>5} {'idle':>4} {'nowhy':>5} {'part':>4} {'plan s':>7}  "
          "layout / status")
    for c in cases:
        tail = c.layout if c.status == "ok" else f"{c.status}: {c.detail[:90]}"
        print(f"{c.cluster:>{w}} {c.model:>15} {c.gpus:>5} {c.device_types:>5} "
              f"{c.datacenters:>3} {_fmt(c.ratio, '.3f'):>6} {_fmt(c.peak, '.2f'):>5} "
              f"{c.used:>5} {c.idle_pools:>4} {c.idle_unexplained:>5} {c.partly_idle_pools:>4} "
              f"{_fmt(c.plan_s, '.2f'):>7}  {tail}")
    print()
    print(f"ratio = predicted tokens/s / ideal (every GPU computing at the cost model's best "
          f"rate, no bubble, no communication); peak = vs the efficiency asymptote; plan cap "
          f"{cap:g}s; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs")
    print(f"{'model':>15} {'cases':>5} {'ok':>4} {'median':>7} {'p10':>6} {'min':>6} "
          f"{'peak':>5} {'GPUs used':>13} {'idle':>5} {'nowhy':>5} {'part':>5} "
          f"{'plan s med':>10} {'max':>7} "
          f"{'cpu med':>7} "
          f"{'no plan':>7} {'timeout':>7}")
    for name, s in summary.items():
        used = f"{s['gpus_used']}/{s['gpus_available']}"
        print(f"{name:>15} {s['cases']:>5} {s['planned']:>4} {_fmt(s['ratio_median'], '.3f'):>7} "
              f"{_fmt(s['ratio_p10'], '.3f'):>6} {_fmt(s['ratio_min'], '.3f'):>6} "
              f"{_fmt(s['peak_median'], '.2f'):>5} {used:>13} "
              f"{s['plans_with_idle_pool']:>5} {s['plans_with_unexplained_idle_pool']:>5} "
              f"{s['plans_with_partly_idle_pool']:>5} "
              f"{_fmt(s['plan_s_median'], '.2f'):>10} {_fmt(s['plan_s_max'], '.2f'):>7} "
              f"{_fmt(s['plan_cpu_s_median'], '.2f'):>7} "
              f"{s['no_plan']:>7} {s['timeout']:>7}")
    print("idle = plans leaving a pool wholly idle, nowhy = of those, with a pool no plan note "
          "explains; part = plans using a pool partly. Idle-pool notes by kind: "
          + "; ".join(f"{name}: " + (", ".join(f"{k} {n}" for k, n in s["idle_reasons"].items())
                                     or "none") for name, s in summary.items()))


def print_comparison(before: list[Case], after: list[Case], models: list[str]) -> None:
    """Per model and overall: median, p10 and min ratio, idle pools and planning CPU time,
    plain (before) → with replica groups (after), and how many plans got faster / slower."""
    print(f"{'model':>15} {'median':>15} {'p10':>15} {'min':>15} {'idle':>9} {'part':>9} "
          f"{'plan cpu s':>12} {'faster':>7} {'slower':>7}")
    for name in [*models, "all"]:
        pairs = [(b, a) for b, a in zip(before, after, strict=True)
                 if name == "all" or a.model == name]
        sb, sa = summarise([b for b, _ in pairs]), summarise([a for _, a in pairs])
        both = [(b.ratio, a.ratio) for b, a in pairs if b.status == a.status == "ok"]

        def arrow(key: str, spec: str = ".3f", sb: dict = sb, sa: dict = sa) -> str:
            return f"{_fmt(sb[key], spec)}→{_fmt(sa[key], spec)}"

        print(f"{name:>15} {arrow('ratio_median'):>15} {arrow('ratio_p10'):>15} "
              f"{arrow('ratio_min'):>15} {arrow('plans_with_idle_pool', 'd'):>9} "
              f"{arrow('plans_with_partly_idle_pool', 'd'):>9} "
              f"{arrow('plan_cpu_s_median', '.2f'):>12} "
              f"{sum(a > b * (1 + 1e-9) for b, a in both):>7} "
              f"{sum(a < b * (1 - 1e-9) for b, a in both):>7}")


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print the report (or ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", type=int, default=40, help="generated clusters (default 40)")
    ap.add_argument("--models", default="all",
                    help=f"comma-separated subset of {', '.join(MODELS)} (default all)")
    ap.add_argument("--seed", type=int, default=SEED, help="cluster generator seed (fixed set)")
    ap.add_argument("--cap", type=float, default=60.0,
                    help="wall-clock cap per plan in seconds (a plan over it is a 'timeout')")
    ap.add_argument("--quick", action="store_true",
                    help=f"CI subset: {QUICK_CLUSTERS} clusters of <= {QUICK_MAX_GPUS} GPUs x "
                         f"{', '.join(QUICK_MODELS)}")
    ap.add_argument("--workers", type=int, default=1,
                    help="planning worker processes run side by side (default 1; more skews "
                         "the planning times on a host with fewer free cores)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print each plan's gap to the ideal split into its parts "
                         "(the per-model medians are always printed)")
    ap.add_argument("--compare", action="store_true",
                    help="plan every case twice in this run, plain (before) and with "
                         "spec.parallelism.replicaGroups (after), and print both summaries "
                         "side by side")
    ap.add_argument("--replica-groups", action="store_true",
                    help="plan with spec.parallelism.replicaGroups: true (an extra replica "
                         "group on idle nodes of another pool)")
    ap.add_argument("--recompute", default=DEFAULT_RECOMPUTE, choices=RECOMPUTE_SPEC_MODES,
                    help="the jobs' spec.training.recompute (default selective; auto: the "
                         "planner picks the fastest mode that fits, the ideal pays none)")
    ap.add_argument("--tokens-per-step", type=float, default=TOKENS_PER_STEP / 2**20,
                    metavar="MTOKENS",
                    help="tokens per optimizer step of every job, in Mi tokens (default 4: "
                         "the global batch is this over the sequence length); a larger batch "
                         "gives each GPU more sequences per step, so shows how much of the "
                         "gap to the ideal the batch size, not the layout, sets")
    ap.add_argument("--homogeneous", nargs="?", type=_sizes, metavar="SIZES",
                    const=HOMOGENEOUS_SIZES,
                    help="instead of the generated clusters, one single-pool cluster per "
                         "catalog device at each size (default "
                         f"{','.join(map(str, HOMOGENEOUS_SIZES))} GPUs; one datacenter): "
                         "the reference the heterogeneous set is read against")
    args = ap.parse_args(argv)
    if args.compare:
        args.replica_groups = True  # the full report is the after one
    if args.clusters < 1 or args.workers < 1 or not args.cap > 0:
        ap.error("--clusters and --workers must be >= 1 and --cap > 0")
    if not (math.isfinite(args.tokens_per_step) and 0 < args.tokens_per_step <= 1024):
        ap.error("--tokens-per-step must be a number of Mi tokens in (0, 1024], e.g. 4 or 16")
    tokens = max(1, int(args.tokens_per_step * 2**20))
    models = list(MODELS) if args.models == "all" else args.models.split(",")
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"--models: unknown {bad}; use {', '.join(MODELS)}")
    docs = clusters(args.clusters, args.seed)
    if args.quick:
        docs = clusters(QUICK_CLUSTERS, args.seed, max_gpus=QUICK_MAX_GPUS)
        models = list(QUICK_MODELS)
    if args.homogeneous:
        docs = homogeneous_clusters(args.homogeneous)
    workers = PlanWorkers(Budget(timeout_s=args.cap, memory_mb=4096, workers=args.workers),
                          plan_fn=timed_plan)

    def one(doc_model: tuple[dict, str], groups: bool = args.replica_groups) -> Case:
        case = run_case(workers, *doc_model, replica_groups=groups, recompute=args.recompute,
                        tokens=tokens)
        if not args.json:
            print(f"  {case.cluster} {case.model}: {case.status} {_fmt(case.ratio, '.3f')} "
                  f"{_fmt(case.plan_s, '.1f')}s", file=sys.stderr, flush=True)
        return case

    todo = [(d, m) for d in docs for m in models]
    try:
        with ThreadPoolExecutor(args.workers) as pool:  # results in case order
            cases = list(pool.map(one, todo))
            before = (list(pool.map(lambda dm: one(dm, False), todo)) if args.compare
                      else None)
    finally:
        workers.close()
    summary = {m: summarise([c for c in cases if c.model == m]) for m in models}
    summary["all"] = summarise(cases)
    over = [c for c in cases if c.status == "ok" and c.ratio > 1 + 1e-9]
    if args.json:
        print(json.dumps({"seed": args.seed, "cap_s": args.cap, "quick": args.quick,
                          "homogeneous": list(args.homogeneous or ()),
                          "recompute": args.recompute, "tokens_per_step": tokens,
                          "cases": [_jsonable(vars(c)) for c in cases],
                          "summary": {k: _jsonable(v) for k, v in summary.items()},
                          **({"before_summary": {
                              k: _jsonable(summarise([c for c in before
                                                      if k == "all" or c.model == k]))
                              for k in summary}} if before is not None else {})},
                         allow_nan=False))
    else:
        print_table(cases, summary, args.cap)
        print_breakdown(cases, summary, args.breakdown)
        if before is not None:  # cases: with replica groups (after); before: plain
            print("\nplain (before) → spec.parallelism.replicaGroups (after), same run:")
            print_comparison(before, cases, models)
    off = [c for c in cases if c.status == "ok"
           and max(abs(c.losses["rest"]), abs(c.losses["step_err"])) > 1e-9]
    if off:
        print(f"error: {len(off)} breakdowns do not add up to the gap: "
              + ", ".join(f"{c.cluster}/{c.model} rest {c.losses['rest']:.2e} step "
                          f"{c.losses['step_err']:.2e}" for c in off), file=sys.stderr)
        return 1
    crossing = [c for c in cases if c.unpriced_hops]
    if crossing:
        print(f"error: {len(crossing)} plans place a hop priced inside a datacenter across a "
              "link: " + ", ".join(f"{c.cluster}/{c.model} ({c.unpriced_hops} replica hops)"
                                   for c in crossing), file=sys.stderr)
        return 1
    if over:
        print(f"error: {len(over)} plans exceed the ideal bound (cost model inconsistency): "
              + ", ".join(f"{c.cluster}/{c.model} {c.ratio:.4f}" for c in over), file=sys.stderr)
        return 1
    return 0


def _jsonable(d: dict) -> dict:
    """NaN -> None, so the document is strict JSON."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
