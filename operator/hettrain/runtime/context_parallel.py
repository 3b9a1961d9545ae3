"""Context parallelism (CP): a stage's sequence sharded over ``cp`` ranks.

Layout (``plan.stages[i].cp = n``, rank coordinate ``plan.ranks[r].cp`` in ``0..n-1``): every
training sequence of length ``S`` is cut into ``2n`` equal chunks of ``L = S / 2n`` tokens and CP
rank ``c`` holds chunks ``c`` and ``2n-1-c`` (the causal load-balanced layout of Llama 3 and
Megatron-LM: under the causal mask an early chunk has little to attend to and a late chunk much,
so pairing them gives every rank the same attention work). Everything except attention is
token-local, so a CP rank runs embedding, norms, MLP and head on its ``2L`` tokens only; RoPE
uses the tokens' TRUE positions (:func:`shard_positions`).

Attention: all-gather of K and V over the CP group (Llama 3's choice, Dubey et al. 2024 §3.3.2),
not ring attention. Each rank gathers the full keys/values, side by side in one collective
(GQA: the few ``kv_heads`` before they are repeated, so the gather is ``heads/(2·kv_heads)``
times smaller than one of Q), puts them in
sequence order and runs, per local query chunk ``j``, ordinary attention against the key prefix
``[0, (j+1)·L)`` with a lower-right causal mask (:class:`LowerRightCausal`: the last ``L`` keys
are the diagonal block): the future beyond the prefix is never computed, and on NVIDIA GPUs the
fused kernels (flash, memory-efficient attention) skip the diagonal block's masked half too;
elsewhere (CPU, Gaudi, Ascend) SDPA materialises the mask and computes the block in full, and
on ROCm the runtime passes the materialised mask itself (PyTorch does not test the lower-right
variant there).
The exchange runs per key/value head (a head group: its keys and values side by side and the
query heads sharing them), under the attention: a layer's gathers are all launched first and
each group's attention runs once its own gather is in; in the backward each group's reduction
is launched as soon as its attention backward has produced it and all are waited for before
the K/V projections' backward (:class:`_KeepLocal`, :class:`_Gathered`). Heads are independent,
so the result is the whole gather's; ``planning.context.exposed_s`` prices what stays exposed.
Why not ring attention: a gather is one collective per head group instead of ``n-1`` steps
with an online-softmax merge, the attention kernel is the unmodified
``scaled_dot_product_attention`` (same numerics as the reference), and for GQA models the K/V
bytes are small next to the compute at the lengths where CP is needed; ring attention's
``O(S/n)`` K/V memory matters at very large ``n``. The backward sums every rank's gradient of
the gathered K/V and keeps its own chunks' rows: one reduce-scatter over the CP group (the rows
sent rank-major, as the gather received them), or on gloo, whose reduce-scatter is no faster
than its all-reduce, an all-reduce.

Gradients and loss: each CP rank's loss is the mean cross-entropy of its own tokens (all ranks
hold the same number), so the loss of the CP group is the mean of the ranks' losses and the
gradient of a replicated parameter is the mean of the ranks' gradients: the CP ranks of a stage
join its data-parallel gradient group (Megatron's DP×CP group). :func:`comm_view` expresses
this for the communicator: the plan with each ``(dp, cp)`` pair renumbered as one replica
``dp·n + cp`` (so DP groups, ZeRO-1 shards, pipeline peers, checkpoint writers and the loss
average all follow unchanged), while the data and the CP group use the true coordinates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.utils.checkpoint import checkpoint

from hettrain.planning.plan import Plan
from hettrain.planning.support import context_parallel_degree

ROCM = torch.version.hip is not None  # a ROCm build: its "cuda" devices are AMD GPUs

__all__ = ["ContextParallel", "comm_view", "context_parallel_degree", "enable_",
           "shard_positions"]


def shard_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Token positions held by CP rank ``index`` of ``cp``: chunks ``index`` and
    ``2·cp-1-index`` of ``2·cp`` equal chunks (int64, ascending)."""
    if seq_len % (2 * cp):
        raise ValueError(f"plan.model.seq_len={seq_len} must be a multiple of 2·cp={2 * cp}")
    chunk = seq_len // (2 * cp)
    a, b = index, 2 * cp - 1 - index
    return torch.cat((torch.arange(a * chunk, (a + 1) * chunk),
                      torch.arange(b * chunk, (b + 1) * chunk)))


