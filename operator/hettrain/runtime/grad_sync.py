"""Data-parallel gradient sync overlapped with the backward, in buckets (DDP-style).

The stage's fp32 main grads are one flat buffer (``runtime/optim.py``), parameters laid out in
``named_parameters`` order. :class:`BucketedGradSync` cuts it into contiguous buckets of about
``bucket_bytes``, built in REVERSE parameter order (the backward produces the last layers'
gradients first), and launches an asynchronous all-reduce of a bucket as soon as every
gradient in it is final for the step:

- a parameter's gradient is final after its ``expected``-th accumulation of the step (one per
  microbatch backward through its chunk: ``num_microbatches``), so earlier microbatches only
  accumulate and the collectives run during the LAST microbatch's backward of the stage;
- an accumulation is reported by ``optim._fold_into_main_grad`` (the post-accumulate-grad hook
  that folds ``.grad`` into ``main_grad``) and, under ZB-H1, by the W pass
  (``model.WeightGradStore.flush``), which adds deferred weight gradients straight into
  ``main_grad``: both call ``param.main_grad_ready(param)``. Under ZB-H1 a linear weight is
  therefore final after its last W, the other parameters after their last B;
- buckets launch strictly in bucket order (bucket ``k`` only after ``0..k-1``), so every DP
  rank issues the same collectives in the same order on the group;
- :meth:`finish` (before clipping and the optimizer) launches whatever is still pending (a
  parameter that got no gradient this step), waits on EVERY handle in order and averages each
  bucket: nothing reads a gradient before its all-reduce has completed.

The reduction is the same sum as the synchronous path (``HetCommunicator.dp_all_reduce_``,
fp32, then divided by the group size), per bucket instead of over the whole buffer: with two
replicas the result is bitwise identical; with more, the collective's own summation order
per element may differ in the last bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from hettrain.planning.cost import DP_BUCKET_BYTES as DEFAULT_BUCKET_BYTES  # torch DDP's 25 MiB


class Work(Protocol):
    """An in-flight collective (``torch.distributed.Work`` or a test double)."""

    def wait(self) -> object: ...


def bucket_ranges(segments: Sequence[tuple[int, int]], elem_bytes: int,
                  bucket_bytes: int) -> list[tuple[int, int, list[int]]]:
    """Buckets over a flat buffer whose parameters occupy ``segments`` (ascending, contiguous
    ``[start, end)``): ``(start, end, parameter indices)`` per bucket in launch order, i.e.
    filled from the LAST parameter backwards; a bucket closes once it holds at least
    ``bucket_bytes`` (so one parameter larger than that is a bucket of its own, with whatever
    follows it). Every parameter is in exactly one bucket; the buckets tile
    ``[segments[0].start, segments[-1].end)``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[tuple[int, int, list[int]]] = []
    members: list[int] = []
    size = 0
    for i in range(len(segments) - 1, -1, -1):
        a, b = segments[i]
        members.append(i)
        size += (b - a) * elem_bytes
        if size >= bucket_bytes:
            out.append((segments[members[-1]][0], segments[members[0]][1], members))
            members, size = [], 0
    if members:
        out.append((segments[members[-1]][0], segments[members[0]][1], members))
    return out


