"""The ``helix`` pipeline schedule: HelixPipe's attention-parallel partition (Zhang et al.,
arXiv 2507.00394), as this project builds it.

At long sequences the attention core (``softmax(q·kᵀ)·v``: quadratic in the sequence, no
parameters) dominates a layer, and a layer-wise pipeline's fill and drain bubble is made of
it. HelixPipe notices that the core need not run where the layer's weights live. Here:

* **Weights**: layer ``k`` belongs to stage ``k mod pp`` (:func:`owner`; one layer per model
  chunk, the interleaved round-robin placement with ``v = layers / pp``, so ``layers`` must
  divide by ``pp``). Stage 0 also holds the embedding, stage ``pp − 1`` the head. Layer by
  layer, a microbatch's bubble is one layer's, not one stage's (1F1B).
* **Actions**: every layer of every microbatch is three forward actions and three backward
  ones: ``Fq`` (norm, q/k/v projections and RoPE; on the owner), ``Fa`` (the core), ``Fo``
  (output projection, residual, MLP; on the owner; the last layer's also runs the head and
  the loss), and ``Bo``, ``Ba``, ``Bq`` in reverse.
* **Attention parallel**: a core runs on its owner or on any stage that would otherwise idle
  (fill, drain, waiting for a neighbour), which then also runs its backward
  (:func:`placement`). A core away from its owner costs two transfers (q/k/v out, the core's
  output back) and their two gradients.

**Order.** :func:`helix_orders` list-schedules the step with the given per-part costs
(:func:`part_costs`: a Llama layer's FLOP split at the model's sequence length) and a hop
time per transfer. Whenever a stage is free it runs, among the actions whose inputs are
there, a backward before a forward, by one of two rules (:data:`RULES`: the highest layer
first, or layer-major within groups of ``pp`` microbatches); with no action of
its own it takes another stage's ready core (when stealing is on). A new microbatch enters
only while fewer than ``pp`` are in flight (entered, last backward not done), and a stage
holds at most ``layers / pp`` cores of other stages at once: every stage holds at most ``pp``
microbatches of its layers (1F1B's stage-0 peak) plus one stage's worth of foreign cores
(:func:`in_flight_bound`). Two variants (:data:`VARIANTS`: layer-major without stealing,
highest layer first with it) are replayed (:func:`makespan`) and the faster kept. The order is
deadlock-free for any real costs: it was realised once with the same dependencies, and the
runtime's sends never block. Messages carry a tag unique to (microbatch, layer, kind), so
matching does not depend on order.

**First in, last out** (``filo``; HelixPipe's own order is a two-fold FILO): every forward
before any backward, layer-major (all microbatches through a layer before the next layer's),
then the backwards from the last layer, the latest microbatch first; no entry cap, so every
stage holds all ``m`` microbatches of its layers at the peak (the paper pairs it with
attention-free recompute). With one layer per chunk its fill and drain are one layer's, and a
hop is hidden behind the other microbatches of the same layer, so where ``m > pp`` it replays
far faster than the capped orders (llama3-8b at 32k, pp 4, m 16: 1.03 of the ideal against
1.21 at a hop of 0.2 layer-forwards). HelixPipe's two folds (microbatches in pairs, each
pair's transfers overlapping the other's compute) replayed no faster here than one fold:
the list scheduler already overlaps transfers with whatever is ready.

Pinned (``schedule: helix``; ``auto`` leaves it out), the planner searches it where
microbatches are scarce (``m ≤ 4·pp``,
:data:`MAX_MICROBATCHES_PER_STAGE`), both orders (capped and FILO, each with its own memory),
prices its replayed bubble (:func:`bubble_divisor`) with the hop the plan then carries
(``plan.helix_hop``, ``plan.helix_filo``), and bounds its memory without building it
(:func:`in_flight_bound`). Pure Python (no torch): the runtime (``runtime/helix.py``)
executes the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from hettrain.planning.replay import replay

HelixAction = tuple[str, int, int]  # (kind, microbatch, layer)
FORWARD = ("Fq", "Fa", "Fo")
BACKWARD = ("Bo", "Ba", "Bq")
KINDS = FORWARD + BACKWARD
# backward costs twice the forward (two GEMMs per forward GEMM; the attention kernel's
# backward likewise about twice its forward)
BACKWARD_FACTOR = 2.0


def owner(layer: int, pp: int) -> int:
    """The stage that holds layer ``layer``'s weights."""
    return layer % pp


