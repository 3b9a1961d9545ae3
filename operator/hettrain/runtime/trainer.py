"""The training loop of one rank, and the single-process reference it must match."""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from hettrain.planning.catalog import CATALOG
from hettrain.planning.plan import Plan
from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.collectives import HetCommunicator
from hettrain.runtime.config import RuntimeConfig
from hettrain.runtime.data import microbatches
from hettrain.runtime.metrics import RuntimeMetrics
from hettrain.runtime.model import StageModel, lm_loss, whole_model
from hettrain.runtime.pipeline import StageRunner

WEIGHT_DECAY = 0.01


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with the same settings everywhere (reference and pipelined)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, foreach=False)


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


def reference_losses(plan: Plan, steps: int, start_step: int = 0) -> list[float]:
    """Single-process run of the same model and global batches: the losses to match."""
    t = plan.training
    model = whole_model(plan.model, t.seed)
    opt = make_optimizer(model, t.learning_rate)
    out = []
    for step in range(start_step, steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        n = plan.dp * plan.num_microbatches
        for d in range(plan.dp):
            for x, y in microbatches(t.seed, step, dp=plan.dp, dp_index=d,
                                     micro_batch=plan.micro_batch,
                                     num_microbatches=plan.num_microbatches,
                                     seq_len=plan.model.seq_len, vocab=plan.model.vocab):
                loss = lm_loss(model(x), y)
                (loss / n).backward()
                total += loss.item()
        opt.step()
        out.append(total / n)
    return out


class Trainer:
    """One rank: its stage slice, pipeline runner, DP averaging, checkpoints and metrics."""

    def __init__(self, cfg: RuntimeConfig, rank: int) -> None:
        self.cfg, self.rank, self.plan = cfg, rank, cfg.plan
        plan = self.plan
        self.me = plan.ranks[rank]
        st = plan.stages[self.me.stage]
        if st.tp != 1:
            raise ValueError(f"plan.stages[{st.index}].tp={st.tp}: this runtime trains tp=1 "
                             "only; plan with tensor_parallel 1")
        self.comm = HetCommunicator.from_plan(plan, rank, device=torch.device("cpu"),
                                              backend_overrides={"*": "gloo"})
        self.model = StageModel(plan.model, st.layer_start, st.layer_end,
                                has_embedding=st.index == 0, has_head=st.index == plan.pp - 1,
                                seed=plan.training.seed)
        self.opt = make_optimizer(self.model, plan.training.learning_rate)
        self.runner = StageRunner(plan, rank, self.model, stats=self.comm.stats)
        self.loss_src = next(r.rank for r in plan.ranks
                             if (r.stage, r.dp, r.tp) == (plan.pp - 1, 0, 0))
        self.metrics = RuntimeMetrics(plan.job, rank, self.me.stage, self.me.pool,
                                      cfg.metrics_port + (rank - cfg.rank_start)
                                      if cfg.metrics_port else 0)
        self.root = ckpt.checkpoint_root(cfg.checkpoint_uri) if cfg.checkpoint_uri else None

    def train(self) -> list[float]:
        """Run to ``plan.training.steps``; returns the losses of the steps run here."""
        plan, t = self.plan, self.plan.training
        start = 0
        if self.cfg.resume and self.root is not None:
            found = ckpt.latest_step(self.root)
            if found is not None:
                ckpt.load(self.root, found, self.model, self.opt)
                start = found
                self.metrics.last_ckpt.set(found)
        losses = []
        flops, peak = step_flops(plan), peak_flops(plan)
        for step in range(start, t.steps):
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=False)
            batches = microbatches(t.seed, step, dp=plan.dp, dp_index=self.me.dp,
                                   micro_batch=plan.micro_batch,
                                   num_microbatches=plan.num_microbatches,
                                   seq_len=plan.model.seq_len, vocab=plan.model.vocab)
            total = self.runner.run(batches, 1.0 / plan.num_microbatches)
            grads = [p.grad for p in self.model.parameters()]
            if plan.dp > 1:
                self.comm.dp_all_reduce_(grads, average=True)
            self.opt.step()
            loss = torch.tensor([total / plan.num_microbatches])
            if self.me.stage == plan.pp - 1 and plan.dp > 1:
                self.comm.dp_all_reduce_([loss], average=True)
            dist.broadcast(loss, src=self.loss_src)
            losses.append(loss.item())
            done = step + 1
            seconds = time.perf_counter() - t0
            self.metrics.observe_step(done, loss.item(), seconds,
                                      plan.global_batch * plan.model.seq_len, flops, peak)
            self.metrics.observe_comm(self.comm.stats)
            if self.rank == 0 and self.cfg.loss_log:
                with open(self.cfg.loss_log, "a") as f:
                    rec = {"step": step, "loss": loss.item(), "seconds": seconds}
                    f.write(json.dumps(rec) + "\n")
            if self.root is not None and (done % self.cfg.checkpoint_interval == 0
                                          or done == t.steps):
                ckpt.save(self.root, done, self.model, self.opt)
                self.metrics.last_ckpt.set(done)
            if self.cfg.step_sleep:
                time.sleep(self.cfg.step_sleep)
        return losses


def run_rank(cfg: RuntimeConfig, rank: int) -> list[float]:
    """Join the process group as ``rank``, train, leave."""
    dist.init_process_group("gloo", init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                            rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        return Trainer(cfg, rank).train()
    finally:
        dist.destroy_process_group()

