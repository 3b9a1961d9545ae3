"""``hettrain profile``'s communication side: two local ranks time the runtime's own transfers.

Two processes on this node (``python -m hettrain.runtime.comm_profile --rank R``), joined by a
file store, time for each message size (median of ``repeats`` after ``WARMUP`` untimed runs,
every run started together at a barrier):

- **p2p**: one pipeline-boundary transfer as the runtime sends it between stages of one
  vendor (``runtime/pipeline.py``: device tensors over the pool backend's stream group, nccl
  on CUDA, gloo on a CPU host): half a ping-pong round trip;
- **allReduce**: ``dist.all_reduce`` of the size in the pool's backend (gloo on the CPU, nccl
  on CUDA), as the TP and DP groups inside a node run it;
- **allGather**: ``dist.all_gather_into_tensor`` whose gathered output has the size (each rank
  contributes ``1/ranks`` of it), as ZeRO-3 gathers a unit's parameters and ZeRO-1/2 the
  updated ones (a library's all-gather need not cost half its all-reduce: gloo's measured
  about the same at small sizes).

The rows go into the profile's ``comm`` section (``planning/profiles.py`` fits
``latency + bytes / bandwidth`` to them). On CUDA it needs two visible devices; with fewer
(a profiling pod holds one GPU) :func:`measure_comm` returns ``None`` and the planner keeps the
catalog's link model for that device.

Usage (what :func:`measure_comm` runs, once per rank):
    python -m hettrain.runtime.comm_profile --rank 0 --store DIR/store --sizes 4096,65536
           --repeats 5 --out DIR/rank-0.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

WARMUP = 2
RANKS = 2
TIMEOUT_S = 300


def _devices_available() -> int:
    """This node's devices the ranks would use: its CUDA devices, else any number of CPU
    processes (:data:`RANKS`)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else RANKS


def measure_comm(sizes: Sequence[int], repeats: int) -> dict | None:
    """The ``comm`` section of a profile: medians of p2p and all-reduce seconds per size,
    measured by :data:`RANKS` local processes; ``None`` where the node has one device only."""
    if _devices_available() < RANKS:
        return None
    _release_device_memory()
    doc = run_local_ranks("hettrain.runtime.comm_profile",
                          ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)],
                          "the communication measurement")
    return {"ranks": RANKS, "backend": doc["backend"], "p2p": doc["p2p"],
            "allReduce": doc["allReduce"], "allGather": doc["allGather"]}


def run_local_ranks(module: str, args: Sequence[str], what: str) -> dict:
    """Run ``python -m module --rank r --store S --out O *args`` as :data:`RANKS` local
    processes (one thread each, as ``launch_local`` runs every rank) and return rank 0's JSON
    output; a rank's failure or the deadline raises naming ``what`` and the rank's last log
    line (the backends' chatter is shown only then)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank-{r}.json" for r in range(RANKS)]
        logs = [Path(tmp) / f"rank-{r}.log" for r in range(RANKS)]
        procs = []
        for r in range(RANKS):
            with logs[r].open("wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, "--rank", str(r),
                     "--store", str(Path(tmp) / "store"), *args, "--out", str(outs[r])],
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        failed = _wait_all(procs, TIMEOUT_S)
        if failed is not None:
            rank, why = failed
            tail = logs[rank].read_text(errors="replace").strip()
            raise RuntimeError(f"{what} failed: rank {rank} {why}"
                               + (f": {tail.splitlines()[-1]}" if tail else ""))
        return json.loads(outs[0].read_text())


def _release_device_memory() -> None:
    """Return this process's cached accelerator memory (the layer timing's) before the
    ranks start: rank 0 shares the device with it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> tuple[int, str] | None:
    """Wait for every rank against one deadline; on the first failure (or the deadline) kill
    the others, which would wait on it forever. ``(rank, why)`` of the failure, or None."""
    deadline = time.monotonic() + timeout
    failed: tuple[int, str] | None = None
    while failed is None and any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0):
                failed = (r, f"exited with code {p.returncode}")
                break
        else:
            if time.monotonic() > deadline:
                failed = (0, f"took over {timeout:.0f} s")
            else:
                time.sleep(0.05)
    if failed is None:
        bad = [r for r, p in enumerate(procs) if p.returncode]
        return (bad[0], f"exited with code {procs[bad[0]].returncode}") if bad else None
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return failed


def _timed(fn, repeats: int, sync) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``WARMUP``, each from a barrier."""
    import torch.distributed as dist

    times = []
    for i in range(repeats + WARMUP):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def join_ranks(rank: int, store: str) -> tuple[Any, str, Callable[[], None]]:
    """Join the :data:`RANKS` local ranks' process group as ``rank`` (CUDA device ``rank``
    with NCCL where there is CUDA, else the CPU with gloo); ``(device, backend, sync)``, where
    ``sync()`` waits for the device's queued work before a timer is read."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=RANKS, device_id=device if cuda else None)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    return device, backend, sync


def run_rank(rank: int, store: str, sizes: Sequence[int], repeats: int) -> dict:
    """One rank's measurements (rank 0's are reported)."""
    import torch
    import torch.distributed as dist

    device, backend, sync = join_ranks(rank, store)

    peer = 1 - rank
    out: dict = {"backend": backend, "p2p": [], "allReduce": [], "allGather": []}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        part = torch.ones(max(1, nbytes // 4 // RANKS), dtype=torch.float32, device=device)
        gathered = torch.empty(part.numel() * RANKS, dtype=torch.float32, device=device)

        def ping_pong(t: torch.Tensor = t) -> None:
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)

        def all_reduce(t: torch.Tensor = t) -> None:
            dist.all_reduce(t)

        def all_gather(part: torch.Tensor = part, gathered: torch.Tensor = gathered) -> None:
            dist.all_gather_into_tensor(gathered, part)

        real = t.numel() * 4
        out["p2p"].append({"bytes": real, "seconds": _timed(ping_pong, repeats, sync) / 2})
        out["allReduce"].append({"bytes": real, "seconds": _timed(all_reduce, repeats, sync)})
        out["allGather"].append({"bytes": gathered.numel() * 4,
                                 "seconds": _timed(all_gather, repeats, sync)})
    dist.barrier()  # rank 0 serves the store: nobody tears down while a peer still uses it
    dist.destroy_process_group()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of :func:`measure_comm`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    doc = run_rank(args.rank, args.store, [int(s) for s in args.sizes.split(",")], args.repeats)
    Path(args.out).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