class BucketedGradSync:
    """Overlapped, bucketed all-reduce of one stage's flat fp32 main grads (module doc).

    ``launch(view)`` starts the (sum) all-reduce of a bucket view in place and returns its
    handle; ``group_size`` divides the result (the average over the DP group). ``account(bytes,
    seconds)`` receives each bucket's bytes and, from :meth:`finish`, the seconds the step
    waited for the collectives after the backward (the exposed part)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], segments: Sequence[tuple[int, int]],
                 main_grad: torch.Tensor, launch: Callable[[torch.Tensor], Work],
                 group_size: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 account: Callable[[int, float], None] | None = None,
                 wire_bytes: Callable[[int], int] | None = None) -> None:
        if len(params) != len(segments):
            raise ValueError("one segment per parameter")
        self.main_grad, self.launch_fn, self.group_size = main_grad, launch, group_size
        self.account, self.wire_bytes = account, wire_bytes
        self.buckets = bucket_ranges(segments, main_grad.element_size(), bucket_bytes)
        self._bucket_of = [0] * len(params)
        for k, (_, _, members) in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = k
        self._index = {id(p): i for i, p in enumerate(params)}
        for p in params:
            p.main_grad_ready = self._ready
        self._expected: int | None = None
        self._counts = [0] * len(params)
        self._pending: list[int] = []
        self._next = 0
        self._work: list[tuple[int, Work]] = []
        # per step, for tests and the rank summary: buckets launched before finish() (during
        # the backward) and the seconds finish() waited
        self.launched_early = 0
        self.wait_s = 0.0

    def begin(self, expected: int) -> None:
        """Arm for one step: each parameter's gradient is final after ``expected``
        accumulations (the microbatches of the step on this stage)."""
        if expected < 1:
            raise ValueError(f"expected accumulations must be >= 1, got {expected}")
        if self._work:
            raise RuntimeError("begin() before the previous step's finish()")
        self._expected = expected
        self._counts = [0] * len(self._counts)
        self._pending = [len(m) for _, _, m in self.buckets]
        self._next = 0
        self.launched_early = 0

    def _ready(self, p: torch.Tensor) -> None:
        """One accumulation of ``p``'s gradient into ``main_grad`` happened."""
        if self._expected is None:
            return  # not armed (a backward outside a training step)
        i = self._index[id(p)]
        self._counts[i] += 1
        if self._counts[i] != self._expected:
            return
        self._pending[self._bucket_of[i]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self.launched_early += 1

    def _launch(self, k: int) -> None:
        a, b, _ = self.buckets[k]
        view = self.main_grad[a:b]
        self._work.append((k, self.launch_fn(view)))
        self._next = k + 1
        if self.account is not None:
            nbytes = view.numel() * view.element_size()
            self.account(self.wire_bytes(nbytes) if self.wire_bytes else nbytes, 0.0)

    def finish(self) -> None:
        """Launch the buckets still pending, wait on every handle in order, average. After
        this every bucket of ``main_grad`` holds the group's mean gradient."""
        t0 = time.perf_counter()
        while self._next < len(self.buckets):
            self._launch(self._next)
        for k, work in self._work:
            work.wait()
            a, b, _ = self.buckets[k]
            if self.group_size > 1:
                self.main_grad[a:b].div_(self.group_size)
        self._work = []
        self._expected = None
        self.wait_s = time.perf_counter() - t0
        if self.account is not None:
            self.account(0, self.wait_s)


class Completed:
    """A collective that is already complete (a stand-in DP group has no peers to wait for)."""

    def wait(self) -> None:
        return None


class UnitGradSync:
    """ZeRO-2/3's per-unit gradient reductions, launched asynchronously (``launch``:
    ``HetCommunicator.dp_reduce_scatter_async`` on NCCL/HCCL, in place into the rank's chunk,
    or ``dp_all_reduce_async`` as :class:`BucketedGradSync`'s on gloo: a sum on the pool's
    group) and waited only when needed.

    ``runtime/optim.py`` fills one fp32 bucket per unit and microbatch and calls
    :meth:`launch` when the unit's last gradient has arrived, with ``done(bucket)``, which
    keeps the rank's chunk (averaged by ``group_size``) and frees the bucket. At most
    ``limit`` reductions are in flight: launching one more first completes the oldest (waits
    on its handle and runs its ``done``), so the backward holds ``limit`` buckets in flight
    beside the one it fills (``planning.cost.sharding_transient_bytes`` counts them).
    :meth:`finish` (before the optimizer step) completes every one, oldest first. Every DP
    rank launches the same reductions in the same order (the same units, the same schedule).
    ``account(bytes, seconds)`` gets each reduction's wire bytes at launch and, from
    :meth:`finish`, the seconds the step waited on them (the exposed part): by the bound
    during the backward and by :meth:`finish` itself."""

    def __init__(self, launch: Callable[[torch.Tensor], Work], group_size: int, limit: int,
                 account: Callable[[int, float], None] | None = None,
                 wire_bytes: Callable[[int], int] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"reductions in flight must be >= 1, got {limit}")
        self.launch_fn, self.group_size, self.limit = launch, group_size, limit
        self.account, self.wire_bytes = account, wire_bytes
        self._work: list[tuple[Work, torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self.buckets: list[int] = []  # elements of each reduction launched this step
        self.launched_early = 0  # launched before finish(): all of them
        self.wait_s = 0.0  # seconds waited this step (bound + finish)
        self.max_in_flight = 0
        self.sent_bytes = 0  # wire bytes of this step's reductions (``wire_bytes``)

    def begin(self, expected: int) -> None:
        """A new step (``expected``: unused, :class:`BucketedGradSync`'s interface)."""
        if self._work:
            raise RuntimeError("begin() before the previous step's finish()")
        self.buckets, self.launched_early, self.wait_s = [], 0, 0.0
        self.sent_bytes = 0

    @property
    def in_flight(self) -> int:
        return len(self._work)

    def launch(self, bucket: torch.Tensor, done: Callable[[torch.Tensor], None]) -> None:
        """Start the sum reduction of ``bucket`` (after completing the oldest while
        ``limit`` are in flight); ``done(bucket)`` runs once it has completed."""
        while len(self._work) >= self.limit:
            self._complete_oldest()
        self._work.append((self.launch_fn(bucket), bucket, done))
        self.max_in_flight = max(self.max_in_flight, len(self._work))
        self.buckets.append(bucket.numel())
        self.launched_early += 1
        nbytes = bucket.numel() * bucket.element_size()
        wire = self.wire_bytes(nbytes) if self.wire_bytes else nbytes
        self.sent_bytes += wire
        if self.account is not None:
            self.account(wire, 0.0)

    def _complete_oldest(self) -> None:
        work, bucket, done = self._work.pop(0)
        t0 = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - t0
        done(bucket)

    def finish(self) -> None:
        """Complete every reduction in flight, oldest first; account the step's waits."""
        while self._work:
            self._complete_oldest()
        if self.account is not None:
            self.account(0, self.wait_s)
