"""The ``helix`` schedule executed for real (HelixPipe's attention-parallel partition; the
order and placement come from :mod:`hettrain.planning.helix`).

The stage model holds one decoder layer per model chunk, layer ``k`` on stage ``k mod pp``
(:func:`hettrain.planning.layers.chunk_layer_ranges` with ``virtual_stages = layers / pp``).
Each layer runs as three separately differentiated parts: :func:`pre_attention` (input norm,
q/k/v projections, RoPE) and :func:`post_attention` (output projection, residual, norm, MLP,
residual) on the owner, and :func:`attention_core` (causal softmax attention, no parameters)
on the stage :func:`hettrain.planning.helix.placement` names: the owner, or a stage that
would otherwise idle. The parts compose to ``LlamaDecoderLayer`` exactly (same operations in
the same order; ``tests/runtime/training/test_helix.py`` checks it against the
single-process reference).

Each part's input is a leaf: a part's backward yields its input gradient, which goes to the
part that produced the input (another stage: a message; this stage: handed over in memory).
The layer input ``x`` feeds both ``pre_attention`` and the residual of ``post_attention``; its
gradient is complete after ``Bq`` and only then leaves for the previous layer's owner.

Transfers: every message (a layer output, q/k/v, a core output, or their gradients) is cast
to the plan's precision and travels host-staged over the gloo world group with a tag unique
to ``(microbatch, layer, payload)`` (:func:`message_tag`), so matching never depends on order;
q/k/v and core outputs (and their gradients) travel token-major, the layout
:func:`pre_attention` packs them in.
Sends never block (``isend``; the host copies of finished ones are dropped after each part)
and each stage receives in its own order, which the planner's list scheduler realised once
with the same dependencies: no deadlock. The stage times it reports for closed-loop
calibration are every part it ran (the cores it took from other stages included, embedding
and head too), per microbatch. Recompute follows the
plan: ``attention-free`` and ``full`` checkpoint the two parameter parts (the core's output is
kept), ``selective`` and ``full`` the core.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hettrain.planning import helix as order
from hettrain.planning.plan import Plan
from hettrain.runtime.collectives import Tier, tier_of
from hettrain.runtime.collectives.p2p import (
    ACTIVATION,
    GRADIENT,
    drain,
    to_device,
    to_host,
    wire_dtype,
)
from hettrain.runtime.model import _attention_core, apply_rope, rerun_contexts

# payloads of a message; each has an activation and a gradient direction
HIDDEN, QKV, CORE = 0, 2, 4
TAG_BASE = 1 << 20  # above every pipeline stream tag (``p2p.stream_tag``)


def message_tag(mb: int, layer: int, layers: int, payload: int, grad: bool) -> int:
    """The tag of the one message of ``payload`` (its gradient when ``grad``) for microbatch
    ``mb`` at layer ``layer`` (a layer output: the producing layer's index)."""
    return TAG_BASE + (mb * layers + layer) * 6 + payload + int(grad)


def plan_costs(plan: Plan) -> dict[str, float]:
    """The per-part costs the planner and this runtime both build the order with."""
    return order.costs_for(plan.model)


def pre_attention(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Norm, q/k/v projections and RoPE of ``layer``: ``(batch, heads + 2·kv_heads, seq,
    head_dim)`` (q, then k, then v), laid out token-major in memory (``(batch, seq, heads,
    head_dim)`` transposed) like the whole layer's q/k/v: the attention kernel's output then
    follows that layout and the output projection reshapes it without a copy (a head-major
    pack cost a hidden-sized copy per layer and microbatch, measured)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    b, t, _ = h.shape
    q = attn.q_proj(h).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(h).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)
    parts = (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    return torch.cat([p.transpose(1, 2) for p in parts], dim=2).transpose(1, 2)


def attention_core(qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The causal attention core of packed q/k/v: ``(batch, heads, seq, head_dim)``."""
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
    return _attention_core(q, k, v)


def post_attention(layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, norm, MLP and residual of ``layer``: the layer's output."""
    b, heads, t, d = y.shape
    x = x + layer.self_attn.o_proj(y.transpose(1, 2).reshape(b, t, heads * d))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def check_stage(plan: Plan, stage: int) -> None:
    """Raise ``ValueError`` naming the field when ``stage`` cannot run the helix schedule."""
    st = plan.stages[stage]
    if st.tp != 1 or st.cp != 1:
        raise ValueError(f"plan.stages[{stage}]: tp={st.tp}, cp={st.cp}; the helix schedule "
                         "runs stages without tensor or context parallelism")


class HelixRunner:
    """One step of the helix schedule on one stage (built by ``StageRunner``)."""

    def __init__(self, plan: Plan, rank: int, model: torch.nn.Module, stats=None,
                 p2p_stats=None) -> None:
        self.plan, self.rank, self.model, self.stats = plan, rank, model, stats
        self.p2p_stats = p2p_stats
        me = plan.ranks[rank]
        self.me, self.stage, self.pp = me, me.stage, plan.pp
        self.layers = plan.model.layers
        order.check_layout(self.layers, self.pp, plan.num_microbatches)
        want = [(k, k + 1) for k in range(self.stage, self.layers, self.pp)]
        if list(model.chunks) != want:
            raise ValueError(f"stage {self.stage} holds chunks {list(model.chunks)}; the helix "
                             f"schedule needs one layer per chunk, {want} (plan.virtual_stages="
                             f"{self.layers // self.pp} and {self.layers // self.pp} layers on "
                             "every stage)")
        check_stage(plan, self.stage)
        param = next(model.parameters())
        self.device, self.act_dtype = param.device, param.dtype
        self.wire = wire_dtype(plan.training.precision)
        # the ranks of this rank's replica, by stage (messages stay inside one replica)
        self.peer = {r.stage: r.rank for r in plan.ranks
                     if (r.dp, r.tp, r.cp) == (me.dp, me.tp, me.cp)}
        self.costs = plan_costs(plan)
        mode = plan.training.recompute
        self.ckpt_parts = mode in ("attention-free", "full")
        self.ckpt_core = mode in ("selective", "full")
        self.last_compute_s = self.last_layers_s = self.last_p2p_s = 0.0
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._p2p_s = 0.0

    # ------------------------------------------------------------------ transport

    def _tier(self, peer: int) -> Tier:
        return tier_of((self.me, self.plan.ranks[peer]))

    def _send(self, t: torch.Tensor, stage: int, tag: int, layer: int, kind: int) -> None:
        t0 = time.perf_counter()
        part = to_host(t.detach().to(self.wire).contiguous())
        peer = self.peer[stage]
        self._pending.append((dist.isend(part, dst=peer, tag=tag), part))
        nbytes = part.numel() * part.element_size()
        if self.p2p_stats is not None:
            entry = self.p2p_stats.get_stats(layer, kind)
            entry.bytes += nbytes
            entry.messages += 1
            entry.route = "world"
        if self.stats is not None:
            self.stats.add(self._tier(peer), nbytes, time.perf_counter() - t0)
        self._p2p_s += time.perf_counter() - t0

    def _recv(self, shape: tuple[int, ...], stage: int, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(math.prod(shape), dtype=self.wire)
        peer = self.peer[stage]
        dist.irecv(buf, src=peer, tag=tag).wait()
        if self.stats is not None:
            self.stats.add(self._tier(peer), 0, time.perf_counter() - t0)
        self._p2p_s += time.perf_counter() - t0
        return to_device(buf.view(shape), self.device).to(self.act_dtype)

    def _new_state(self) -> dict:
        """The dict that holds each part's tensors for its backward (a step's)."""
        return {}

    # ------------------------------------------------------------------ one step

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float) -> float:
        """Forward+backward every microbatch in the helix order; gradients accumulate in the
        model's ``.grad``. Returns the sum of unscaled microbatch losses (the head's stage)."""
        m, L, pp, me = len(batches), self.layers, self.pp, self.stage
        orders = order.helix_orders(pp, L, m, self.costs, self.plan.helix_hop,
                                    self.plan.helix_filo)
        place = order.placement(orders)
        spec, model = self.plan.model, self.model
        b, t = batches[0][0].shape
        heads, kvh = spec.heads, spec.kv_heads
        by_name = order.message_shapes(spec, b, t)
        shapes = {HIDDEN: by_name["hidden"], QKV: by_name["qkv"], CORE: by_name["core"]}
        local: dict[int, torch.Tensor] = {}  # messages between parts on this stage
        state = self._new_state()  # what each part keeps for its backward
        total = 0.0

        def tag(j: int, k: int, payload: int, grad: bool) -> int:
            return message_tag(j, k, L, payload, grad)

        def put(x: torch.Tensor, stage: int, j: int, k: int, payload: int, grad: bool) -> None:
            key = tag(j, k, payload, grad)
            if stage == me:
                local[key] = x.detach()
            else:  # q/k/v and core outputs travel token-major (the layout pre_attention packs)
                wire = x.transpose(1, 2) if payload in (QKV, CORE) else x
                self._send(wire, stage, key, k, GRADIENT if grad else ACTIVATION)

        def take(stage: int, j: int, k: int, payload: int, grad: bool) -> torch.Tensor:
            key = tag(j, k, payload, grad)
            if stage == me:
                return local.pop(key)
            if payload in (QKV, CORE):
                b_, heads_, t_, d_ = shapes[payload]
                return self._recv((b_, t_, heads_, d_), stage, key).transpose(1, 2)
            return self._recv(shapes[payload], stage, key)

        def run_part(fn: Callable, ckpt: bool, *args) -> torch.Tensor:
            if ckpt:
                return checkpoint(fn, *args, use_reentrant=False, context_fn=rerun_contexts())
            return fn(*args)

        def layer(k: int) -> torch.nn.Module:
            return model.model.layers[str(k)]

        def fq(j: int, k: int) -> None:
            emb = None
            if k == 0:
                emb = model.model.embed_tokens(batches[j][0])
                x = emb.detach().requires_grad_()
            else:
                x = take(order.owner(k - 1, pp), j, k - 1, HIDDEN, False).requires_grad_()
            cos, sin = model._cos_sin(x)
            qkv = run_part(pre_attention, self.ckpt_parts, layer(k), x, cos, sin)
            put(qkv, place[(j, k)], j, k, QKV, False)
            state[("q", j, k)] = (x, qkv, emb)

        def fa(j: int, k: int) -> None:
            qkv = take(order.owner(k, pp), j, k, QKV, False).requires_grad_()
            y = run_part(attention_core, self.ckpt_core, qkv, heads, kvh)
            put(y, order.owner(k, pp), j, k, CORE, False)
            state[("a", j, k)] = (qkv, y)

        def fo(j: int, k: int) -> None:
            nonlocal total
            y = take(place[(j, k)], j, k, CORE, False).requires_grad_()
            x = state[("q", j, k)][0]
            out = run_part(post_attention, self.ckpt_parts, layer(k), x, y)
            if k == L - 1:
                loss = model.loss(model.head_output(model.model.norm(out)), batches[j][1])
                total += loss.item()
                out = loss * loss_scale
            else:
                put(out, order.owner(k + 1, pp), j, k, HIDDEN, False)
            state[("o", j, k)] = (y, out)

        def bo(j: int, k: int) -> None:
            y, out = state.pop(("o", j, k))
            grad = None if k == L - 1 else take(order.owner(k + 1, pp), j, k, HIDDEN, True)
            out.backward(grad)
            put(y.grad, place[(j, k)], j, k, CORE, True)

        def ba(j: int, k: int) -> None:
            qkv, y = state.pop(("a", j, k))
            y.backward(take(order.owner(k, pp), j, k, CORE, True))
            put(qkv.grad, order.owner(k, pp), j, k, QKV, True)

        def bq(j: int, k: int) -> None:
            x, qkv, emb = state.pop(("q", j, k))
            qkv.backward(take(place[(j, k)], j, k, QKV, True))
            if emb is not None:
                emb.backward(x.grad)
            else:
                put(x.grad, order.owner(k - 1, pp), j, k - 1, HIDDEN, True)

        ops = {"Fq": fq, "Fa": fa, "Fo": fo, "Bo": bo, "Ba": ba, "Bq": bq}
        self._p2p_s, busy = 0.0, 0.0
        for kind, j, k in orders[me]:
            t0 = time.perf_counter()
            ops[kind](j, k)
            busy += time.perf_counter() - t0
            # a per-layer schedule sends layers·m messages a step: keep only those in flight
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        if state or local:
            raise RuntimeError(f"helix stage {me}: step ended with unconsumed state "
                               f"{sorted(state)[:4]} / messages {sorted(local)[:4]}")
        # every part this stage ran (its own, and the cores it took from other stages),
        # embedding and head included: what the stage's device was busy with
        self.last_compute_s = max(0.0, busy - self._p2p_s) / m
        self.last_layers_s = self.last_compute_s
        self.last_p2p_s = self._p2p_s + drain(self._pending)
        return total