def comm_view(plan: Plan) -> Plan:
    """``plan`` as the communicator sees it: each (dp, cp) pair one replica ``dp·cp + c``
    (``plan.dp`` becomes ``dp·cp``, every stage ``cp = 1``); ``plan`` itself when ``cp == 1``."""
    n = context_parallel_degree(plan)
    if n == 1:
        return plan
    ranks = tuple(dataclasses.replace(r, dp=r.dp * n + r.cp, cp=0) for r in plan.ranks)
    stages = tuple(dataclasses.replace(s, cp=1) for s in plan.stages)
    return dataclasses.replace(plan, dp=plan.dp * n, ranks=ranks, stages=stages)


class LowerRightCausal(CausalBias):
    """``torch.nn.attention.bias.causal_lower_right(seq_len_q, seq_len_kv)`` without its storage:
    torch's ``CausalBias`` is built through ``torch.Tensor``'s legacy constructor, which
    allocates an unused ``(2, seq_len_q, seq_len_kv)`` float tensor (32 GiB for a 128k-token
    sequence at cp = 2). This instance holds an empty tensor and the variant and lengths, all
    that SDPA's dispatch of the bias reads (fused kernel, or the mask materialised)."""

    @staticmethod
    def __new__(cls, seq_len_q: int, seq_len_kv: int) -> LowerRightCausal:
        return torch.Tensor._make_subclass(cls, torch.empty(0))

    def __init__(self, seq_len_q: int, seq_len_kv: int) -> None:
        super().__init__(CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)

    def __deepcopy__(self, memo: dict) -> LowerRightCausal:
        return LowerRightCausal(self.seq_len_q, self.seq_len_kv)

    def __repr__(self) -> str:  # CausalBias's materialises the whole mask
        return f"LowerRightCausal({self.seq_len_q}, {self.seq_len_kv})"


class _KeepLocal(torch.autograd.Function):
    """Identity on this rank's grouped K/V ``(b, groups, 2·hg, 2L, d)``, the tensor every
    group's gather (:class:`_Gathered`) hangs from. Backward: this rank's rows of the K/V
    gradient, group by group, from the reductions those groups launched as soon as their
    attention's backward produced them (waited for here, after the last one: the earlier
    ones ran under the later groups' attention backward). The incoming gradient is ignored:
    the groups pass none."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, cp: ContextParallel, pending: dict) -> torch.Tensor:
        ctx.cp, ctx.pending = cp, pending
        ctx.set_materialize_grads(False)
        return kv.view_as(kv)

    @staticmethod
    def backward(ctx, _grad):
        pending = ctx.pending
        rows = [ctx.cp.finish_reduce(pending.pop(g)) for g in range(len(pending))]
        return torch.stack(rows, dim=1), None, None


class _Gathered(torch.autograd.Function):
    """One head group's gathered K/V (``held[0]``, its all-gather already waited for) as a
    function of the rank's grouped K/V (``kv``, from :class:`_KeepLocal`). Backward: launch
    the reduction of the gathered tensor's gradient and return none (:class:`_KeepLocal`
    collects it)."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, cp: ContextParallel, pending: dict, group: int,
                held: list) -> torch.Tensor:
        ctx.cp, ctx.pending, ctx.group = cp, pending, group
        return held.pop()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.pending[ctx.group] = ctx.cp.start_reduce(grad)
        return None, None, None, None, None