def check_layout(layers: int, pp: int, m: int) -> None:
    """Raise ``ValueError`` naming the field when the helix partition cannot hold."""
    if pp < 1:
        raise ValueError(f"plan.pp={pp}: must be >= 1")
    if m < 1:
        raise ValueError(f"plan.num_microbatches={m}: must be >= 1")
    if layers < 1 or layers % pp:
        raise ValueError(f"model.layers={layers} must be a positive multiple of plan.pp={pp} "
                         "for the helix schedule (one layer per stage in turn); pick a pp "
                         "that divides the layers or another schedule")


MAX_MICROBATCHES_PER_STAGE = 4  # helix is searched where m ≤ 4·pp (module docstring)


def in_flight_bound(pp: int, m: int, filo: bool = False) -> float:
    """Activations a stage holds at most, in microbatches of its whole stage: ``min(pp, m)``
    of its own layers (the entry cap; first-in-last-out, ``filo``: all ``m``) and, with
    ``pp > 1``, one stage's worth more. For the capped orders that is other stages' cores
    (each counted as a whole layer: an upper bound). The FILO order moves no core
    (:data:`FILO_VARIANTS`), but its peak is its first backward, with every microbatch
    still held: charged ``m`` alone, the CPU measurement (which counts what the backward
    saves too) exceeded the plan by up to 4.3%, the MLP backward's recompute of its
    activation (``runtime.model._ActDown``) on top of the held microbatches; the margin
    covers it (docs/planning.md §Known limits). Independent of the costs, so the planner's
    memory needs no order."""
    return float(m if filo else min(pp, m)) + (1.0 if pp > 1 else 0.0)


def quantize_hop(hop: float) -> float:
    """A hop time (in the per-part cost units) rounded to one significant digit (few
    distinct orders to build): what the plan carries (``plan.helix_hop``) and both sides
    build the order with."""
    if hop <= 0:
        return 0.0
    return float(f"{hop:.1g}")


def part_costs(seq_len: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int,
               gated_mlp: bool = True) -> dict[str, float]:
    """Relative forward and backward durations of a layer's three parts, from their FLOPs
    per token: ``Fq`` the q/k/v projections, ``Fa`` the causal core (half of ``4·s·h``),
    ``Fo`` the output projection and the MLP; backward ``2×``."""
    head_dim = hidden // heads
    q = 2 * hidden * (heads + 2 * kv_heads) * head_dim
    a = 2 * seq_len * hidden  # causal: half of 4·s·h
    o = 2 * hidden * hidden + (3 if gated_mlp else 2) * 2 * hidden * ffn_hidden
    total = q + a + o
    fwd = {"Fq": q / total, "Fa": a / total, "Fo": o / total}
    return {**fwd, **{"B" + k[1]: BACKWARD_FACTOR * v for k, v in fwd.items()}}


def costs_for(model) -> dict[str, float]:
    """:func:`part_costs` of a model (``api.spec.ModelSpec``) at its sequence length: what
    the planner prices and the runtime orders with (both must build the same order)."""
    return part_costs(model.seq_len, model.hidden, model.heads, model.kv_heads,
                      model.ffn_hidden, model.gated_mlp)


