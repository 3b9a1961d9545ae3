"""Where ZeRO-3's CPU step time goes: the collectives alone vs the collectives in training.

``bench/fidelity.py --cpu``'s ``pp1 dp2 zero3`` row (its model, fp32, dp = 2, 2 microbatches
of 2) runs, per step, each unit's (embedding, 4 layers, final norm, head) all-gather before its
forward and before its backward and its gradient all-reduce after its backward: 42 collectives
plus the step's norm all-reduce. This replays exactly those collectives (same sizes, same
order, gloo, two local processes) with NO compute in between, both ranks ready at every one:
what the collectives themselves cost at these sizes on this machine. Each is timed alone
(synchronous, as the runtime before issue 15) and, per size, compared with the planner's
price of it (the profile's fitted all-reduce line the plan used, ``CommProfile``). Whatever a
training step's sync takes beyond this replay is ranks waiting for each other at the sync
points (one rank's compute running late), not the collectives.

Usage: python bench/zero_sync.py [--repeats 20] [--profile cpu-profile.yaml]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))

MICROBATCHES = 2


def unit_sizes() -> list[tuple[str, int]]:
    """``(unit, padded elements)`` of the fidelity model's units for a group of 2."""
    from bench.fidelity import CPU_MODEL, cpu_job

    from hettrain.api.spec import parse_job_manifest
    from hettrain.runtime.model import whole_model
    from hettrain.runtime.optim import layout, unit_layout

    _, spec = parse_job_manifest(cpu_job(1, 2, 2, 8, 1, "1f1b", "full"))
    assert spec.model.layers == CPU_MODEL["layers"]
    model = whole_model(spec.model, 0)
    _, units = unit_layout(layout(model, spec.training), 2)
    order = sorted(units, key=lambda u: (u.key != "model.embed_tokens", u.key == "lm_head",
                                         u.key == "model.norm", u.key))
    return [(u.key, u.padded) for u in order]


def sequence(units: list[tuple[str, int]]) -> list[tuple[str, str, int]]:
    """The step's collectives in the runtime's order: ``(kind, unit, elements)``."""
    out = []
    for _ in range(MICROBATCHES):
        out += [("gather", k, n) for k, n in units]
        for k, n in reversed(units):
            out += [("gather", k, n), ("reduce", k, n)]
    return [*out, ("reduce", "norm", 2)]


def _worker(rank: int, port: int, seq: list, repeats: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    bufs = {n: torch.ones(n) for _, _, n in seq}
    per_op: list[list[float]] = [[] for _ in seq]
    steps, cpus = [], []
    for r in range(repeats + 3):
        dist.barrier()
        t_step, c_step = time.perf_counter(), time.process_time()
        for i, (kind, _, n) in enumerate(seq):
            t0 = time.perf_counter()
            if kind == "gather":
                parts = list(bufs[n].split(n // 2))
                dist.all_gather(parts, parts[rank].clone())
            else:
                dist.all_reduce(bufs[n])
            if r >= 3:
                per_op[i].append(time.perf_counter() - t0)
        if r >= 3:
            steps.append(time.perf_counter() - t_step)
            cpus.append(time.process_time() - c_step)
    if rank == 0:
        lines = [f"step {statistics.median(steps)} {statistics.median(cpus)}"]
        lines += [f"{kind} {unit} {n} {statistics.median(ts)}"
                  for (kind, unit, n), ts in zip(seq, per_op, strict=True)]
        out.write_text("\n".join(lines))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", type=Path, help="a CPU profile (default: measured afresh)")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    from bench.fidelity import cpu_profile

    from hettrain.planning.profiles import load_profile

    seq = sequence(unit_sizes())
    with tempfile.TemporaryDirectory() as tmp:
        prof = args.profile or cpu_profile(Path(tmp), 3)
        comm = load_profile(prof).comm
        out = Path(tmp) / "times.txt"
        port = 29500 + os.getpid() % 1000
        mp.spawn(_worker, args=(port, seq, args.repeats, out), nprocs=2)
        lines = out.read_text().splitlines()
    step, cpu = map(float, lines[0].split()[1:])
    rows = [(k, u, int(n), float(t)) for k, u, n, t in (ln.split() for ln in lines[1:])]
    print(f"{len(rows)} collectives per step, replayed alone (no compute), median of "
          f"{args.repeats}: {1e3 * step:.1f} ms per step, {1e3 * cpu:.1f} ms of rank 0's CPU "
          "(every thread: gloo's too)")
    print(f"{'collective':>8} {'unit':>18} {'bytes':>9} {'count':>5} {'measured ms':>11} "
          f"{'planned ms':>10}")
    seen: dict[tuple[str, str], list[float]] = {}
    for k, u, n, t in rows:
        seen.setdefault((k, u if not u.startswith("model.layers") else "layer", n), []).append(t)
    total_plan = 0.0
    for (k, u, n), ts in seen.items():
        nbytes = 4 * n
        # the planner prices an all-gather at eb/8 = half an all-reduce of the fp32 bytes
        planned = comm.all_reduce_s(nbytes, 2) * (0.5 if k == "gather" else 1.0)
        total_plan += planned * len(ts)
        print(f"{k:>8} {u:>18} {nbytes:9d} {len(ts):5d} {1e3 * statistics.median(ts):11.3f} "
              f"{1e3 * planned:10.3f}")
    print(f"sum of the medians {1e3 * sum(t for *_, t in rows):.1f} ms, the profile's line "
          f"prices them at {1e3 * total_plan:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
