"""Where a plan loses throughput against ``plan_quality``'s ideal: its gap split into parts.

The ideal (``plan_quality.ideal_tokens_per_s``) runs every GPU of the cluster at the rate
``ρ_d = G·s / (L·layer_compute_s(G, tp=1) + head_time_s(G, tp=1))`` of its device ``d``
(``G`` the global batch as one microbatch, the job's recompute mode; ``auto``: none), so in
one predicted step of ``T`` seconds the cluster could process ``T·I`` tokens (``I = Σ ρ``)
and the plan processes ``N = G·s``: ``ratio = N / (T·I)`` and ``gap = 1 − ratio``.

Accounting (exact, in ideal-token units): every GPU's ``T`` seconds are worth ``ρ_d·T``
tokens. An idle GPU loses all of them (``idle whole`` in pools the plan leaves unused,
``idle part`` in pools it uses partly). A used GPU of stage ``i`` (``n`` layers, TP ``t``,
CP ``c``, ``m`` microbatches of ``b`` sequences per replica) spends its ``T`` as

- ``W``: its share of the work at the ideal's speed, ``(m·b/G)·(n·lc(G, 1) + head(G, 1))/(t·c)``
  (head only on the last stage);
- ``shape``: its compute at the plan's shape (microbatch ``b``, ``1/t`` GEMMs, CP's
  ``s/c`` tokens and extra masked attention, a head replicated over TP) minus ``W``;
- ``recompute``: the plan's recompute mode minus the ideal's (0 when they agree);
- ``tp``: exposed TP all-reduces (layers and the vocab-parallel head); ``cp``: the exposed
  CP key/value exchange;
- ``imbalance``: waiting ``m·(max stage − own stage)`` for the slowest stage (and, with
  replica groups, for the slowest group; with uneven data parallelism, the short replicas
  for the full ones);
- ``bubble``: the schedule's bubble of the stages alone (``cost.pipeline_time_s`` without
  boundaries);
- ``boundary``: the pipeline time with the boundary transfers minus without them;
- ``dp sync`` / ``optimizer``: the step's tail ``max_j (exposed DP sync + optimizer step)_j``,
  split as at the stage ``j`` that sets it (with replica groups, whose gradient sum replaces
  group 0's own sync: the tail after the sum, optimizer and ZeRO-1 gather, plus the sum).

Summed over GPUs (weighted by ``ρ``) and divided by ``T·I`` these are the parts' shares of
the ratio. The used GPUs' ``Σ ρ·W`` equals ``N`` only when every stage's device has the
ideal's layer/head time proportions, so ``mix = (Σ ρ·W − N)/(T·I)`` (signed, small: which
device runs which layers and the head) is a part too. Then ``gap = Σ parts`` exactly;
``rest = gap − Σ parts`` is what the reconstruction from the cost model misses (~1e-16;
the reconstructed step time is also checked against ``plan.predicted.step_time_s``:
``step_err``). Medians of the parts over many plans need not add up to the median gap;
their means add up to the mean gap.
"""

from __future__ import annotations

from dataclasses import replace

from hettrain.api.spec import JobSpec
from hettrain.planning import context, cost
from hettrain.planning.inventory import ClusterInventory
from hettrain.planning.plan import Plan
from hettrain.planning.planner import (
    _after_sum_dp_s,
    _optimizer_coeffs,
    _stage_costs,
    pipeline_hops,
    plan_link_warmup,
)
from hettrain.planning.replica_groups import plan_zb_div
from hettrain.planning.units import build_units, filter_pools

PARTS = ("idle whole", "idle part", "bubble", "imbalance", "boundary", "tp", "cp",
         "recompute", "shape", "dp sync", "optimizer", "mix", "rest")


def ideal_mode(spec: JobSpec) -> str:
    """The recompute mode the ideal pays: the job's (``auto``: none)."""
    return spec.training.recompute if spec.training.recompute != "auto" else "none"


def ideal_layer_compute_s(spec: JobSpec, micro_batch: int, tp: int, cp: int, device) -> float:
    """One layer's compute seconds at the ideal's recompute mode (:func:`ideal_mode`), with
    the chunked MLP where the planner may choose it (a re-run layer at long sequences) and it
    is faster."""
    mode = ideal_mode(spec)
    eb = cost.precision_bytes(spec.training)
    chunk = cost.mlp_chunk_tokens(spec.model, replace(spec.training, recompute=mode))
    return min(context.cp_layer_compute_s(spec.model, micro_batch, tp, cp, device, mode, eb, c)
               for c in {0, chunk})


def device_rate(spec: JobSpec, device) -> tuple[float, float, float]:
    """(tokens/s ``ρ``, ideal layer seconds, ideal head seconds) of one GPU of ``device``
    computing the global batch as one microbatch at tp 1 (the ideal's per-GPU rate)."""
    m, gb = spec.model, spec.training.global_batch
    eb = cost.precision_bytes(spec.training)
    lc = ideal_layer_compute_s(spec, gb, 1, 1, device)
    head = cost.head_time_s(m, gb, 1, device, eb)
    return gb * m.seq_len / (m.layers * lc + head), lc, head