def message_shapes(model, micro_batch: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    """The tensor each message carries, by payload (its gradient has the same shape):
    ``hidden`` a layer's output ``(b, s, h)``, ``qkv`` the packed q/k/v
    ``(b, heads + 2·kv_heads, s, head_dim)`` and ``core`` a core's output
    ``(b, heads, s, head_dim)``."""
    b, s, d = micro_batch, seq_len, model.head_dim
    return {"hidden": (b, s, model.hidden), "qkv": (b, model.heads + 2 * model.kv_heads, s, d),
            "core": (b, model.heads, s, d)}


def _deps(action: HelixAction, layers: int) -> list[HelixAction]:
    kind, j, k = action
    if kind == "Fq":
        return [("Fo", j, k - 1)] if k else []
    if kind == "Fa":
        return [("Fq", j, k)]
    if kind == "Fo":
        return [("Fa", j, k)]
    if kind == "Bo":
        return [("Fo", j, k)] if k == layers - 1 else [("Bq", j, k + 1)]
    if kind == "Ba":
        return [("Bo", j, k)]
    return [("Ba", j, k)]  # Bq


def _dependents(action: HelixAction, layers: int) -> list[HelixAction]:
    kind, j, k = action
    nxt = {"Fq": [("Fa", j, k)], "Fa": [("Fo", j, k)],
           "Fo": [("Fq", j, k + 1)] if k < layers - 1 else [("Bo", j, k)],
           "Bo": [("Ba", j, k)], "Ba": [("Bq", j, k)],
           "Bq": [("Bo", j, k - 1)] if k else []}
    return nxt[kind]


def _priority(action: HelixAction, pp: int, rule: str) -> tuple:
    """``depth`` and ``layer``: backwards before forwards. ``depth``: the highest layer first
    (forwards: the microbatch furthest along; backwards: the one closest to the loss), then
    the earliest microbatch; ``layer``: the earliest group of ``pp`` microbatches,
    layer-major within it (forwards from the first layer, backwards from the last).
    ``filo``: forwards before backwards, layer-major (the lowest layer, then the earliest
    microbatch); backwards from the last layer, the latest microbatch first."""
    kind, j, k = action
    back = kind in BACKWARD
    if rule == "depth":
        return (0 if back else 1, -k, j)
    if rule == "filo":
        return (1, -k, -j) if back else (0, k, j)
    return (0, j // pp, -k, j) if back else (1, j // pp, k, j)


RULES = ("depth", "layer", "filo")
# the variants built with at most ``pp`` microbatches in flight: of the four (rule ×
# stealing) these two lose 0.01% on average (1.6% at most) to the best of all four, on
# llama3-8b/70b shapes at 4k-128k, pp 2-16, m ≤ 4·pp, hops 0-0.5 layer-forwards (measured
# when the schedule was added)
VARIANTS = (("layer", False), ("depth", True))
# the variant built first-in-last-out (every microbatch in flight): without stealing cores,
# which never won in the same grid (pp 8, m 8, hop 0: 1.22 of the ideal without, 1.27 with;
# equal from hop 0.2 on), so a stage holds no other stage's core
FILO_VARIANTS = (("filo", False),)


def helix_orders(pp: int, layers: int, m: int, costs: Mapping[str, float],
                 hop: float = 0.0, filo: bool = False) -> tuple[tuple[HelixAction, ...], ...]:
    """Every stage's ordered actions (module docstring): the fastest of the list-scheduled
    variants under ``costs`` (kind → duration, every stage alike) and ``hop`` per transfer
    between stages; ``filo``: of the first-in-last-out ones (every microbatch in flight,
    :data:`FILO_VARIANTS`), else of those with at most ``pp`` in flight (:data:`VARIANTS`)."""
    check_layout(layers, pp, m)
    frozen = _freeze([costs] * pp)
    return _best(pp, layers, m, frozen, round(float(hop), 12), bool(filo))


@lru_cache(maxsize=512)
def _best(pp: int, layers: int, m: int, frozen: tuple[tuple[float, ...], ...],
          hop: float, filo: bool = False) -> tuple[tuple[HelixAction, ...], ...]:
    per = [dict(zip(KINDS, row, strict=True)) for row in frozen]
    cap = m if filo else pp  # microbatches in flight
    best = None
    for rule, steal in FILO_VARIANTS if filo else VARIANTS:
        orders = _orders(pp, layers, m, frozen, cap, hop, rule, steal)
        t = makespan(orders, layers, per, hop)
        if best is None or t < best[0] - 1e-12:
            best = (t, orders)
    return best[1]


def bubble_divisor(pp: int, layers: int, m: int, costs: Mapping[str, float],
                   hop: float = 0.0, filo: bool = False) -> float:
    """What the order (``filo``: the first-in-last-out one) divides 1F1B's bubble by, for
    ``pp`` equal stages: 1F1B runs ``(m + pp − 1)`` stage passes, the helix order ``m`` plus
    ``(pp − 1)/divisor``."""
    check_layout(layers, pp, m)
    if pp == 1:
        return 1.0
    return _bubble_divisor(pp, layers, m, _freeze([costs]), round(float(hop), 12), bool(filo))


@lru_cache(maxsize=1024)
def _bubble_divisor(pp: int, layers: int, m: int, frozen: tuple[tuple[float, ...], ...],
                    hop: float, filo: bool = False) -> float:
    costs = dict(zip(KINDS, frozen[0], strict=True))
    per_layer = sum(costs[k] for k in KINDS)
    stage = per_layer * layers / pp  # one microbatch through one stage, forward + backward
    t = makespan(helix_orders(pp, layers, m, costs, hop, filo), layers, [costs] * pp, hop)
    bubble = max(t - m * stage, 1e-12 * stage)
    return (pp - 1) * stage / bubble


def _freeze(per: list[Mapping[str, float]]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(c[k]) for k in KINDS) for c in per)


@lru_cache(maxsize=256)
def _orders(pp: int, layers: int, m: int, frozen: tuple[tuple[float, ...], ...],
            cap: int, hop: float, rule: str,
            steal: bool) -> tuple[tuple[HelixAction, ...], ...]:
    if cap < 1:
        raise ValueError(f"helix cap={cap}: must be >= 1")
    dur = [dict(zip(KINDS, row, strict=True)) for row in frozen]
    place: dict[tuple[int, int], int] = {}  # (microbatch, layer) -> stage of its core
    # per stage: candidates (priority, ready time, action) whose dependency is done; a ready
    # core (Fa) waits in its owner's ``pool``, where the owner, or an idle stage, takes it
    ready: list[list[tuple[tuple, float, HelixAction]]] = [[] for _ in range(pp)]
    pool: list[list[tuple[tuple, float, HelixAction]]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    orders: list[list[HelixAction]] = [[] for _ in range(pp)]
    entered = 0  # microbatches whose first action ran (stage 0 enters them in order)
    finish_times: list[float] = []  # ascending: every last backward (Bq of layer 0) is stage 0's
    foreign = [0] * pp  # cores a stage holds for other stages (Fa run, Ba not yet)
    foreign_cap = max(1, layers // pp)
    inf = float("inf")

    def entry_time() -> float:
        """Earliest time stage 0 may enter the next microbatch (the cap), inf: not yet."""
        if entered >= m:
            return inf
        need = entered - cap + 1  # microbatches that must have finished first
        if need <= 0:
            return free[0]
        return max(free[0], finish_times[need - 1]) if len(finish_times) >= need else inf

    # earliest ready time per stage: of its own candidates and cores; of its cores alone
    head, pool_head = [inf] * pp, [inf] * pp

    def refresh(x: int) -> None:
        pool_head[x] = min((c[1] for c in pool[x]), default=inf)
        head[x] = min(pool_head[x], min((c[1] for c in ready[x]), default=inf))

    remaining = 6 * m * layers
    while remaining:
        stolen = (min(pool_head) + hop) if steal else inf
        best_t, s = inf, -1
        for x in range(pp):
            t = min(head[x], stolen) if foreign[x] < foreign_cap else head[x]
            if x == 0:
                t = min(t, entry_time())
            t = max(free[x], t)
            if t < best_t:
                best_t, s = t, x
        if s < 0:
            raise RuntimeError(f"helix order deadlocks for pp={pp}, layers={layers}, m={m}, "
                               f"cap={cap}")
        t = best_t
        cands = [c for c in ready[s] if c[1] <= t] + [c for c in pool[s] if c[1] <= t]
        if s == 0 and entry_time() <= t:
            cands.append((_priority(("Fq", entered, 0), pp, rule), t, ("Fq", entered, 0)))
        if not cands:  # idle: take another stage's ready core
            cands = [c for x in range(pp) if x != s for c in pool[x] if c[1] + hop <= t]
            foreign[s] += 1
        pick = min(cands, key=lambda c: c[0])
        kind, j, k = action = pick[2]
        if kind == "Fq" and k == 0:  # the cap's entry (never in ready)
            entered += 1
        elif kind == "Fa":
            pool[owner(k, pp)].remove(pick)
            place[(j, k)] = s
            refresh(owner(k, pp))
        else:
            ready[s].remove(pick)
            refresh(s)
            if kind == "Ba" and owner(k, pp) != s:
                foreign[s] -= 1
        end = t + dur[s][kind]
        free[s] = end
        orders[s].append(action)
        remaining -= 1
        if kind == "Bq" and k == 0:
            finish_times.append(end)
        for nxt in _dependents(action, layers):  # each part has one dependency: ready now
            at = _stage_of(nxt, pp, place)
            if at is None:  # a core: into its owner's pool (q/k/v leave with it if stolen)
                o = owner(k, pp)
                pool[o].append((_priority(nxt, pp, rule), end, nxt))
                pool_head[o] = min(pool_head[o], end)
                head[o] = min(head[o], end)
            else:  # a result that leaves this stage arrives ``hop`` later
                when = end + (hop if at != s else 0.0)
                ready[at].append((_priority(nxt, pp, rule), when, nxt))
                head[at] = min(head[at], when)
    return tuple(tuple(o) for o in orders)


def _stage_of(action: HelixAction, pp: int, place: Mapping[tuple[int, int], int]) -> int | None:
    """Where ``action`` runs: an unplaced core (Fa) is None."""
    kind, j, k = action
    if kind == "Fa":
        return None
    if kind == "Ba":
        return place[(j, k)]
    return owner(k, pp)


def placement(orders: Sequence[Sequence[HelixAction]]) -> dict[tuple[int, int], int]:
    """``(microbatch, layer)`` → the stage that runs that attention core (read from the
    orders: the scheduler places each core on its owner or on a stage that would idle)."""
    return {(j, k): s for s, actions in enumerate(orders) for kind, j, k in actions
            if kind == "Fa"}


def makespan(orders: Sequence[Sequence[HelixAction]], layers: int,
             stage_costs: Sequence[Mapping[str, float]],
             hop_s: float = 0.0) -> float:
    """Replay per-stage action lists with ``stage_costs[s][kind]`` seconds per action and
    ``hop_s`` seconds for every transfer between different stages (:func:`timed`); returns
    the makespan. Raises ``RuntimeError`` on a deadlock."""
    times = timed(orders, layers, lambda a, s: stage_costs[s][a[0]], hop_s)
    return max((end for _, _, end in times.values()), default=0.0)


def timed(orders: Sequence[Sequence[HelixAction]], layers: int,
          duration: Callable[[HelixAction, int], float],
          hop_s: float = 0.0) -> dict[HelixAction, tuple[int, float, float]]:
    """``{action: (stage, start, end)}`` of the orders replayed (:func:`replay.replay`) with
    ``duration(action, stage)`` seconds each and ``hop_s`` per transfer between stages."""
    where = {a: s for s, actions in enumerate(orders) for a in actions}
    return replay(orders, lambda a, s: _deps(a, layers), duration,
                  lambda d, s: hop_s if where[d] != s else 0.0)


def transfers(orders: Sequence[Sequence[HelixAction]], layers: int) -> dict[str, int]:
    """Messages one step sends between different stages, by payload: ``hidden`` (a layer's
    output to the next layer's owner, and its gradient back), ``qkv`` (q/k/v to a core away
    from its owner, and their gradient back) and ``core`` (that core's output, and its
    gradient)."""
    pp = len(orders)
    m = 1 + max(j for actions in orders for _, j, _ in actions)
    hidden = sum(1 for k in range(layers - 1) if owner(k, pp) != owner(k + 1, pp)) * m
    remote = sum(1 for (_, k), s in placement(orders).items() if s != owner(k, pp))
    return {"hidden": 2 * hidden, "qkv": 2 * remote, "core": 2 * remote}
