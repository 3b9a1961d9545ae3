"""Discrete-event simulation of one job under one repair policy, replaying a :class:`Timeline`.

Policies (``POLICIES``):

- ``restart`` — today's operators: after an interruption wait until the *original* plan fits
  again (a spare or the repaired node takes the failed node's place), then restart it.
- ``replan`` — hettrain: re-plan on the survivors right after detection (``plan_s`` charged),
  restart on the new plan, and grow back to the better plan at the next checkpoint once nodes
  return and the full plan is ``grow_threshold`` faster.
- ``wait-shrink`` — wait for the replacement when the known ETA of the nodes the full plan
  needs is within ``wait_threshold_s``, otherwise shrink like ``replan`` (also while waiting,
  when a further failure pushes the ETA past the threshold); grows back the same way.

Job phases: RUN (training), CKPT (blocking checkpoint write), DETECT (the hang before the
failure is noticed), WAIT (no plan can start), PLAN (re-plan overhead), RESTART (launch and
load), GROW (re-plan + restart of a grow-back). Time in every phase goes to one bucket
(``BUCKETS``); training and checkpoint time since the last completed checkpoint is tentative and
moves to ``lost_work`` when an interruption rolls it back, so the buckets always sum to wall
time. ``degraded_s`` is the part of productive time lost to running below the full plan's
throughput (smaller plan or a straggler): goodput ratio = (productive − degraded) / wall.

Which nodes a plan uses is not tracked node by node: nodes of a pool are identical, so a hit on
``k`` of the ``up`` nodes of a pool whose plan uses ``used`` of them interrupts the job with the
exact probability ``1 − C(up − used, k) / C(up, k)``, decided by the event's common draw ``u``.
Stragglers slow the job by their factor while they last (the slowest node paces a synchronous
step); no policy reacts to them.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from hettrain.sim.capacity import Capacity, CapacityOracle
from hettrain.sim.model import RecoveryModel, SimInputError
from hettrain.sim.timeline import DOWN, SLOW_END, SLOW_START, SOFTWARE, UP, Event, Timeline

POLICIES = ("restart", "replan", "wait-shrink")
BUCKETS = ("productive", "checkpoint", "lost_work", "detection", "waiting", "planning",
           "restart", "grow_back")
RUN, CKPT, DETECT, WAIT, PLAN, RESTART, GROW = ("run", "ckpt", "detect", "wait", "plan",
                                                "restart", "grow")
_BUCKET = {DETECT: "detection", WAIT: "waiting", PLAN: "planning", RESTART: "restart",
           GROW: "grow_back"}
_TIMER = 9  # timers sort after cluster events at the same instant


@dataclass(slots=True)
class PolicyResult:
    """Outcome of one policy on one timeline."""

    policy: str
    seed: int
    wall_s: float
    full_tokens_per_s: float
    checkpoint_interval_s: float
    checkpoint_s: float
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    degraded_s: float = 0.0
    tokens: float = 0.0
    interruptions: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    replans: int = 0
    grow_backs: int = 0
    checkpoints: int = 0
    plan_calls: int = 0
    plan_seconds: float = 0.0
    min_up_nodes: int = 0
    trace: list[tuple[float, float]] = field(default_factory=list)  # (t, tokens/s) steps
    marks: list[tuple[float, str]] = field(default_factory=list)  # (t, cause) interruptions

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive (kept) training time / wall time."""
        return self.time_s["productive"] / self.wall_s

    @property
    def goodput_tokens_per_s(self) -> float:
        """Kept tokens per second of wall time."""
        return self.tokens / self.wall_s

    @property
    def goodput_ratio(self) -> float:
        """Goodput over the full plan's throughput: (productive − degraded) / wall."""
        return self.goodput_tokens_per_s / self.full_tokens_per_s

    @property
    def total_interruptions(self) -> int:
        """Interruptions of training, all causes."""
        return sum(self.interruptions.values())


def hit_probability(up: int, used: int, k: int) -> float:
    """P(at least one of ``k`` distinct nodes drawn from ``up`` is one of the ``used``)."""
    if k <= 0 or used <= 0:
        return 0.0
    if k > up - used:
        return 1.0
    miss = 1.0
    for j in range(k):
        miss *= (up - used - j) / (up - j)
    return 1.0 - miss


