"""``hettrain profile``'s measuring side: the runtime's real transformer block on the local device.

For one model shape (a job's ``spec.model``) and a few microbatch sizes, times one
:class:`hettrain.runtime.model.LlamaDecoderLayer` in the job's precision (tp 1; the median of
``repeats`` runs after two warm-up runs): forward and backward without recompute, and forward +
backward with the runtime's selective and full recompute (``set_recompute``), and the optimizer
step over that block's parameters in the job's precision (``optimizerBytesPerS``), and, unless
``--no-comm``, two local ranks' pipeline transfers and all-reduce (``comm``:
``runtime/comm_profile.py``; skipped on a node with one accelerator), and writes the versioned
``DeviceProfile`` YAML that ``planning/profiles.py`` reads (``hettrain plan --profile FILE``).

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

from hettrain.api.spec import ModelSpec, SpecError, TrainingSpec, parse_job_manifest
from hettrain.planning import cost
from hettrain.planning.profiles import RECOMPUTE_MODES, profile_doc
from hettrain.profile_cli import add_arguments
from hettrain.runtime.comm_profile import measure_comm
from hettrain.runtime.model import LlamaDecoderLayer, rope_cos_sin
from hettrain.runtime.optim import DTYPES, StageOptimizer

WARMUP = 2  # untimed runs before the timed ones
COMM_SMALL_BYTES = 4096  # the latency point of the communication measurement
COMM_MAX_BYTES = 32 << 20
COMM_REPEATS = 15  # transfers are cheap and noisier than layers: more runs per size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_layer(model: ModelSpec, micro_batch: int, repeats: int, device: torch.device,
                  precision: str = "fp32", recompute: str = "none") -> tuple[float, float]:
    """Median (forward, backward) seconds of one block for ``micro_batch`` sequences, its
    parameters and input in ``precision`` (as the runtime holds them) and ``recompute`` set
    as the runtime sets it (the recomputation runs inside the backward)."""
    torch.manual_seed(0)
    dtype = DTYPES[precision]
    block = LlamaDecoderLayer(model).to(device=device, dtype=dtype)
    block.set_recompute(recompute)
    cos, sin = rope_cos_sin(model, model.seq_len, device)
    x = torch.randn(micro_batch, model.seq_len, model.hidden, device=device, dtype=dtype,
                    requires_grad=True)

    fwd, bwd = [], []
    for i in range(repeats + WARMUP):  # warm-up runs: allocator, kernels, caches
        _sync(device)
        t0 = time.perf_counter()
        y = block(x, cos, sin)
        _sync(device)
        t1 = time.perf_counter()
        y.sum().backward()
        _sync(device)
        t2 = time.perf_counter()
        if i >= WARMUP:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        x.grad = None
        block.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


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
    boundary tensor at each microbatch size, and one layer's fp32 gradient (DP; at most
    ``COMM_MAX_BYTES``)."""
    sizes = {COMM_SMALL_BYTES, min(COMM_MAX_BYTES, 4 * cost.layer_params(model))}
    sizes.update(int(cost.activation_bytes(model, b, elem_bytes)) for b in micro_batches)
    return sorted(s for s in sizes if s <= COMM_MAX_BYTES)


def profile(model: ModelSpec, device_name: str, micro_batches: Sequence[int], repeats: int,
            device: torch.device, training: TrainingSpec | None = None,
            comm: bool = False) -> dict:
    """The ``DeviceProfile`` document of ``model``'s layer (and, with ``training``, its
    optimizer step in that precision; with ``comm``, two local ranks' p2p and all-reduce:
    ``runtime/comm_profile.py``) on ``device``. The layer runs in the training's precision
    (fp32 without ``training``), without recompute and with each recompute mode."""
    precision = training.precision if training is not None else "fp32"
    rows = [(b, *measure_layer(model, b, repeats, device, precision)) for b in micro_batches]
    modes = {mode: [sum(measure_layer(model, b, repeats, device, precision, mode))
                    for b in micro_batches] for mode in RECOMPUTE_MODES}
    software = {"torch": str(torch.__version__), "python": platform.python_version()}
    opt = measure_optimizer(model, training, repeats, device) if training is not None else 0.0
    links = None
    if comm:
        eb = cost.precision_bytes(training) if training is not None else 4
        links = measure_comm(comm_sizes(model, micro_batches, eb), max(COMM_REPEATS, repeats))
    return profile_doc(device_name, software, model, rows, opt, links, precision=precision,
                       modes=modes)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and write the profile; bad input: one line on stderr, exit 2."""
    ap = argparse.ArgumentParser(prog="hettrain profile", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        doc = yaml.safe_load(Path(args.job).read_text())
        _, spec = parse_job_manifest(doc)
    except (OSError, yaml.YAMLError) as exc:
        print(f"error: {args.job}: cannot read the job: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        print(f"error: {args.job}: {exc}", file=sys.stderr)
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