def _stage_parts(spec: JobSpec, plan_spec: JobSpec, unit, tp: int, cp: int, mb: int, n: int,
                 last: bool) -> dict[str, float]:
    """Per microbatch seconds of one stage rank on ``unit`` (a search unit, or an extra
    replica group's pool): compute at the ideal's recompute mode, the plan's extra recompute,
    TP and CP comm (their sum is the planner's stage time)."""
    model, dev = spec.model, unit.device
    eb = cost.precision_bytes(spec.training)
    mode = plan_spec.training.recompute
    local = cost.cp_local_model(model, cp)
    lc_plan = context.cp_layer_compute_s(model, mb, tp, cp, dev, mode, eb,
                                         plan_spec.training.mlp_chunk_tokens)
    lc_ideal = ideal_layer_compute_s(spec, mb, tp, cp, dev)
    tpc = cost.tp_comm_per_layer_s(local, mb, tp, dev, eb, mode)
    cpc = 0.0
    if cp > 1:
        link = context.cp_link(dev, unit.gpus_per_node, unit.nic_gbytes_per_gpu, tp, cp)
        cpc = context.cp_comm_per_layer_s(model, mb, tp, cp, eb, mode, *link,
                                          scatter_rows=context.scatters_rows(dev),
                                          attention_s=context.attention_window_s(
                                              model, mb, tp, cp, dev, eb))
    head_c = head_tp = rerun = 0.0
    if last:
        head = cost.head_time_s(local, mb, tp, dev, eb)
        # the chunked loss's recomputed logits: recompute beyond the ideal's
        rerun = (cost.head_time_s(local, mb, tp, dev, eb,
                                  plan_spec.training.loss_chunk_tokens) - head)
        if cost.vocab_shards(local, tp) > 1:
            nbytes = local.seq_len * mb * local.hidden * eb
            head_tp = cost.ring_all_reduce_s(nbytes, tp, dev.intra_node_gbps
                                             * cost.TP_BUS_EFFICIENCY, cost.TP_LATENCY_S)
        head_c = head - head_tp
    return {"compute": n * lc_ideal + head_c, "recompute": n * (lc_plan - lc_ideal) + rerun,
            "tp": n * tpc + head_tp, "cp": n * cpc}


