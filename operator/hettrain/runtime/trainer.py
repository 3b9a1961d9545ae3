"""The training loop of one rank, and the single-process reference it must match."""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hettrain.planning import cost
from hettrain.planning.catalog import CATALOG
from hettrain.planning.layers import chunk_layer_ranges
from hettrain.planning.plan import Plan
from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.collectives import DiLoCo, HetCommunicator, Tier, tier_of
from hettrain.runtime.config import ENV_OPTIMIZER, OPTIMIZERS, RuntimeConfig
from hettrain.runtime.context_parallel import ContextParallel, comm_view, enable_
from hettrain.runtime.dataset import DataSource, open_data, rows_microbatches
from hettrain.runtime.devices import activate, select_device
from hettrain.runtime.grad_sync import UnitGradSync
from hettrain.runtime.metrics import RuntimeMetrics
from hettrain.runtime.model import StageModel, check_layout, lm_loss, whole_model
from hettrain.runtime.optim import PER_UNIT, ShardGroup, StageOptimizer, sharding_of
from hettrain.runtime.pipeline import StageRunner
from hettrain.runtime.replica_sync import InGroup, ReplicaSync, group_config
from hettrain.runtime.stage_timing import StageTimer
from hettrain.runtime.tensor_parallel import check_tp, shard_stage_
from hettrain.runtime.weights import load_pretrained

log = logging.getLogger("hettrain.runtime")
WEIGHT_DECAY = 0.01
CROSS_DC_MODES = ("sync", "compress", "diloco")


def make_optimizer(model: torch.nn.Module, lr: float,
                   kind: str = "adamw") -> torch.optim.Optimizer:
    """A plain fp32 torch optimizer (for bare loops outside the runtime, which itself uses
    :class:`~hettrain.runtime.optim.StageOptimizer`)."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY,
                                 foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    raise ValueError(f"{ENV_OPTIMIZER}={kind!r}: must be one of {OPTIMIZERS}")


def cross_dc_settings(plan: Plan) -> dict:
    """``plan.cross_dc`` validated: mode, compression, outer_steps, outer_lr, outer_momentum."""
    c = dict(plan.cross_dc or {})
    mode = c.get("mode", "sync")
    if mode not in CROSS_DC_MODES:
        raise ValueError(f"plan.cross_dc.mode={mode!r}: must be one of {CROSS_DC_MODES} "
                         "(spec.training.crossDC.mode)")
    out = {"mode": mode, "compression": c.get("compression") or "none",
           "outer_steps": int(c.get("outer_steps", 50)),
           "outer_lr": float(c.get("outer_lr", 0.7)),
           "outer_momentum": float(c.get("outer_momentum", 0.9))}
    if out["outer_steps"] < 1:
        raise ValueError(f"plan.cross_dc.outer_steps={out['outer_steps']}: must be >= 1 "
                         "(spec crossDC.outerSteps)")
    return out


def step_flops(plan: Plan) -> float:
    """Model FLOPs of one optimizer step (6 * params * tokens + attention)."""
    s = plan.model
    tokens = plan.global_batch * s.seq_len
    return 6.0 * s.parameters() * tokens + 12.0 * s.layers * s.hidden * s.seq_len * tokens


def peak_flops(plan: Plan) -> float:
    """Sum of the catalog peak FLOP/s of every planned device in the plan's precision (0
    when unknown)."""
    total = 0.0
    eb = cost.precision_bytes(plan.training)
    for r in plan.ranks:
        dev = CATALOG.get(plan.stage_of(r).device)
        total += dev.peak_matmul_flops(eb) if dev is not None else 0.0
    return total


def unsupported(plan: Plan) -> list[str]:
    """Plan options this runtime cannot honour, each a one-line error naming the plan field
    (empty: it runs the plan as written). The operator-side twin is
    ``planning.support.unsupported`` (same rules, no torch)."""
    from hettrain.planning.support import unsupported as rules
    return rules(plan)


def validation_batches(plan: Plan, data: DataSource,
                       dp_index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``dp_index``'s share of the fixed validation set: ``validation_batches`` global
    batches of the data's validation split (in order, the same at every validation)."""
    t = plan.training
    out = []
    for k in range(t.validation_batches):
        x, y = data.validation_batch(k, plan.global_batch)
        out += replica_block(plan, x, y, dp_index)
    return out


