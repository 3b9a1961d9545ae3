"""``hettrain profile``'s measuring side: the runtime's real transformer block on the local device.

For one model shape (a job's ``spec.model``) and a few microbatch sizes, times one
:class:`hettrain.runtime.model.LlamaDecoderLayer` in the job's precision (tp 1; the median of
``repeats`` runs after two warm-up runs): forward and backward without recompute, and forward +
backward with the runtime's selective and full recompute (``set_recompute``); the backward
split as the ZB-H1 schedule runs it, its B pass (inside ``defer_weight_grads``) and W pass
(``WeightGradStore.flush``) timed apart (``bS``, ``wS``: ``measure_split``); the runtime's
pipeline stage around one such layer (:class:`hettrain.runtime.model.StageModel`, forward +
loss + backward as ``runtime/pipeline.py`` runs a microbatch) as a middle, a first (embedding)
and a last stage (final norm, LM head, loss: ``stage``); on a CPU the layer again with every
"device" of the node running it at once (``concurrent``: ``runtime/concurrent_profile.py``;
the local ranks share the host's cores, caches and memory); the optimizer step over that
block's parameters in the job's precision (``optimizerBytesPerS``); and, unless
``--no-comm``, two local ranks' pipeline transfers and all-reduce (``comm``:
``runtime/comm_profile.py``) and the block sharded over them at tp 2 as the runtime shards it
(``tp``: ``runtime/tp_profile.py``; both skipped on a node with one accelerator). Everything
runs in the job's precision; it writes the versioned ``DeviceProfile`` YAML that
``planning/profiles.py`` reads (``hettrain plan --profile FILE``).

Usage: python -m hettrain.runtime.profile JOB.yaml --device-name CPU --out profile.yaml
       [--micro-batches 1,2,4] [--repeats 5] [--no-comm]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from hettrain.api.spec import ModelSpec, TrainingSpec
from hettrain.planning import cost
from hettrain.planning.profiles import RECOMPUTE_MODES, profile_doc
from hettrain.profile_cli import ProfileInputError, add_arguments, check_inputs
from hettrain.runtime.comm_profile import RANKS, measure_comm
from hettrain.runtime.concurrent_profile import measure_concurrent
from hettrain.runtime.model import (
    LlamaDecoderLayer,
    StageModel,
    defer_weight_grads,
    rope_cos_sin,
    set_weight_grad_deferral,
)
from hettrain.runtime.optim import DTYPES, StageOptimizer
from hettrain.runtime.stage_timing import LayerClock
from hettrain.runtime.tp_profile import measure_tp_layer

WARMUP = 2  # untimed runs before the timed ones
# a measurement runs at least ``repeats`` times and, up to MAX_RUNS, until its timed runs add
# up to MIN_TIMED_S: a layer of a few milliseconds on a shared host is noisy, and its median
# over five runs moved its fitted line by 20% between profiles (bench/fidelity.py --cpu)
MIN_TIMED_S = 0.25
MAX_RUNS = 64
# on a CPU the layer is timed as a chain of up to CPU_CHAIN distinct layers (per layer): one
# layer run again and again keeps its weights in the caches, which a stage of several layers
# does not (a hidden-128 layer: 12-15% slower per layer in a chain of 4 on this host's
# caches); a GPU layer of a real model outgrows the GPU's cache anyway, and a chain's
# activations at long sequences would not fit one profiling GPU, so it is timed alone
CPU_CHAIN = 4


def chain_length(model: ModelSpec, device: torch.device) -> int:
    """Distinct layers timed in a chain on ``device`` (:data:`CPU_CHAIN`)."""
    return min(model.layers, CPU_CHAIN) if device.type == "cpu" else 1
COMM_SMALL_BYTES = 4096  # the latency point of the communication measurement
COMM_MAX_BYTES = 32 << 20
COMM_REPEATS = 15  # transfers are cheap and noisier than layers: more runs per size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def enough(times: Sequence[float], repeats: int, min_seconds: float = MIN_TIMED_S) -> bool:
    """Whether ``times`` (the timed runs so far) suffice: at least ``repeats`` runs and
    ``min_seconds`` of them, or ``MAX_RUNS`` runs."""
    return len(times) >= repeats and (sum(times) >= min_seconds or len(times) >= MAX_RUNS)


def measure_layer(model: ModelSpec, micro_batch: int, repeats: int, device: torch.device,
                  precision: str = "fp32", recompute: str = "none",
                  min_seconds: float = MIN_TIMED_S, chain: int | None = None
                  ) -> tuple[float, float]:
    """Median (forward, backward) seconds per block of ``micro_batch`` sequences through a
    chain of ``chain`` distinct blocks (default :func:`chain_length`), their parameters and
    input in ``precision`` (as the runtime holds them) and ``recompute`` set as the runtime
    sets it (the recomputation runs inside the backward); timed runs until :func:`enough`."""
    fwd, bwd, _, _ = _time_layer(model, micro_batch, repeats, device, precision, recompute,
                                 min_seconds, chain, split=False)
    return fwd, bwd


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """One block's ZB-H1 passes (median seconds per block): ``forward``, ``b`` (the backward
    inside ``defer_weight_grads``: input gradients) and ``w`` (``WeightGradStore.flush``: the
    deferred weight gradients); ``deferred``: weight-gradient items each block's B pass
    stashed for its W pass (one per linear)."""

    forward: float
    b: float
    w: float
    deferred: int


def measure_split(model: ModelSpec, micro_batch: int, repeats: int, device: torch.device,
                  precision: str = "fp32", min_seconds: float = MIN_TIMED_S,
                  chain: int | None = None) -> LayerSplit:
    """:func:`measure_layer`'s chain with its backward split as the runtime's ZB-H1 schedule
    runs it (``runtime/pipeline.py``: B inside ``defer_weight_grads``, then W, the store's
    ``flush``), in ``precision``, without recompute."""
    fwd, b, w, items = _time_layer(model, micro_batch, repeats, device, precision, "none",
                                   min_seconds, chain, split=True)
    return LayerSplit(fwd, b, w, items)


def _time_layer(model: ModelSpec, micro_batch: int, repeats: int, device: torch.device,
                precision: str, recompute: str, min_seconds: float, chain: int | None,
                split: bool) -> tuple[float, float, float, int]:
    """Median (forward, backward, W pass) seconds per block and the weight-gradient items a
    block deferred per run (``split``: the backward deferred, then flushed; else the plain
    backward, W 0)."""
    torch.manual_seed(0)
    dtype = DTYPES[precision]
    k = chain or chain_length(model, device)
    blocks = [LlamaDecoderLayer(model).to(device=device, dtype=dtype) for _ in range(k)]
    for block in blocks:
        block.set_recompute(recompute)
        if split:  # as the pipeline sets it for ZB-H1
            set_weight_grad_deferral(block, True)
    cos, sin = rope_cos_sin(model, model.seq_len, device)
    x = torch.randn(micro_batch, model.seq_len, model.hidden, device=device, dtype=dtype,
                    requires_grad=True)

    fwd, bwd, wgt, total = [], [], [], []
    items = 0
    i = 0
    while not enough(total, repeats, min_seconds):  # after WARMUP runs: allocator, caches
        _sync(device)
        t0 = time.perf_counter()
        y = x
        for block in blocks:
            y = block(y, cos, sin)
        _sync(device)
        t1 = time.perf_counter()
        if split:
            with defer_weight_grads() as store:
                y.sum().backward()
            _sync(device)
            t2 = time.perf_counter()
            items = len(store.items)
            store.flush()
        else:
            y.sum().backward()
            _sync(device)
            t2 = time.perf_counter()
        _sync(device)
        t3 = time.perf_counter()
        if i >= WARMUP:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            wgt.append(t3 - t2)
            total.append(t3 - t0)
        i += 1
        x.grad = None
        for block in blocks:
            block.zero_grad(set_to_none=True)
    return (statistics.median(fwd) / k, statistics.median(bwd) / k,
            statistics.median(wgt) / k if split else 0.0, items // k)


def measure_stage(model: ModelSpec, micro_batch: int, repeats: int, device: torch.device,
                  precision: str = "fp32") -> tuple[float, float, float]:
    """Median forward+backward seconds of ``micro_batch`` sequences through the runtime's stage
    around :func:`chain_length` layers (the layer rows' chain): ``(middle, first, last)``, i.e.
    the layers alone, with the token embedding before them, and with the final norm, LM head
    and loss after it. Each runs what ``StageRunner.run`` runs for a microbatch (its receives
    and sends aside): the stage's forward with its layer clock (``runtime/stage_timing.py``),
    on the last stage the loss, its value read and scaled, then the backward. Interleaved per
    repeat, so a drifting machine moves the three alike; as many runs as :func:`enough` wants
    of the middle one. Parameters and activations in ``precision``."""
    dtype = DTYPES[precision]
    stages = {}
    for part, first, last in (("middle", False, False), ("first", True, False),
                              ("last", False, True)):
        torch.manual_seed(0)
        st = StageModel(model, 0, chain_length(model, device), has_embedding=first,
                        has_head=last, seed=0).to(
            device=device, dtype=dtype)
        st.layer_clock = LayerClock()
        stages[part] = (st, first, last)
    ids = torch.randint(0, model.vocab, (micro_batch, model.seq_len), device=device)
    targets = torch.randint(0, model.vocab, (micro_batch, model.seq_len), device=device)
    hidden = torch.randn(micro_batch, model.seq_len, model.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(hidden)
    times: dict[str, list[float]] = {part: [] for part in stages}
    i = 0
    while not enough(times["middle"], repeats):  # each part's runs as measure_layer's
        for part, (st, first, last) in stages.items():
            x = ids if first else hidden.detach().clone().requires_grad_()
            _sync(device)
            t0 = time.perf_counter()
            out = st(x)
            if last:
                loss = st.loss(out, targets)
                loss.item()
                (loss * 0.5).backward()
            else:
                out.backward(grad)
            _sync(device)
            if i >= WARMUP:
                times[part].append(time.perf_counter() - t0)
            st.layer_clock.reset()
            st.zero_grad(set_to_none=True)
        i += 1
    return (statistics.median(times["middle"]), statistics.median(times["first"]),
            statistics.median(times["last"]))


def measure_optimizer(model: ModelSpec, training: TrainingSpec, repeats: int,
                      device: torch.device) -> float:
    """Bytes per second of the runtime's optimizer step (``StageOptimizer.step`` over one
    block's parameters, no ZeRO): :func:`cost.optimizer_step_bytes` over the median
    measured seconds, so the planner's time for the same parameters is the measured one."""
    torch.manual_seed(0)
    block = LlamaDecoderLayer(model).to(device)
    opt = StageOptimizer(block, dataclasses.replace(training, optimizer_sharding=False,
                                                    grad_clip=0.0))
    n = opt.main_grad.numel()
    times = []
    for i in range(repeats + WARMUP):
        opt.main_grad.normal_(std=1e-3)  # step() zeroes it
        _sync(device)
        t0 = time.perf_counter()
        opt.step(i)
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return cost.optimizer_step_bytes(n, opt.t, 1) / statistics.median(times)


def comm_sizes(model: ModelSpec, micro_batches: Sequence[int], elem_bytes: int) -> list[int]:
    """Message bytes :func:`measure_comm` times: a small one (latency), the model's pipeline
    boundary tensor at each microbatch size, one layer's fp32 gradient and the whole model's
    (the DP sync of a model under one gradient bucket; each at most ``COMM_MAX_BYTES``)."""
    whole = 4 * (cost.layer_params(model) * model.layers + 2 * cost.embedding_params(model))
    sizes = {COMM_SMALL_BYTES, min(COMM_MAX_BYTES, 4 * cost.layer_params(model)),
             min(COMM_MAX_BYTES, whole)}
    sizes.update(int(cost.activation_bytes(model, b, elem_bytes)) for b in micro_batches)
    return sorted(s for s in sizes if s <= COMM_MAX_BYTES)


def profile(model: ModelSpec, device_name: str, micro_batches: Sequence[int], repeats: int,
            device: torch.device, training: TrainingSpec | None = None,
            comm: bool = False) -> dict:
    """The ``DeviceProfile`` document of ``model``'s layer (and, with ``training``, its
    optimizer step in that precision; with ``comm``, two local ranks' p2p and all-reduce:
    ``runtime/comm_profile.py``) on ``device``. The layer and stage run in the training's
    precision (fp32 without ``training``); the layer without recompute and with each
    recompute mode."""
    precision = training.precision if training is not None else "fp32"
    rows = [(b, *measure_layer(model, b, repeats, device, precision)) for b in micro_batches]
    modes = {mode: [sum(measure_layer(model, b, repeats, device, precision, mode))
                    for b in micro_batches] for mode in RECOMPUTE_MODES}
    splits = [measure_split(model, b, repeats, device, precision) for b in micro_batches]
    stage = [(b, *measure_stage(model, b, repeats, device, precision)) for b in micro_batches]
    # a CPU node's ranks share one host; a GPU's compute is its own
    concurrent = ({"ranks": RANKS, "layer": measure_concurrent(model, micro_batches, repeats,
                                                               RANKS, precision)}
                  if device.type == "cpu" else None)
    software = {"torch": str(torch.__version__), "python": platform.python_version()}
    opt = measure_optimizer(model, training, repeats, device) if training is not None else 0.0
    links, tp = None, None
    if comm:
        eb = cost.precision_bytes(training) if training is not None else 4
        links = measure_comm(comm_sizes(model, micro_batches, eb), max(COMM_REPEATS, repeats))
        tp = measure_tp_layer(model, micro_batches, repeats, precision)
    return profile_doc(device_name, software, model, rows, opt, links, stage, concurrent,
                       precision=precision, modes=modes,
                       stage_layers=chain_length(model, device),
                       split=[(sp.b, sp.w) for sp in splits],
                       tp=[tp] if tp is not None else None)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and write the profile; bad input: one line on stderr, exit 2."""
    ap = argparse.ArgumentParser(prog="hettrain profile", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        spec = check_inputs(args)  # the job (bounded YAML) and --out, before measuring
    except ProfileInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        out = profile(spec.model, args.device_name, args.micro_batches, args.repeats, device,
                      spec.training, comm=args.comm)
    except RuntimeError as exc:  # the communication ranks failed: say so, write nothing
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        Path(args.out).write_text(yaml.safe_dump(out, sort_keys=False))
    except OSError as exc:
        print(f"error: {args.out}: cannot write: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
