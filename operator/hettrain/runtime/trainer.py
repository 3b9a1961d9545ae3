"""The training loop of one rank, and the single-process reference it must match."""

from __future__ import annotations

import datetime
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hettrain.planning.catalog import CATALOG
from hettrain.planning.layers import chunk_layer_ranges
from hettrain.planning.plan import Plan
from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.collectives import DiLoCo, HetCommunicator, Tier
from hettrain.runtime.config import ENV_OPTIMIZER, OPTIMIZERS, RuntimeConfig
from hettrain.runtime.dataset import DataSource, open_data, replica_rows
from hettrain.runtime.devices import activate, select_device
from hettrain.runtime.metrics import RuntimeMetrics
from hettrain.runtime.model import StageModel, check_layout, lm_loss, whole_model
from hettrain.runtime.optim import ShardGroup, StageOptimizer
from hettrain.runtime.pipeline import StageRunner
from hettrain.runtime.tensor_parallel import check_tp, shard_stage_
from hettrain.runtime.weights import load_pretrained

log = logging.getLogger("hettrain.runtime")
WEIGHT_DECAY = 0.01
CROSS_DC_MODES = ("sync", "compress", "diloco")


def make_optimizer(model: torch.nn.Module, lr: float,
                   kind: str = "adamw") -> torch.optim.Optimizer:
    """A plain fp32 torch optimizer (the bare-loop baseline of ``bench/runtime.py``; the
    runtime itself uses :class:`~hettrain.runtime.optim.StageOptimizer`)."""
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
    """Sum of the catalog peak FLOP/s of every planned device (0 when unknown)."""
    total = 0.0
    for r in plan.ranks:
        dev = CATALOG.get(plan.stages[r.stage].device)
        total += dev.flops if dev is not None else 0.0
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
        out += replica_rows(x, y, plan.dp, dp_index, plan.micro_batch, plan.num_microbatches)
    return out


def validation_due(plan: Plan, done: int) -> bool:
    """Whether a validation loss is computed after ``done`` optimizer steps."""
    every = plan.training.validation_interval
    return every > 0 and done % every == 0


def reference_losses(plan: Plan, steps: int, start_step: int = 0,
                     optimizer: str = "adamw",
                     validation: dict[int, float] | None = None) -> list[float]:
    """Single-process run of the same model, global batches, precision and loop (schedule,
    clipping, weight decay): the losses to match. ``validation`` (if given) receives
    ``{done steps: validation loss}`` at the plan's validation interval."""
    t = plan.training
    data = open_data(plan.data, seed=t.seed, seq_len=plan.model.seq_len, vocab=plan.model.vocab)
    model = whole_model(plan.model, t.seed)
    opt = StageOptimizer(model, t, kind=optimizer)
    out = []
    n = plan.dp * plan.num_microbatches
    for step in range(start_step, steps):
        opt.zero_grad()
        total = 0.0
        for d in range(plan.dp):
            for x, y in data.microbatches(t.seed, step, dp=plan.dp, dp_index=d,
                                     micro_batch=plan.micro_batch,
                                     num_microbatches=plan.num_microbatches,
                                     seq_len=plan.model.seq_len, vocab=plan.model.vocab):
                loss = lm_loss(model(x), y)
                (loss * (opt.loss_scale / n)).backward()
                total += loss.item()
        opt.step(step)
        out.append(total / n)
        if validation is not None and validation_due(plan, step + 1):
            with torch.no_grad():
                vals = [lm_loss(model(x), y).item() for d in range(plan.dp)
                        for x, y in validation_batches(plan, data, d)]
            validation[step + 1] = sum(vals) / len(vals)
    return out