def replica_block(plan: Plan, x: torch.Tensor, y: torch.Tensor,
                  dp_index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``dp_index``'s microbatches of a global batch ``x, y`` (a plan without
    groups): its block of consecutive rows, ``plan.replica_microbatches(dp_index)`` of them
    (one fewer on the short replicas of an uneven plan)."""
    if not 0 <= dp_index < plan.dp:
        raise ValueError(f"dp_index={dp_index} out of range for dp={plan.dp}")
    return rows_microbatches(x, y, plan.replica_row_offset(dp_index), plan.micro_batch,
                             plan.replica_microbatches(dp_index))


def validation_due(plan: Plan, done: int) -> bool:
    """Whether a validation loss is computed after ``done`` optimizer steps."""
    every = plan.training.validation_interval
    return every > 0 and done % every == 0


def reference_losses(plan: Plan, steps: int, start_step: int = 0,
                     optimizer: str = "adamw",
                     validation: dict[int, float] | None = None,
                     final: dict[str, torch.Tensor] | None = None) -> list[float]:
    """Single-process run of the same model, global batches, precision and loop (schedule,
    clipping, weight decay): the losses to match. ``validation`` (if given) receives
    ``{done steps: validation loss}`` at the plan's validation interval; ``final`` (if given)
    the parameters after the last step, by global name."""
    t = plan.training
    data = open_data(plan.data, seed=t.seed, seq_len=plan.model.seq_len, vocab=plan.model.vocab)
    model = whole_model(plan.model, t.seed)
    opt = StageOptimizer(model, t, kind=optimizer)
    out = []
    n = plan.total_microbatches
    for step in range(start_step, steps):
        opt.zero_grad()
        total = 0.0
        for x, y in _all_microbatches(plan, data, step):
            loss = lm_loss(model(x), y)
            (loss * (opt.loss_scale / n)).backward()
            total += loss.item()
        opt.step(step)
        out.append(total / n)
        if validation is not None and validation_due(plan, step + 1):
            with torch.no_grad():
                vals = [lm_loss(model(x), y).item()
                        for x, y in _all_microbatches(plan, data, None)]
            validation[step + 1] = sum(vals) / len(vals)
    if final is not None:
        final.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _all_microbatches(plan: Plan, data: DataSource,
                      step: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every replica's microbatches of ``step`` (None: of the validation set), replicas (of
    every replica group, in order) one after the other: the reference's inputs."""
    t = plan.training
    if not plan.groups:
        if step is None:
            return [b for d in range(plan.dp) for b in validation_batches(plan, data, d)]
        x, y = data.global_batch(t.seed, step, plan.global_batch)
        return [b for d in range(plan.dp) for b in replica_block(plan, x, y, d)]
    globals_ = ([data.global_batch(t.seed, step, plan.global_batch)] if step is not None else
                [data.validation_batch(k, plan.global_batch)
                 for k in range(t.validation_batches)])
    out = []
    for x, y in globals_:
        for g in plan.groups:
            view = plan.group_plan(g.index)
            for d in range(g.dp):
                offset = plan.group_row_offset(g.index) + view.replica_row_offset(d)
                out += rows_microbatches(x, y, offset, plan.micro_batch,
                                         view.replica_microbatches(d))
    return out