def _layout(spec: JobSpec, inv: ClusterInventory, plan: Plan):
    """The plan's group-0 stages as the search costed them: (concrete spec, stage units,
    StageCosts, boundary seconds, DP×CP group size, microbatches, the datacenter links'
    latency paid once: ``planner.plan_link_warmup``)."""
    cp = plan.stages[0].cp
    concrete = replace(spec, training=plan.training,
                       parallelism=replace(spec.parallelism, cp=cp),
                       cross_dc=replace(spec.cross_dc, mode=plan.cross_dc.get("mode", "sync")))
    pools = filter_pools(inv, spec.placement)
    units = build_units(pools, merged=plan.cross_dc.get("grouping") == "merged")
    by_pool = {p.name: u for u in units for p in u.pools}
    stage_units = [by_pool[s.pools[0]] for s in plan.stages]
    tps = [s.tp for s in plan.stages]
    dpcp = plan.dp * cp
    # the fullest replica's microbatches (group 0's, as the search costed them)
    m = -(-spec.training.global_batch // (plan.dp * plan.micro_batch))
    # a schedule that hides the datacenter links' latency: ordinary hops, the delay once
    warm, delay = plan_link_warmup(plan, stage_units, inv)
    stages, _ = _stage_costs(stage_units, tps, dpcp, plan.micro_batch, m, plan.schedule, inv,
                             concrete, v=plan.virtual_stages, warm=warm)
    bounds = pipeline_hops(stage_units, tps, dpcp, plan.micro_batch, inv, concrete,
                           plan.virtual_stages, bool(warm))
    return concrete, stage_units, stages, bounds, dpcp, m, delay


def breakdown(spec: JobSpec, inv: ClusterInventory, plan: Plan) -> dict[str, float]:
    """Each part's share of the ratio (module docstring), plus ``gap``, ``ratio``,
    ``step_err`` (relative error of the reconstructed step time; 0 with replica groups,
    whose cross-DC gradient sum is taken as the remainder of the step) and ``recompute in
    ideal`` (the share of the ideal's own time spent recomputing: not a loss)."""
    model, gb = spec.model, spec.training.global_batch
    rates = {p.device.name: device_rate(spec, p.device) for p in inv.pools}
    ideal = sum(p.gpus * rates[p.device.name][0] for p in inv.pools)
    T = plan.predicted.step_time_s
    out = dict.fromkeys(PARTS, 0.0)
    per_pool: dict[str, int] = {}
    for r in plan.ranks:
        per_pool[r.pool] = per_pool.get(r.pool, 0) + 1
    for p in inv.pools:
        used = per_pool.get(p.name, 0)
        out["idle whole" if used == 0 else "idle part"] += ((p.gpus - used)
                                                           * rates[p.device.name][0] * T)
    concrete, units, stages, bounds, _, m_solo, delay = _layout(spec, inv, plan)
    split = [s.layers for s in plan.stages]
    v = plan.virtual_stages
    stage_s = [s.time(n) for s, n in zip(stages, split, strict=True)]
    dpcp = plan.dp * plan.stages[0].cp
    # each stage's DP tail; with groups the sum between them replaces group 0's own gradient
    # sync (replica_groups.grouped_step_s): what follows it, the optimizer (+ ZeRO-1 gather)
    tail = ([_after_sum_dp_s(u, st.tp, dpcp, inv, concrete, i == 0, i == plan.pp - 1, n)
             for i, (u, st, n) in enumerate(zip(units, plan.stages, split, strict=True))]
            if plan.groups else [s.dp(n) for s, n in zip(stages, split, strict=True)])
    k = max(range(plan.pp), key=lambda i: tail[i])
    oc, oe = _optimizer_coeffs(units[k], plan.stages[k].tp, dpcp, concrete, k == 0,
                               k == plan.pp - 1)
    opt = oc * split[k] + oe
    zd = plan_zb_div(plan, [u.device for u in units])  # ZB-H1: measured B/W split or 3
    helix = {"model": model, "helix_hop": plan.helix_hop, "helix_filo": plan.helix_filo}
    with_b, _ = cost.pipeline_time_s(stage_s, bounds, m_solo, plan.schedule, v, zd, **helix,
                                     link_delay_s=delay)
    boundary = with_b - cost.pipeline_time_s(stage_s, [], m_solo, plan.schedule, v, zd,
                                             **helix)[0]
    # (replicas, microbatches, StagePlans, stage units, stage seconds) per replica group
    # (uneven dp: the short replicas as a group of their own, one microbatch fewer: the
    # pipeline time they wait for the full ones counts as imbalance)
    r = plan.short_replicas
    groups = [(plan.dp - r, plan.num_microbatches, plan.stages, units, stage_s)]
    if r:
        groups.append((r, plan.num_microbatches - 1, plan.stages, units, stage_s))
    for g in plan.groups[1:]:  # each extra group runs on one pool (its NIC for the CP link)
        ug = inv.pool(g.stages[0].pools[0])
        groups.append((g.dp, g.num_microbatches, g.stages, [ug] * g.pp,
                       [s.time_ms / 1e3 for s in g.stages]))
    pipes = [cost.pipeline_time_s(ss, [], mg, plan.schedule, v,
                                  plan_zb_div(plan, [u.device for u in us], sp[0].cp),
                                  **helix)[0]
             for _, mg, sp, us, ss in groups]
    # the step: the slowest group's pipeline + boundaries + the tail (with groups: + the
    # gradient sum between them, replica_groups.groups_grad_sum_s: whatever T leaves)
    recon = max(pipes) + boundary + max(tail)
    sync = T - recon if plan.groups else 0.0
    # with groups a negative remainder would mean the reconstruction missed part of the step
    out["step_err"] = min(0.0, sync) / T if plan.groups else (recon - T) / T
    useful = 0.0
    for (dp, mg, splans, gunits, ss), pipe in zip(groups, pipes, strict=True):
        for i, (st, u) in enumerate(zip(splans, gunits, strict=True)):
            last = i == len(splans) - 1
            rho, lc, head = rates[u.device.name]
            count = dp * st.tp * st.cp
            w = (mg * plan.micro_batch / gb) * (st.layers * lc + (head if last else 0.0)) / (
                st.tp * st.cp)
            parts = _stage_parts(spec, concrete, u, st.tp, st.cp, plan.micro_batch,
                                 st.layers, last)
            seconds = {"shape": mg * parts["compute"] - w,
                       "recompute": mg * parts["recompute"], "tp": mg * parts["tp"],
                       "cp": mg * parts["cp"],
                       "imbalance": mg * (max(ss) - ss[i]) + (max(pipes) - pipe),
                       "bubble": pipe - mg * max(ss), "boundary": boundary,
                       "dp sync": max(tail) - opt + sync, "optimizer": opt}
            for key, sec in seconds.items():
                out[key] += count * rho * sec
            useful += count * rho * w
    n_tokens = gb * model.seq_len
    out["mix"] = useful - n_tokens
    total = T * ideal
    for key in PARTS:
        out[key] /= total
    out["ratio"] = n_tokens / total
    out["gap"] = 1.0 - out["ratio"]
    out["rest"] = out["gap"] - sum(out[p] for p in PARTS if p != "rest")
    out["recompute in ideal"] = _recompute_share(spec, inv, rates, ideal)
    return out


def _recompute_share(spec: JobSpec, inv: ClusterInventory, rates: dict, ideal: float) -> float:
    """Share of the ideal's GPU time (ρ-weighted) spent on the recompute the job pays."""
    model, gb = spec.model, spec.training.global_batch
    eb = cost.precision_bytes(spec.training)
    spent = 0.0
    for p in inv.pools:
        rho, lc, head = rates[p.device.name]
        none = cost.layer_compute_s(model, gb, 1, p.device, "none", eb)
        spent += p.gpus * rho * model.layers * (lc - none) / (model.layers * lc + head)
    return spent / ideal