class ContextParallel:
    """One rank's CP state: its group, index, token positions and the attention over them."""

    def __init__(self, cp: int, index: int, seq_len: int, group: dist.ProcessGroup | None,
                 staging: torch.device | None = None,
                 account: Callable[[int, float], None] | None = None,
                 scatter_rows: bool = False) -> None:
        self.cp, self.index, self.seq_len, self.group = cp, index, seq_len, group
        # the K/V gradient's exchange: a reduce-scatter (half an all-reduce's bytes: nccl,
        # hccl) or, on gloo, whose reduce-scatter is no faster than its all-reduce
        # (bench/cp_exchange.py), an all-reduce of which the rank keeps its rows
        self.scatter_rows = scatter_rows
        self.chunk = seq_len // (2 * cp)
        self.positions = shard_positions(seq_len, cp, index)
        self.staging = staging  # where tensors for the group's collectives live (None: as is)
        self.account = account  # (bytes, seconds) per collective, into the comm stats
        # gathered shard k holds chunks k and 2cp-1-k: the permutation to position order
        order = []
        for k in range(cp):
            order += [k, 2 * cp - 1 - k]
        self._to_sequence = [order.index(c) for c in range(2 * cp)]
        self._mine = (index, 2 * cp - 1 - index)
        # each local chunk's lower-right causal bias over its key prefix, made once here (a
        # tensor subclass: making one inside autograd's saved-tensor hooks or a checkpoint's
        # re-run fails)
        self._causal = {j: LowerRightCausal(self.chunk, (j + 1) * self.chunk)
                        for j in self._mine}

    @classmethod
    def from_plan(cls, plan: Plan, rank: int, device: torch.device,
                  account: Callable[[int, float], None] | None = None) -> ContextParallel | None:
        """This rank's CP state (None when the plan has ``cp == 1``). Creates every CP group
        of the plan (``dist.new_group`` is collective: every rank calls this, in the same
        order): the ranks sharing ``(stage, dp, tp)``, ordered by CP index. The group runs
        gloo on a CPU rank, else the stage's backend resolved on this host."""
        n = context_parallel_degree(plan)
        if n == 1:
            return None
        from hettrain.runtime.collectives.communicator import resolve_backend
        me = plan.ranks[rank]
        mine = None
        for key in sorted({(r.stage, r.dp, r.tp) for r in plan.ranks}):
            members = sorted((r for r in plan.ranks if (r.stage, r.dp, r.tp) == key),
                             key=lambda r: r.cp)
            backend = ("gloo" if device.type == "cpu"
                       else resolve_backend(plan.stages[key[0]].backend))
            group = dist.new_group([r.rank for r in members], backend=backend)
            if key == (me.stage, me.dp, me.tp):
                mine = (group, backend)
        assert mine is not None
        group, backend = mine
        staging = torch.device("cpu") if backend == "gloo" else None
        return cls(n, me.cp, plan.model.seq_len, group, staging=staging, account=account,
                   scatter_rows=backend != "gloo")

    # ------------------------------------------------------------------ data

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens and targets of a ``(batch, seq_len)`` microbatch."""
        pos = self.positions.to(x.device)
        return x[:, pos].contiguous(), y[:, pos].contiguous()

    # ------------------------------------------------------------ collectives

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if self.staging is None else t.to(self.staging).contiguous()

    def start_gather(self, x: torch.Tensor) -> tuple:
        """Launch the all-gather of ``x`` (``(b, heads, 2L, d)``, this rank's rows) over the CP
        group; :meth:`finish_gather` waits for it."""
        local = self._stage(x)
        parts = [torch.empty_like(local) for _ in range(self.cp)]
        work = dist.all_gather(parts, local, group=self.group, async_op=True)
        return work, parts, x.device, (self.cp - 1) * local.numel() * local.element_size()

    def finish_gather(self, handle: tuple) -> torch.Tensor:
        """The full sequence (dim 2) of a :meth:`start_gather`, in position order; the seconds
        spent waiting for it (the exposed part) go to ``account``."""
        work, parts, device, nbytes = handle
        t0 = time.perf_counter()
        work.wait()
        if self.account is not None:
            self.account(nbytes, time.perf_counter() - t0)
        chunks = [c for p in parts for c in p.to(device).split(self.chunk, dim=2)]
        return torch.cat([chunks[i] for i in self._to_sequence], dim=2)

    def start_reduce(self, grad: torch.Tensor) -> tuple:
        """Launch the sum of ``grad`` (full sequence, dim 2) over the CP group;
        :meth:`finish_reduce` waits for it and keeps this rank's ``2L`` rows.
        ``scatter_rows``: one reduce-scatter of the rows in rank-major order (rank ``k``'s
        chunks ``k`` and ``2cp-1-k`` side by side, as :meth:`finish_gather` receives them); else an
        all-reduce of the whole buffer, of which this rank keeps its rows."""
        if self.scatter_rows:
            b, heads, _, d = grad.shape
            # (cp·b, heads, 2L, d): rank k's chunks k and 2cp-1-k at slot k, copied straight in
            send = torch.empty((self.cp * b, heads, 2 * self.chunk, d), dtype=grad.dtype,
                               device=grad.device if self.staging is None else self.staging)
            chunks = grad.split(self.chunk, dim=2)
            for k in range(self.cp):
                slot = send[k * b:(k + 1) * b]
                slot[:, :, :self.chunk].copy_(chunks[k])
                slot[:, :, self.chunk:].copy_(chunks[2 * self.cp - 1 - k])
            out = torch.empty_like(send[:b])
            work = dist.reduce_scatter_tensor(out, send, group=self.group, async_op=True)
            sent = (self.cp - 1) * out.numel() * out.element_size()
            return work, (send, out), grad.device, sent
        buf = self._stage(grad).clone()
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        sent = 2 * (self.cp - 1) * buf.numel() * buf.element_size() // self.cp
        return work, (buf, None), grad.device, sent

    def finish_reduce(self, handle: tuple) -> torch.Tensor:
        """This rank's rows of a :meth:`start_reduce`'s sum; the seconds spent waiting for it
        go to ``account``."""
        work, (buf, out), device, sent = handle
        t0 = time.perf_counter()
        work.wait()
        if out is None:  # all-reduced: keep this rank's rows
            rows = buf.split(self.chunk, dim=2)
            out = torch.cat([rows[c] for c in self._mine], dim=2)
        if self.account is not None:
            self.account(sent, time.perf_counter() - t0)
        return out.to(device)

    def reduce_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """Sum ``grad`` (full sequence, dim 2) over the CP group; this rank's ``2L`` rows of it
        (:meth:`start_reduce`)."""
        return self.finish_reduce(self.start_reduce(grad))

    # --------------------------------------------------------------- attention

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  recompute: bool = False) -> torch.Tensor:
        """Causal attention of this rank's queries (``(b, heads, 2L, d)``, RoPE applied at
        their true positions) over the whole sequence's keys/values (gathered here);
        ``recompute``: redo the attention core in the backward (selective recompute).

        One gather per key/value head (a head group: the head's keys and values side by side,
        and the query heads that share it): all are launched first, and each group's attention
        runs as soon as its own gather has arrived, under the later groups' gathers. In the
        backward each group's K/V gradient reduction is launched as soon as its attention's
        backward has produced it and runs under the earlier groups' attention backward; the
        last is waited for before the K/V projections' backward (:class:`_KeepLocal`). Heads
        are independent in attention, so the result is the whole gather's."""
        groups = k.shape[1]
        rep = q.shape[1] // groups
        # (b, groups, 2, 2L, d): each head's keys and values side by side
        kv = torch.stack((k, v), dim=2)
        pending: dict = {}
        local = _KeepLocal.apply(kv, self, pending)
        handles = [self.start_gather(kv[:, g].detach()) for g in range(groups)]
        masks = self._masks(q)
        out = []
        for g in range(groups):
            # the handle goes as soon as its gather is in sequence order (its buffers with it)
            held = [self.finish_gather(handles[g])]
            handles[g] = None
            kv_all = _Gathered.apply(local, self, pending, g, held)
            k_all, v_all = kv_all.split(1, dim=1)
            qg = q[:, g * rep:(g + 1) * rep]
            if recompute:
                out.append(checkpoint(self._core, qg, k_all, v_all, masks, use_reentrant=False))
            else:
                out.append(self._core(qg, k_all, v_all, masks))
        return torch.cat(out, dim=1)

    def _masks(self, q: torch.Tensor) -> tuple:
        """Each local query chunk's causal mask over its key prefix, for every head group's
        SDPA calls: the lower-right bias on NVIDIA GPUs (fused kernels skip its masked tiles);
        elsewhere, where SDPA would materialise it in every call (and keep it for the
        backward), materialised once here as the additive mask SDPA makes of it (0 or −inf
        in the query dtype), so the head groups share one copy (on ROCm PyTorch does not test
        the lower-right variant either). Chunk 0's block is square: its bias runs as plain
        causal attention everywhere."""
        if q.is_cuda and not ROCM:
            return tuple(self._causal[j] for j in self._mine)
        out = []
        for j in self._mine:
            if j == 0:  # a square block: SDPA's plain causal path, no mask at all
                out.append(self._causal[j])
                continue
            keep = self._causal[j]._materialize(q.device)
            out.append(torch.zeros(keep.shape, dtype=q.dtype, device=q.device)
                       .masked_fill_(keep.logical_not(), float("-inf")))
        return tuple(out)

    def _core(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
              masks: tuple) -> torch.Tensor:
        rep = q.shape[1] // k_all.shape[1]
        if rep > 1:
            k_all = k_all.repeat_interleave(rep, dim=1)
            v_all = v_all.repeat_interleave(rep, dim=1)
        out = []
        L = self.chunk
        for j, qj, mask in zip(self._mine, q.split(L, dim=2), masks, strict=True):
            keys = (j + 1) * L  # the causal prefix of chunk j; its last L keys are the diagonal
            out.append(F.scaled_dot_product_attention(qj, k_all[:, :, :keys],
                                                      v_all[:, :, :keys], attn_mask=mask))
        return torch.cat(out, dim=2)