class _Job:
    """Mutable state of one policy run."""

    def __init__(self, timeline: Timeline, oracle: CapacityOracle, policy: str,
                 recovery: RecoveryModel, checkpoint_s: float, interval_s: float) -> None:
        if policy not in POLICIES:
            raise SimInputError("--policies", f"unknown policy {policy!r}; choose from "
                                              f"{', '.join(POLICIES)}")
        if interval_s <= 0:
            raise SimInputError("checkpointIntervalSeconds", f"must be > 0 (got {interval_s})")
        self.timeline, self.oracle, self.policy, self.rec = timeline, oracle, policy, recovery
        self.ckpt_s, self.interval_s = checkpoint_s, interval_s
        topo = oracle.topo
        self.up = list(topo.pool_nodes)
        self.returns: list[list[float]] = [[] for _ in topo.pool_nodes]
        self.total_gpus = topo.gpus
        full = oracle.capacity(tuple(self.up))
        if full is None:
            raise SimInputError("job", "no plan fits the healthy cluster; check the job and "
                                       "cluster with 'hettrain plan'")
        self.full: Capacity = full
        self.cap: Capacity = full
        self.pending: Capacity | None = None
        self.calls0, self.secs0 = oracle.plan_calls, oracle.plan_seconds
        self.r = PolicyResult(policy, timeline.seed, timeline.horizon_s, full.tokens_per_s,
                              interval_s, checkpoint_s, min_up_nodes=topo.nodes)
        self.t = 0.0
        self.phase = RUN
        self.seg_work = self.seg_ckpt = self.seg_tokens = self.seg_deg = 0.0
        self.rate = 0.0
        self.slow: dict[int, float] = {}
        self.slow_count: dict[float, int] = {}  # slowdown -> active stragglers (max in O(kinds))
        self.grow_pending = False
        self.waiting_for_full = False
        self.heap: list[tuple[float, int, int, Event | str]] = []
        self.token = 0
        self.timer_token = -1

    # ---------------------------------------------------------- time and timers

    def advance(self, t: float) -> None:
        dt = t - self.t
        if dt < 0:
            raise AssertionError(f"time went backwards: {self.t} -> {t}")
        if self.phase == RUN:
            self.seg_work += dt
            self.seg_tokens += self.rate * dt
            self.seg_deg += dt * (1.0 - self.rate / self.full.tokens_per_s)
        elif self.phase == CKPT:
            self.seg_ckpt += dt
        else:
            self.r.time_s[_BUCKET[self.phase]] += dt
        self.t = t

    def set_rate(self, rate: float) -> None:
        if not self.r.trace or self.r.trace[-1][1] != rate:
            self.r.trace.append((self.t, rate))
        self.rate = rate

    def timer(self, delay: float, what: str) -> None:
        self.token += 1
        self.timer_token = self.token
        if math.isfinite(delay):
            heapq.heappush(self.heap, (self.t + delay, _TIMER, self.token, what))

    def enter(self, phase: str, delay: float, what: str) -> None:
        self.phase = phase
        if phase != RUN:
            self.set_rate(0.0)
        self.timer(delay, what)

    # ---------------------------------------------------------- phases

    def start_run(self) -> None:
        self.phase = RUN
        self.set_rate(self.cap.tokens_per_s / max(self.slow_count, default=1.0))
        self.timer(self.interval_s - self.seg_work, "ckpt_start")

    def commit(self) -> None:
        self.r.time_s["productive"] += self.seg_work
        self.r.time_s["checkpoint"] += self.seg_ckpt
        self.r.tokens += self.seg_tokens
        self.r.degraded_s += self.seg_deg
        self.seg_work = self.seg_ckpt = self.seg_tokens = self.seg_deg = 0.0

    def interrupt(self, cause: str) -> None:
        self.r.time_s["lost_work"] += self.seg_work + self.seg_ckpt
        self.seg_work = self.seg_ckpt = self.seg_tokens = self.seg_deg = 0.0
        self.r.interruptions[cause] = self.r.interruptions.get(cause, 0) + 1
        self.r.marks.append((self.t, cause))
        self.enter(DETECT, self.rec.detection_s, "decide")

    def full_eta(self) -> float:
        """When the full plan fits again, from the known return times of down nodes."""
        eta = self.t
        for p, need in enumerate(self.full.nodes_used):
            short = need - self.up[p]
            if short > 0:
                times = sorted(self.returns[p])
                eta = max(eta, times[short - 1] if short <= len(times) else math.inf)
        return eta

    def restart_full(self) -> None:
        self.cap = self.full
        self.r.restarts += 1
        self.enter(RESTART, self.rec.restart_s, "restart_done")

    def replan(self) -> None:
        cap = self.oracle.capacity(tuple(self.up))
        if cap is None:
            self.enter(WAIT, math.inf, "")
            return
        self.pending = cap
        self.r.replans += 1
        self.enter(PLAN, self.rec.plan_s, "plan_done")

    def decide(self) -> None:
        self.waiting_for_full = False
        if self.policy == "replan":
            self.replan()
            return
        if self.policy == "wait-shrink" and self.full_eta() - self.t > self.rec.wait_threshold_s:
            self.replan()
            return
        if self.full.fits(tuple(self.up)):
            self.restart_full()
        else:
            self.waiting_for_full = True
            self.enter(WAIT, math.inf, "")

    def on_timer(self, what: str) -> None:
        up = tuple(self.up)
        if what == "ckpt_start":
            self.enter(CKPT, self.ckpt_s, "ckpt_done")
        elif what == "ckpt_done":
            self.commit()
            self.r.checkpoints += 1
            if self.grow_pending and self.policy != "restart":
                self.grow_pending = False
                better = self.oracle.capacity(up)
                if better is not None and better.tokens_per_s > self.cap.tokens_per_s * (
                        1.0 + self.rec.grow_threshold):
                    self.pending = better
                    self.r.replans += 1
                    self.r.grow_backs += 1
                    self.enter(GROW, self.rec.plan_s + self.rec.restart_s, "grow_done")
                    return
            self.start_run()
        elif what == "decide":
            self.decide()
        elif what in ("plan_done", "grow_done"):
            assert self.pending is not None
            self.cap, self.pending = self.pending, None
            if not self.cap.fits(up):
                self.decide()
            elif what == "plan_done":
                self.r.restarts += 1
                self.enter(RESTART, self.rec.restart_s, "restart_done")
            else:
                self.r.restarts += 1
                self.start_run()
        elif what == "restart_done":
            if self.cap.fits(up):
                self.start_run()
            else:
                self.decide()

    # ---------------------------------------------------------- cluster events

    def training(self) -> bool:
        return self.phase in (RUN, CKPT)

    def on_event(self, e: Event) -> None:
        if e.kind == DOWN:
            hit = 1.0
            for p, k in e.counts:
                hit *= 1.0 - hit_probability(self.up[p], self.cap.nodes_used[p], k)
            for p, k in e.counts:
                self.up[p] -= k
                self.returns[p].extend([e.until_s] * k)
                if self.up[p] < 0:
                    raise AssertionError(f"negative capacity in pool {p} at {self.t}")
            self.r.min_up_nodes = min(self.r.min_up_nodes, sum(self.up))
            if self.training() and e.u < 1.0 - hit:
                self.interrupt(e.cause)
            elif (self.phase == WAIT and self.waiting_for_full and self.policy == "wait-shrink"
                  and self.full_eta() - self.t > self.rec.wait_threshold_s):
                self.waiting_for_full = False  # the wait got too long: shrink now
                self.replan()
        elif e.kind == UP:
            for p, k in e.counts:
                self.up[p] += k
                for _ in range(k):
                    self.returns[p].remove(e.time_s)  # the DOWN event's until_s
            if self.phase == WAIT:
                if self.policy == "restart" or self.waiting_for_full:
                    if self.full.fits(tuple(self.up)):
                        self.waiting_for_full = False
                        self.restart_full()
                else:
                    self.replan()
            elif self.policy != "restart" and self.cap is not self.full:
                self.grow_pending = True
        elif e.kind == SOFTWARE:
            if self.training() and e.u < self.cap.world_size / self.total_gpus:
                self.interrupt("software")
        elif e.kind == SLOW_START:
            (p, _), = e.counts
            if self.training() and e.u < self.cap.nodes_used[p] / max(1, self.up[p]):
                self.slow[e.ref] = e.slowdown
                self.slow_count[e.slowdown] = self.slow_count.get(e.slowdown, 0) + 1
                if self.phase == RUN:
                    self.set_rate(self.cap.tokens_per_s / max(self.slow_count))
        elif e.kind == SLOW_END:
            ended = self.slow.pop(e.ref, None)
            if ended is not None:
                left = self.slow_count.pop(ended) - 1
                if left:
                    self.slow_count[ended] = left
            if ended is not None and self.phase == RUN:
                self.set_rate(self.cap.tokens_per_s / max(self.slow_count, default=1.0))

    # ---------------------------------------------------------- main loop

    def run(self) -> PolicyResult:
        for i, e in enumerate(self.timeline.events):
            self.heap.append((e.time_s, 0, -len(self.timeline.events) + i, e))
        heapq.heapify(self.heap)
        self.start_run()
        horizon = self.timeline.horizon_s
        while self.heap and self.heap[0][0] < horizon:
            t, prio, token, item = heapq.heappop(self.heap)
            if prio == _TIMER and token != self.timer_token:
                continue  # superseded timer
            self.advance(t)
            if isinstance(item, Event):
                self.on_event(item)
            else:
                self.on_timer(item)
        self.advance(horizon)
        self.commit()  # work since the last checkpoint at the end of the window is kept
        self.r.plan_calls = self.oracle.plan_calls - self.calls0
        self.r.plan_seconds = self.oracle.plan_seconds - self.secs0
        self.set_rate(self.rate)
        self.r.trace.append((horizon, self.rate))
        return self.r


def simulate(timeline: Timeline, oracle: CapacityOracle, policy: str, recovery: RecoveryModel,
             *, checkpoint_s: float, interval_s: float) -> PolicyResult:
    """Replay ``timeline`` for one policy; ``checkpoint_s`` is the write time of one checkpoint
    and ``interval_s`` the training time between checkpoints (``math.inf``: never)."""
    return _Job(timeline, oracle, policy, recovery, checkpoint_s, interval_s).run()