class Trainer:
    """One rank: its stage slice, pipeline runner, DP / cross-DC sync, checkpoints, metrics."""

    def __init__(self, cfg: RuntimeConfig, rank: int,
                 replica: ReplicaSync | None = None) -> None:
        # replica groups (plan.groups): cfg and rank are the group's world (group_config),
        # ``replica`` the sync between groups; its plan is the whole job's
        self.cfg, self.rank, self.replica = cfg, rank, replica
        self.global_rank = replica.rank if replica is not None else rank
        self.full_plan = replica.plan if replica is not None else cfg.plan
        # context parallelism: the communicator sees each (dp, cp) pair as one replica (the CP
        # ranks join the gradient group); data and FLOPs follow the plan as written
        self.job_plan = cfg.plan
        self.plan = plan = comm_view(cfg.plan)
        self.me = plan.ranks[rank]
        # this rank's replica's microbatches per step (uneven plans: one fewer on the short
        # replicas)
        self.my_microbatches = cfg.plan.replica_microbatches(cfg.plan.ranks[rank].dp)
        st = plan.stages[self.me.stage]
        refused = unsupported(self.job_plan)
        if refused:
            raise ValueError(refused[0])
        check_tp(plan.model, st.tp, f"plan.stages[{st.index}]")
        check_layout(plan.model, plan.pp)
        self.data = open_data(plan.data, seed=plan.training.seed, seq_len=plan.model.seq_len,
                              vocab=plan.model.vocab, verify=cfg.data_verify,
                              cache_dir=cfg.data_cache or None)
        self.xdc = cross_dc_settings(plan)
        choice = select_device(st.vendor, rank - cfg.rank_start, cfg.device)
        self.device = choice.device
        activate(self.device)
        log.info("rank %d: device %s (%s)", rank, self.device, choice.reason)
        # on the CPU every group is gloo; on an accelerator each pool uses the plan's backend
        # (nccl/hccl) where this host has it, and groups spanning pools are host-staged gloo
        self.comm = HetCommunicator.from_plan(plan, rank, device=self.device)
        self.cp = ContextParallel.from_plan(self.job_plan, rank, self.device,
                                            account=self._cp_account())
        self.model = StageModel(plan.model, st.layer_start, st.layer_end,
                                has_embedding=st.index == 0, has_head=st.index == plan.pp - 1,
                                seed=plan.training.seed,
                                chunks=chunk_layer_ranges(plan)[st.index],
                                recompute=plan.training.recompute,
                                loss_chunk_tokens=plan.training.loss_chunk_tokens,
                                mlp_chunk_tokens=plan.training.mlp_chunk_tokens)
        tp_members = ([plan.ranks[g].tp for g in dist.get_process_group_ranks(self.comm.tp_group)]
                      if st.tp > 1 else [0])
        self.tp = shard_stage_(self.model, plan.model, st.tp, self.me.tp, self.comm.tp_group,
                               tp_members, self.comm.stats, cp=st.cp)
        if self.cp is not None:
            enable_(self.model, self.cp)
        if plan.model.pretrained:  # a checkpoint, when resuming, overrides these in train()
            load_pretrained(self.model, plan.model.pretrained, self.tp)
        # built and sliced on the host: identical weights anywhere; under ZeRO-3 the
        # optimizer copies each unit's chunks to the device, never the whole stage
        if not (sharding_of(plan.training) == "full" and self.comm.dp_size > 1):
            self.model.to(self.device)
        self.opt = self._optimizer()
        self.diloco: DiLoCo | None = None
        if self.xdc["mode"] == "diloco":
            self.diloco = DiLoCo(self.opt.master_views(), self.comm,
                                 outer_steps=self.xdc["outer_steps"],
                                 outer_lr=self.xdc["outer_lr"],
                                 outer_momentum=self.xdc["outer_momentum"])
        self.runner = StageRunner(plan, rank, self.model, stats=self.comm.stats,
                                  recv_ahead=cfg.recv_ahead, comm=self.comm)
        self.loss_src = next(r.rank for r in plan.ranks
                             if (r.stage, r.dp, r.tp) == (plan.pp - 1, 0, 0))
        self.metrics = RuntimeMetrics(plan.job, self.global_rank, self.me.stage, self.me.pool,
                                      cfg.metrics_port + (rank - cfg.rank_start)
                                      if cfg.metrics_port else 0)
        self.metrics.set_schedule(self.runner.schedule, self.runner.planned)
        log.info("rank %d: executing schedule %r (model chunks %s)", rank,
                 self.runner.schedule, self.model.chunks)
        if self.model.lm_head is not None and self.model.loss_chunk_tokens:
            log.info("rank %d: LM head and loss in chunks of %d tokens", rank,
                     self.model.loss_chunk_tokens)
        if plan.training.mlp_chunk_tokens:
            log.info("rank %d: MLP in chunks of %d tokens", rank, plan.training.mlp_chunk_tokens)
        self.ckpt = self._checkpointer(cfg)
        self._loss_tier = self._dp_tier()
        self.validation: dict[int, float] = {}

    def _in_group(self, scope: str) -> InGroup:
        """The collectives of this rank's DP×CP group for the sum between replica groups:
        reduce-scatter and all-gather where the group is one flat collective and the
        reduction (``HETTRAIN_DP_REDUCTION``, auto: not on gloo, whose reduce-scatter is
        slower than its all-reduce) is a reduce-scatter, else all-reduces only."""
        comm = self.comm

        def all_reduce(t: torch.Tensor) -> None:
            comm.dp_all_reduce_([t], average=False, scope=scope)

        want = self.cfg.dp_reduction
        if want == "auto":
            want = "all_reduce" if comm.backend(comm.dp_group) == "gloo" else "reduce_scatter"
        if (want != "reduce_scatter" or scope != "global" or comm.dp_size == 1
                or not comm.dp_overlappable(scope)):
            return InGroup(all_reduce)
        n = comm.dp_size

        def timed(run: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
            def call(full: torch.Tensor) -> None:
                t0 = time.perf_counter()
                run(full)
                comm.stats.add(Tier.INTRA_POOL, int((n - 1) / n * full.numel()
                                                    * full.element_size()),
                               time.perf_counter() - t0)
            return call

        return InGroup(all_reduce,
                       timed(lambda full: comm.dp_reduce_scatter_async(full, scope).wait()),
                       timed(lambda full: comm.dp_all_gather_into_(full, scope)),
                       dist.get_rank(comm.dp_group))

    def _optimizer(self) -> StageOptimizer:
        """The stage optimizer: plan precision, ZeRO-1 over the stage DP group when planned,
        gradients averaged through the communicator, the global norm over the world."""
        plan, comm, t = self.plan, self.comm, self.plan.training
        scope = "dc" if self.xdc["mode"] == "diloco" else "global"
        shard = None
        sharding = sharding_of(t)
        if sharding != "none" and comm.dp_size > 1:
            tier = self._dp_tier()
            # across datacenters the parameter all-gather crosses the DC link once per byte
            spans = len({r.datacenter for r in plan.ranks
                         if (r.stage, r.tp) == (self.me.stage, self.me.tp)}) > 1
            shard = ShardGroup(comm.dp_group, dist.get_rank(comm.dp_group), comm.dp_size,
                               comm.staging_device(comm.dp_group),
                               lambda nbytes, secs: comm.stats.add(tier, nbytes, secs),
                               gather=comm.dp_all_gather_ if spans else None)

        in_group = self._in_group(scope) if self.replica is not None else None

        def reduce_grads(flat: torch.Tensor) -> None:
            if self.replica is not None:  # replica groups: the sum over every holder
                self.replica.reduce_(flat, self.opt.segments,
                                     [p.shape for p in self.opt.params], in_group)
                return
            # mode "compress": the communicator compresses the DC hop
            comm.dp_all_reduce_([flat], average=True, scope=scope)

        def norm_reduce(vec: torch.Tensor) -> None:
            dist.all_reduce(vec)  # the world group is gloo: host memory

        # one DP replica per norm slot counts its (unsharded) gradients: the whole job, or
        # (DiLoCo) each datacenter, whose replicas step apart
        dcs = list(plan.datacenters)
        peers = [r for r in plan.ranks if (r.stage, r.tp) == (self.me.stage, self.me.tp)
                 and (scope == "global" or r.datacenter == self.me.datacenter)]
        slot = dcs.index(self.me.datacenter) if scope == "dc" else 0
        opt = StageOptimizer(
            self.model, t, kind=self.cfg.optimizer, shard=shard,
            reduce_grads=reduce_grads if plan.dp > 1 or self.replica else None,
            norm_reduce=norm_reduce,
            tp_sharded=set(self.tp.shards), tp=plan.stages[self.me.stage].tp,
            tp_index=self.me.tp, norm_slot=(slot, len(dcs) if scope == "dc" else 1),
            counts_norm=self.me.dp == min(r.dp for r in peers), device=self.device)
        # ZeRO-2/3 reduce each unit's gradients as its backward ends (optim.py), every
        # microbatch: overlapped, the same async all-reduce launched per unit (UnitGradSync)
        self.dp_overlap = (plan.dp > 1 and t.overlap_grad_reduce and self.replica is None
                           and comm.dp_overlappable(scope))
        # hierarchical / synchronous unless overlapped; replica groups: their in-group sums
        self.dp_reduction = ("reduce_scatter" if in_group is not None
                             and in_group.reduce_scatter is not None else "all_reduce")
        if self.dp_overlap:
            # one pool: bucketed async all-reduces during the last microbatch's backward
            # (runtime/grad_sync.py); across pools/DCs the hierarchical sync stays after it
            n = comm.dp_scope_size(scope)
            # ZeRO-2/3 keep one chunk of each unit's bucket: a reduce-scatter (half an
            # all-reduce's bytes) into the chunk of the rank's place in the group, which is
            # its shard index (both are its rank in comm.dp_group); on gloo an all-reduce
            # (gloo's reduce-scatter measured slower than its all-reduce: docs/runtime.md)
            want = self.cfg.dp_reduction
            if want == "auto":
                want = "all_reduce" if comm.backend(comm.dp_group) == "gloo" else "reduce_scatter"
            scatter = sharding in PER_UNIT and scope == "global" and want == "reduce_scatter"
            self.dp_reduction = "reduce_scatter" if scatter else "all_reduce"
            opt.enable_overlap(
                (lambda view: comm.dp_reduce_scatter_async(view, scope)) if scatter else
                (lambda view: comm.dp_all_reduce_async(view, scope)), n,
                bucket_bytes=self.cfg.dp_bucket_bytes,
                account=lambda nbytes, secs: comm.stats.add(Tier.INTRA_POOL, nbytes, secs),
                wire_bytes=(lambda nbytes: int((n - 1) / n * nbytes)) if scatter else
                (lambda nbytes: int(2 * (n - 1) / n * nbytes)))
        how = "after the backward"
        if self.dp_overlap and sharding in PER_UNIT:
            how = (f"per unit, {self.dp_reduction.replace('_', '-')} asynchronously during "
                   "the backward"
                   + (", next unit's gather prefetched" if opt.prefetch else ""))
        elif self.dp_overlap:
            how = f"overlapped with the backward (buckets of {self.cfg.dp_bucket_bytes} bytes)"
        elif in_group is not None:
            how = (f"after the backward, summed with the other replica groups; inside the group "
                   f"{self.dp_reduction.replace('_', '-')}")
        log.info("rank %d: DP gradient sync %s", self.rank, how)
        return opt

    def _checkpointer(self, cfg: RuntimeConfig) -> ckpt.Checkpointer | None:
        """The checkpoint saver (None without a URI); storage probed by every rank, stale
        incomplete checkpoints removed by rank 0, before any rank saves."""
        if not cfg.checkpoint_uri:
            return None
        saver = ckpt.Checkpointer(ckpt.CheckpointStore.open(cfg.checkpoint_uri), self.rank,
                                  self.plan.world_size, keep=cfg.checkpoint_keep,
                                  async_save=cfg.checkpoint_async)
        if self._writes_checkpoints:
            saver.prepare()
        dist.barrier()
        return saver

    @property
    def _writes_checkpoints(self) -> bool:
        """Replica groups: only group 0 writes (every group holds the same weights and
        optimizer state after each step); every group reads on resume."""
        return self.replica is None or self.replica.writes_checkpoints

    def _batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of ``step`` (replica groups: its group's rows of the
        job's global batch, then its replica's block)."""
        plan, t = self.job_plan, self.plan.training
        if self.replica is None:
            x, y = self.data.global_batch(t.seed, step, plan.global_batch)
            return replica_block(plan, x, y, plan.ranks[self.rank].dp)
        x, y = self.data.global_batch(t.seed, step, self.full_plan.global_batch)
        return rows_microbatches(x, y, self._row_offset(), plan.micro_batch,
                                 self.my_microbatches)

    def _row_offset(self) -> int:
        """First global-batch row of this rank's replica (replica groups)."""
        plan = self.job_plan
        return (self.full_plan.group_row_offset(self.full_plan.ranks[self.global_rank].group)
                + plan.replica_row_offset(plan.ranks[self.rank].dp))

    def _validation_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the fixed validation set (see :func:`validation_batches`)."""
        if self.replica is None:
            return validation_batches(self.job_plan, self.data,
                                      self.job_plan.ranks[self.rank].dp)
        plan, out = self.job_plan, []
        for k in range(plan.training.validation_batches):
            x, y = self.data.validation_batch(k, self.full_plan.global_batch)
            out += rows_microbatches(x, y, self._row_offset(), plan.micro_batch,
                                     self.my_microbatches)
        return out

    def _resume(self) -> int:
        """Load the newest committed checkpoint into this rank's layout; its step (0: none)."""
        assert self.ckpt is not None
        found = self.ckpt.store.latest_step()
        if found is None:
            if self.global_rank == 0:
                ckpt.report_no_checkpoint(self.ckpt.store, self.cfg.termination_log)
            return 0
        # the optimizer loads only its own (ZeRO-1: 1/dp) slice, in place, from any layout
        targets = ckpt.job_state(self.model, None, tp=self.tp, for_save=False,
                                 params=self.opt.param_shard is None,
                                 extra=self._outer_state(),
                                 sharded=self.opt.checkpoint_state(self.tp, for_save=False))
        loaded = ckpt.load(self.ckpt.store, found, targets, model=ckpt.model_meta(self.plan.model))
        self.opt.load_finish()
        ckpt.restore_rng(targets, loaded)
        self.metrics.last_ckpt.set(found)
        if self.diloco is not None:  # the outer (global) weights are the loaded ones
            self.diloco.global_params = [p.detach().clone() for p in self.opt.master_views()]
        log.info("rank %d: resumed from checkpoint step %d", self.rank, found)
        return found

    def _cp_account(self):
        """``(bytes, seconds)`` of a CP collective into the comm stats, under the slowest
        link of this rank's CP group."""
        me = self.job_plan.ranks[self.rank]
        peers = [r for r in self.job_plan.ranks if (r.stage, r.dp, r.tp) == (me.stage, me.dp,
                                                                              me.tp)]
        tier = tier_of(peers)
        return lambda nbytes, secs: self.comm.stats.add(tier, nbytes, secs)

    def _shard(self, batches: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context parallel: this rank's tokens of each microbatch (else as given)."""
        if self.cp is None:
            return batches
        return [self.cp.shard_batch(x, y) for x, y in batches]

    def _dp_tier(self) -> Tier:
        """The slowest link this rank's stage DP group spans (for the loss all-reduce)."""
        return tier_of(r for r in self.plan.ranks
                       if (r.stage, r.tp) == (self.me.stage, self.me.tp))

    def _outer_state(self) -> dict[str, torch.Tensor]:
        """DiLoCo's outer momentum, keyed by global parameter names (checkpointed)."""
        if self.diloco is None:
            return {}
        names = [n for n, _ in self.model.named_parameters()]
        return {f"outer.{n}.momentum": m
                for n, m in zip(names, self.diloco.momentum, strict=True)}

    def _sync(self, step: int, outer_step: int | None = None) -> dict[str, float]:
        """Gradient sync + optimizer step (+ DiLoCo outer step, as step ``outer_step``) of
        one inner step."""
        info = self.opt.step(step)  # DiLoCo: the intra-DC DP stays synchronous
        # DiLoCo, every H steps: pseudo-gradients across DCs, on the fp32 master weights
        if self.diloco is not None and self.diloco.step(
                step if outer_step is None else outer_step):
            self.opt.params_from_master()
        return info

    def _per_microbatch(self, x: float) -> float:
        """``x`` weighted for one microbatch of this rank: ``x / M`` (the replicas' mean,
        which the DP average turns into the global batch's mean), or with uneven replicas
        ``x · dp / N`` (``N``: the step's microbatches; a replica's ``M_i / N`` share of the
        sum, times ``dp`` for the DP average)."""
        plan = self.job_plan
        if plan.short_replicas:
            return x * plan.dp / plan.total_microbatches
        return x / plan.num_microbatches

    def _reduce_loss(self, total: float) -> torch.Tensor:
        loss = self._group_loss(total)
        if self.replica is not None:  # the groups' means, weighted by their shares
            loss = torch.tensor([self.replica.global_mean(loss.item())])
        return loss

    def _group_loss(self, total: float) -> torch.Tensor:
        loss = torch.tensor([self._per_microbatch(total)])
        if self.me.stage == self.plan.pp - 1 and self.plan.dp > 1:
            # plain (never compressed) average over the replicas; 4 bytes, still accounted
            g = self.comm.dp_size
            group = self.comm.dp_group
            staged = loss.to(self.comm.staging_device(group))
            with self.comm.stats.timed(self._loss_tier, int(2 * (g - 1) / g * 4)):
                dist.all_reduce(staged, group=group)
            loss = staged.cpu() / g
        dist.broadcast(loss, src=self.loss_src)  # the world group is gloo: host memory
        return loss

    def train(self) -> list[float]:
        """Run to ``plan.training.steps``; returns the losses of the steps run here."""
        plan, t = self.plan, self.plan.training
        start = self._resume() if self.cfg.resume and self.ckpt is not None else 0
        losses = []
        flops, peak = step_flops(self.full_plan), peak_flops(self.full_plan)
        ckpt_due = False
        self.step_cpu: list[float] = []  # process CPU seconds per step (all threads)
        self.stage_timer = StageTimer()  # measured stage times (closed-loop calibration)
        for step in range(start, t.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            comm0 = sum(s.seconds for _, s in self.comm.stats.items())
            self.opt.zero_grad()
            self.opt.begin_step(self.my_microbatches)  # arms the overlapped DP sync
            # the data replica of this rank (CP ranks share it)
            batches = self._shard(self._batches(step))
            if self.device.type != "cpu":
                batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
            total = self.runner.run(batches, self._per_microbatch(self.opt.loss_scale))
            done = step + 1
            last = done == t.steps
            if last and self.diloco is not None and done % self.diloco.outer_steps:
                # the run ends on an outer sync
                info = self._sync(step, outer_step=self.diloco.outer_steps - 1)
            else:
                info = self._sync(step)
            loss = self._reduce_loss(total)
            losses.append(loss.item())
            val = self._validate() if validation_due(plan, done) else None
            if val is not None:
                self.validation[done] = val
            seconds = time.perf_counter() - t0
            self.step_cpu.append(time.process_time() - c0)
            self.metrics.observe_step(done, loss.item(), seconds,
                                      self.full_plan.global_batch * plan.model.seq_len, flops,
                                      peak)
            self.metrics.observe_comm(self.comm.stats)
            self.stage_timer.add(self.runner.last_compute_s,
                                 sum(s.seconds for _, s in self.comm.stats.items()) - comm0,
                                 self.runner.last_layers_s)
            self.metrics.observe_stage(self.stage_timer.compute_s, self.stage_timer.comm_s,
                                       self.stage_timer.measured, self.stage_timer.layers_s)
            if self.global_rank == 0 and self.cfg.loss_log:
                with open(self.cfg.loss_log, "a") as f:
                    rec = {"step": step, "loss": loss.item(), "seconds": seconds,
                           "lr": info["lr"], "grad_norm": info["grad_norm"],
                           "skipped": bool(info["skipped"])}
                    if val is not None:
                        rec["val_loss"] = val
                    f.write(json.dumps(rec) + "\n")
            ckpt_due = ckpt_due or done % self.cfg.checkpoint_interval == 0
            # DiLoCo replicas differ between outer syncs: checkpoint only right after one
            synced = self.diloco is None or done % self.diloco.outer_steps == 0 or last
            if self.ckpt is not None and self._writes_checkpoints and (
                    (ckpt_due and synced) or last):
                # the optimizer's state as views of its own slice: under ZeRO-1 every DP
                # replica writes its 1/dp (nothing is gathered), else replica 0 writes it all
                state = ckpt.job_state(self.model, None, tp=self.tp, dp_index=self.me.dp,
                                       params=self.opt.param_shard is None,
                                       extra=self._outer_state(),
                                       sharded=self.opt.checkpoint_state(
                                           self.tp, dp_index=self.me.dp))
                self.ckpt.save(done, state, ckpt.meta_for(self.full_plan))
                self.metrics.last_ckpt.set(done)
                ckpt_due = False
            if self.cfg.step_sleep:
                time.sleep(self.cfg.step_sleep)
        if self.ckpt is not None:
            self.ckpt.wait()  # the last checkpoint is written (and published) before exit
        self._write_summary(losses)
        return losses

    def _validate(self) -> float:
        """Mean loss of the validation set (forward only through the pipeline, averaged over
        the DP replicas); every rank returns it."""
        batches = self._shard(self._validation_batches())
        if self.device.type != "cpu":
            batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        self.model.eval()
        total = self.runner.evaluate(batches)
        self.model.train()
        per = len(batches) / self.my_microbatches  # validation batches (_reduce_loss: ÷ M)
        val = self._reduce_loss(total / per).item()  # replica groups: already the job's mean
        log.info("rank %d: validation loss %.6f", self.rank, val)
        return val

    def _overlap_summary(self) -> dict:
        """The overlapped DP sync of the last step: buckets, how many started during the
        backward, seconds waited after it (empty when the sync ran after the backward)."""
        gs = self.opt.grad_sync
        if gs is None:
            return {}
        out = {"buckets": len(gs.buckets), "launched_in_backward": gs.launched_early,
               "wait_s": gs.wait_s}
        if isinstance(gs, UnitGradSync):  # ZeRO-2/3: per-unit reductions, prefetched gathers
            out.update(max_in_flight=gs.max_in_flight, prefetched=self.opt.prefetched,
                       reduction=self.dp_reduction, sent_bytes=gs.sent_bytes)
        return out

    def _param_checksum(self) -> float:
        """Sum of every parameter element (ZeRO-3: gathered unit by unit, a collective)."""
        if not self.opt.units or self.opt.param_shard is None:
            return float(sum(p.double().sum() for p in self.model.parameters()))
        total = 0.0
        for u in self.opt.units:
            with self.opt.gathered([u.key]):
                total += float(sum(p.double().sum() for p in self.opt.params[u.first:u.last]))
        return total

    def _write_summary(self, losses: list[float]) -> None:
        """``HETTRAIN_SUMMARY_DIR/rank-R.json``: per-tier bytes/ops/seconds, CPU seconds per step,
        a weight checksum."""
        if not self.cfg.summary_dir:
            return
        with torch.no_grad():
            checksum = self._param_checksum()
        rec = {"rank": self.global_rank, "group": self.full_plan.ranks[self.global_rank].group,
               "stage": self.me.stage, "dp": self.me.dp, "tp": self.me.tp,
               "datacenter": self.me.datacenter, "mode": self.xdc["mode"],
               "schedule": self.runner.schedule, "device": str(self.device),
               "steps": len(losses),
               "outer_syncs": self.diloco.outer_syncs if self.diloco is not None else 0,
               "param_checksum": checksum,
               "validation": self.validation,
               "param_elements": sum(p.numel() for p in self.model.parameters()),
               "bytes": {t.value: s.bytes for t, s in self.comm.stats.items()},
               "ops": {t.value: s.ops for t, s in self.comm.stats.items()},
               "seconds": {t.value: s.seconds for t, s in self.comm.stats.items()},
               "p2p": self.runner.p2p_stats.as_json(),
               "dp_overlap": self._overlap_summary(),
               "replica_rings_in_flight": (self.replica.rings_in_flight
                                           if self.replica is not None else 0),
               "step_cpu_seconds": self.step_cpu,
               "stage_timing": self.stage_timer.as_json()}
        path = Path(self.cfg.summary_dir) / f"rank-{self.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec))


def run_rank(cfg: RuntimeConfig, rank: int) -> list[float]:
    """Join the process group as ``rank``, train, leave."""
    if cfg.plan.groups:
        return run_grouped_rank(cfg, rank)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                            rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        losses = Trainer(cfg, rank).train()
        dist.barrier()  # rank 0 serves the TCP store: no rank tears down while another works
        return losses
    finally:
        dist.destroy_process_group()



def run_grouped_rank(cfg: RuntimeConfig, rank: int) -> list[float]:
    """Replica groups: the job's TCP store, the gradient sync between groups (built first,
    see runtime/replica_sync.py), then this rank's group as its own world; train, leave."""
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, rank == 0,
                          timeout)
    stats: dict = {}
    sync = ReplicaSync(cfg.plan, rank, store, timeout,
                       account=lambda tier, n, secs: stats["comm"].add(tier, n, secs))
    group_cfg, local = group_config(cfg, rank)
    group = cfg.plan.ranks[rank].group
    dist.init_process_group("gloo", store=dist.PrefixStore(f"hetrep/group-{group}/", store),
                            rank=local, world_size=group_cfg.world_size, timeout=timeout)
    try:
        trainer = Trainer(group_cfg, local, replica=sync)
        stats["comm"] = trainer.comm.stats
        losses = trainer.train()
        sync.barrier()  # rank 0 serves the store: it leaves last
        return losses
    finally:
        dist.destroy_process_group()