class StandInContextParallel(ContextParallel):
    """CP rank ``index`` of ``cp`` without a process group, for single-process measurements
    (``runtime.memory``): the other ranks' keys/values are random stand-ins of the right shape
    and the backward keeps this rank's rows without summing."""

    def __init__(self, cp: int, index: int, seq_len: int, seed: int = 0) -> None:
        super().__init__(cp, index, seq_len, group=None)
        self._gen = torch.Generator().manual_seed(seed)

    def start_gather(self, x: torch.Tensor) -> tuple:
        parts = [x if k == self.index else
                 torch.randn(x.shape, generator=self._gen).to(x.device, x.dtype)
                 for k in range(self.cp)]
        chunks = [c for p in parts for c in p.split(self.chunk, dim=2)]
        return (torch.cat([chunks[i] for i in self._to_sequence], dim=2),)

    def finish_gather(self, handle: tuple) -> torch.Tensor:
        return handle[0]

    def start_reduce(self, grad: torch.Tensor) -> tuple:
        chunks = grad.split(self.chunk, dim=2)
        return (torch.cat([chunks[c] for c in self._mine], dim=2),)

    def finish_reduce(self, handle: tuple) -> torch.Tensor:
        return handle[0]


def enable_(model: torch.nn.Module, cp: ContextParallel) -> None:
    """Make a ``StageModel`` run on ``cp``'s shard: RoPE at the shard's true positions and
    every attention layer gathering keys/values over the CP group."""
    from hettrain.runtime.model import LlamaAttention
    model.positions = cp.positions
    model._rope.clear()
    for mod in model.modules():
        if isinstance(mod, LlamaAttention):
            mod.cp = cp


def attention_flops_share(cp: int, index: int) -> float:
    """Fraction of the causal attention's query-key pairs computed by CP rank ``index``
    (the load balance: ``1/cp`` for every rank up to the ``O(1/S)`` diagonal terms)."""
    total = (2 * cp) * (2 * cp + 1) / 2
    mine = (index + 1) + (2 * cp - index)
    return mine / total