class Trainer:
    """One rank: its stage slice, pipeline runner, DP / cross-DC sync, checkpoints, metrics."""

    def __init__(self, cfg: RuntimeConfig, rank: int) -> None:
        self.cfg, self.rank, self.plan = cfg, rank, cfg.plan
        plan = self.plan
        self.me = plan.ranks[rank]
        st = plan.stages[self.me.stage]
        refused = unsupported(plan)
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
        self.model = StageModel(plan.model, st.layer_start, st.layer_end,
                                has_embedding=st.index == 0, has_head=st.index == plan.pp - 1,
                                seed=plan.training.seed,
                                chunks=chunk_layer_ranges(plan)[st.index],
                                recompute=plan.training.recompute)
        tp_members = ([plan.ranks[g].tp for g in dist.get_process_group_ranks(self.comm.tp_group)]
                      if st.tp > 1 else [0])
        self.tp = shard_stage_(self.model, plan.model, st.tp, self.me.tp, self.comm.tp_group,
                               tp_members, self.comm.stats)
        if plan.model.pretrained:  # a checkpoint, when resuming, overrides these in train()
            load_pretrained(self.model, plan.model.pretrained, self.tp)
        self.model.to(self.device)  # built and sliced on the host: identical weights anywhere
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
        self.metrics = RuntimeMetrics(plan.job, rank, self.me.stage, self.me.pool,
                                      cfg.metrics_port + (rank - cfg.rank_start)
                                      if cfg.metrics_port else 0)
        self.metrics.set_schedule(self.runner.schedule, self.runner.planned)
        log.info("rank %d: executing schedule %r (model chunks %s)", rank,
                 self.runner.schedule, self.model.chunks)
        self.ckpt = self._checkpointer(cfg)
        self._loss_tier = self._dp_tier()
        self.validation: dict[int, float] = {}

    def _optimizer(self) -> StageOptimizer:
        """The stage optimizer: plan precision, ZeRO-1 over the stage DP group when planned,
        gradients averaged through the communicator, the global norm over the world."""
        plan, comm, t = self.plan, self.comm, self.plan.training
        scope = "dc" if self.xdc["mode"] == "diloco" else "global"
        shard = None
        if t.optimizer_sharding and comm.dp_size > 1:
            tier = self._dp_tier()
            shard = ShardGroup(comm.dp_group, dist.get_rank(comm.dp_group), comm.dp_size,
                               comm.staging_device(comm.dp_group),
                               lambda nbytes, secs: comm.stats.add(tier, nbytes, secs))

        def reduce_grads(flat: torch.Tensor) -> None:
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
        return StageOptimizer(
            self.model, t, kind=self.cfg.optimizer, shard=shard,
            reduce_grads=reduce_grads if plan.dp > 1 else None, norm_reduce=norm_reduce,
            tp_sharded=set(self.tp.shards), tp=plan.stages[self.me.stage].tp,
            tp_index=self.me.tp, norm_slot=(slot, len(dcs) if scope == "dc" else 1),
            counts_norm=self.me.dp == min(r.dp for r in peers))

    def _checkpointer(self, cfg: RuntimeConfig) -> ckpt.Checkpointer | None:
        """The checkpoint saver (None without a URI); storage probed by every rank, stale
        incomplete checkpoints removed by rank 0, before any rank saves."""
        if not cfg.checkpoint_uri:
            return None
        saver = ckpt.Checkpointer(ckpt.CheckpointStore.open(cfg.checkpoint_uri), self.rank,
                                  self.plan.world_size, keep=cfg.checkpoint_keep,
                                  async_save=cfg.checkpoint_async)
        saver.prepare()
        dist.barrier()
        return saver

    def _resume(self) -> int:
        """Load the newest committed checkpoint into this rank's layout; its step (0: none)."""
        assert self.ckpt is not None
        found = self.ckpt.store.latest_step()
        if found is None:
            if self.rank == 0:
                ckpt.report_no_checkpoint(self.ckpt.store, self.cfg.termination_log)
            return 0
        opt_targets = self.opt.load_targets()
        targets = ckpt.job_state(self.model, None, tp=self.tp, for_save=False,
                                 extra={**self._outer_state(), **opt_targets})
        loaded = ckpt.load(self.ckpt.store, found, targets, model=ckpt.model_meta(self.plan.model))
        self.opt.load_finish(opt_targets)
        ckpt.restore_rng(targets, loaded)
        self.metrics.last_ckpt.set(found)
        if self.diloco is not None:  # the outer (global) weights are the loaded ones
            self.diloco.global_params = [p.detach().clone() for p in self.opt.master_views()]
        log.info("rank %d: resumed from checkpoint step %d", self.rank, found)
        return found

    def _dp_tier(self) -> Tier:
        """The slowest link this rank's stage DP group spans (for the loss all-reduce)."""
        peers = [r for r in self.plan.ranks if (r.stage, r.tp) == (self.me.stage, self.me.tp)]
        if len({r.datacenter for r in peers}) > 1:
            return Tier.CROSS_DC
        return Tier.INTER_POOL if len({r.pool for r in peers}) > 1 else Tier.INTRA_POOL

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

    def _reduce_loss(self, total: float) -> torch.Tensor:
        loss = torch.tensor([total / self.plan.num_microbatches])
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
        flops, peak = step_flops(plan), peak_flops(plan)
        ckpt_due = False
        self.step_cpu: list[float] = []  # process CPU seconds per step (all threads)
        for step in range(start, t.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            self.opt.zero_grad()
            batches = self.data.microbatches(t.seed, step, dp=plan.dp, dp_index=self.me.dp,
                                   micro_batch=plan.micro_batch,
                                   num_microbatches=plan.num_microbatches,
                                   seq_len=plan.model.seq_len, vocab=plan.model.vocab)
            if self.device.type != "cpu":
                batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
            total = self.runner.run(batches, self.opt.loss_scale / plan.num_microbatches)
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
                                      plan.global_batch * plan.model.seq_len, flops, peak)
            self.metrics.observe_comm(self.comm.stats)
            if self.rank == 0 and self.cfg.loss_log:
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
            if self.ckpt is not None and ((ckpt_due and synced) or last):
                # the optimizer's state as full per-parameter tensors (all-gathered over the
                # DP group under ZeRO-1: every replica takes part, replica 0 writes)
                state = ckpt.job_state(self.model, None, tp=self.tp, dp_index=self.me.dp,
                                       extra={**self._outer_state(),
                                              **self.opt.checkpoint_tensors()})
                self.ckpt.save(done, state, ckpt.meta_for(plan))
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
        batches = validation_batches(self.plan, self.data, self.me.dp)
        if self.device.type != "cpu":
            batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        self.model.eval()
        total = self.runner.evaluate(batches)
        self.model.train()
        per = len(batches) / self.plan.num_microbatches  # _reduce_loss divides by M
        val = self._reduce_loss(total / per).item()
        log.info("rank %d: validation loss %.6f", self.rank, val)
        return val

    def _write_summary(self, losses: list[float]) -> None:
        """``HETTRAIN_SUMMARY_DIR/rank-R.json``: per-tier bytes/ops/seconds, CPU seconds per step,
        a weight checksum."""
        if not self.cfg.summary_dir:
            return
        with torch.no_grad():
            checksum = float(sum(p.double().sum() for p in self.model.parameters()))
        rec = {"rank": self.rank, "stage": self.me.stage, "dp": self.me.dp, "tp": self.me.tp,
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
               "step_cpu_seconds": self.step_cpu}
        path = Path(self.cfg.summary_dir) / f"rank-{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec))


def run_rank(cfg: RuntimeConfig, rank: int) -> list[float]:
    """Join the process group as ``rank``, train, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                            rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        return Trainer(cfg, rank).train()
    finally:
        dist.destroy_process_group()

