"""Benchmark the heterogeneous collective layer; prints ratios measured side by side in one run.

Part 1: hierarchical (pipelined), leader-based and ``auto`` (the communicator's choice)
all-reduce vs flat gloo ``all_reduce`` for 2 pools x p ranks (``--ranks-per-pool``, default 2
and 4), 1/4/16/64 MiB, on loopback and over an emulated slow inter-pool link of
``--link-gbit`` (1) Gbit/s and ``--delay-ms`` (5) ms one way: two network namespaces joined
by :mod:`slowlink` (a TUN delay line: netem's ``rate 1gbit delay 5ms`` without needing
``sch_netem``, which this host's kernel lacks), created and deleted by this script; a TCP probe
of the live link (round trip, bulk throughput) is printed with the table. Pool A's ranks run in
namespace A, pool B's in B: intra-pool traffic stays on each namespace's loopback, only
inter-pool traffic crosses the link, whose tx byte counters are reported per algorithm.
Part 2: cross-DC bytes per step and final loss for plain DP vs bf16/int8 compression vs DiLoCo
(H=10, 30, 50, with and without int8 pseudo-gradients) training a small MLP on 2 DCs x 2 ranks,
for several seeds; the loss gap is against plain DP of the same seed (equal tokens), median.

Usage: ``python bench/collectives.py [--repeats 7] [--steps 600] [--seeds 5] [--skip-netns]``
(netns needs root and iproute2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import slowlink  # noqa: E402  (bench/slowlink.py, next to this script)

SIZES_MIB = (1, 4, 16, 64)  # --sizes
NS, DEV, ADDR = slowlink.NS, slowlink.DEV, slowlink.ADDR


# ----------------------------------------------------------------------------- workers

def _init(rank: int, world: int, addr: str, port: int):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world)
    return dist


def _link_bytes() -> int:
    """Bytes sent so far by this namespace's end of the inter-pool link; 0 on loopback."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if dev == "lo":
        return 0
    return int((Path("/sys/class/net") / dev / "statistics" / "tx_bytes").read_text())


def worker_allreduce(rank: int, world: int, addr: str, port: int, repeats: int,
                     pipeline_mib: float, link: str) -> dict:
    """Time flat gloo all-reduce and the communicator's hierarchical / leader / auto paths.

    Ranks ``0..w/2-1`` are pool A (namespace A), the rest pool B. ``link`` is
    ``inter_gbps:inter_latency_ms:intra_gbps:intra_latency_ms`` (inter 0: one host): the
    communicator's link
    model, from which it picks the algorithm (auto), the pipeline's piece count and whether
    two shard owners exchange. The first rank of each pool also records the bytes its
    namespace's link device sent during each call (the inter-pool link).
    """
    import torch

    from hettrain.runtime.collectives import HetCommunicator, LinkModel
    from hettrain.runtime.collectives.choice import best_pieces
    dist = _init(rank, world, addr, port)
    gbps, lat, intra, intra_lat = (float(x) for x in link.split(":"))
    one_host = gbps == 0
    plan = _plan(world, {"mode": "sync", "link_gbps": gbps or 1.0, "link_latency_ms": lat},
                 one_host=one_host)
    model = LinkModel(inter_gbps=gbps or 1.0, inter_latency_ms=lat, intra_gbps=intra,
                      intra_latency_ms=intra_lat, one_host=one_host)
    pipe = int(pipeline_mib * (1 << 20)) if pipeline_mib > 0 else None
    comm = HetCommunicator.from_plan(plan, rank, link=model, pipeline_bytes=pipe)
    hier = comm._levels["global"].hier
    # the timing barriers get a group of their own: an op on the group a barrier just used
    # finds gloo's worker thread awake, which favoured flat (world group) by 1.05-1.2x at
    # 1-4 MiB on loopback over the same op on any other group (measured, 150 repeats)
    timing = dist.new_group(list(range(world)))

    def via(algo: str):
        def run(t):
            comm.algorithm = algo
            picked[algo, t.numel()] = comm.dp_all_reduce_([t], average=False)
        return run

    picked: dict[tuple[str, int], str] = {}
    algos = {"flat": lambda t: dist.all_reduce(t), "hierarchical": via("hierarchical"),
             "leader": via("leader"), "auto": via("auto")}
    out: dict = {}
    for mib in SIZES_MIB:
        base = torch.ones(mib * (1 << 20) // 4)
        times: dict[str, list[float]] = {name: [] for name in algos}
        link_mib: dict[str, list[float]] = {name: [] for name in algos}
        for _ in range(repeats + 1):  # first round warms up connections and buffers
            for name, fn in algos.items():  # interleaved: load drift hits every algorithm
                t = base.clone()
                dist.barrier(group=timing)
                tx0 = _link_bytes()
                t0 = time.perf_counter()
                fn(t)
                dist.barrier(group=timing)
                times[name].append(time.perf_counter() - t0)
                link_mib[name].append((_link_bytes() - tx0) / (1 << 20))
                if t[0].item() != world or t[-1].item() != world:
                    raise RuntimeError(f"{name} {mib} MiB: wrong sum {t[0].item()}")
        for name in algos:
            out[f"{mib}:{name}"] = statistics.median(times[name][1:])
            out[f"{mib}:{name}:link_mib"] = statistics.median(link_mib[name][1:])
        out[f"{mib}:picked"] = picked["auto", base.numel()]
        out[f"{mib}:pieces"] = best_pieces(base.numel() * 4, hier, model, pipe)
    dist.destroy_process_group()
    return out


def worker_train(rank: int, world: int, addr: str, port: int, steps: int, variant: str,
                 seed: int = 0) -> dict:
    """Train a small MLP regressor data-parallel over 2 DCs; report loss and cross-DC bytes.

    ``seed`` picks the model init (same on every rank) and each rank's data stream; the teacher
    and the evaluation set are fixed, so every variant of one seed sees the same tokens.
    """
    import torch

    from hettrain.runtime.collectives import DiLoCo, HetCommunicator, Tier
    sys.path.insert(0, str(ROOT / "bench"))
    from collectives import _plan
    dist = _init(rank, world, addr, port)
    kind, _, arg = variant.partition(":")
    cross = {"mode": "sync"}
    if kind == "compress":
        cross = {"mode": "compress", "compression": arg}
    plan = _plan(world, cross)
    comm = HetCommunicator.from_plan(plan, rank)
    torch.manual_seed(0)  # the task (teacher) is the same for every seed
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    torch.manual_seed(1 + seed)  # same init on every rank; data differs per rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    # cosine decay to 1/10 (same for every variant): the final loss is then not the snapshot of
    # a still-noisy trajectory, so the gap between variants is not dominated by that noise
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=2e-4)
    params = list(model.parameters())
    diloco = None
    if kind == "diloco":
        h, _, codec = arg.partition("+")
        diloco = DiLoCo(params, comm, outer_steps=int(h), outer_lr=0.7, outer_momentum=0.9,
                        compress=bool(codec))
        if codec:
            from hettrain.runtime.collectives import Codec
            comm.codec = Codec(codec)
    gen = torch.Generator().manual_seed(1000 * (1 + seed) + rank)
    eval_x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        eval_y = teacher(eval_x)
    for step in range(steps):
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.05 * torch.randn(64, 1, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if diloco:
            diloco.sync_gradients()
        else:
            comm.dp_all_reduce_([p.grad for p in params])
        opt.step()
        sched.step()
        if diloco:
            diloco.step(step)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(eval_x), eval_y).item()
    cross_bytes = torch.tensor(float(comm.stats[Tier.CROSS_DC].bytes))
    dist.all_reduce(cross_bytes)
    dist.destroy_process_group()
    return {"loss": loss, "cross_dc_bytes_per_step": cross_bytes.item() / steps,
            "param_bytes": sum(p.numel() * 4 for p in params)}


def _plan(world: int, cross_dc: dict, one_host: bool = False):
    from hettrain.api.spec import ModelSpec, TrainingSpec
    from hettrain.planning.plan import Plan, Prediction, RankPlan, StagePlan
    half = world // 2
    model = ModelSpec(layers=2, hidden=128, heads=1, seq_len=1, vocab=1, ffn_hidden=128,
                      kv_heads=1)
    stage = StagePlan(index=0, device="cpu", vendor="nvidia", backend="gloo",
                      pools=("pool-east", "pool-west"), datacenters=("east", "west"),
                      layer_start=0, layer_end=2, tp=1, memory_gib=1, capacity_gib=1, time_ms=1)
    ranks = tuple(RankPlan(rank=r, node="localhost" if one_host else f"n{r}",
                           pool="pool-east" if r < half else "pool-west",
                           datacenter="east" if r < half else "west",
                           local_rank=r if one_host else 0, stage=0, dp=r, tp=0)
                  for r in range(world))
    return Plan(job="bench", model=model, training=TrainingSpec(global_batch=world, steps=1),
                dp=world, pp=1, micro_batch=1, num_microbatches=1, schedule="1f1b",
                stages=(stage,), ranks=ranks, predicted=Prediction(1, 1, 0.1),
                cross_dc=cross_dc, data={"synthetic": True})


# ----------------------------------------------------------------------------- driver

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, addr: str, job: list[str], prefix=None, env_for=None) -> list[dict]:
    """Run ``world`` worker subprocesses; ``prefix(rank)`` wraps the command (ip netns exec)."""
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="hxbench"))
    procs = []
    for r in range(world):
        cmd = [sys.executable, str(Path(__file__).resolve()), "_worker", str(r), str(world),
               addr, str(port), str(tmp / f"{r}.json"), *job]
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'operator'}", OMP_NUM_THREADS="1",
                   **(env_for(r) if env_for else {"GLOO_SOCKET_IFNAME": "lo"}))
        procs.append(subprocess.Popen((prefix(r) if prefix else []) + cmd, env=env,
                                      stdout=subprocess.DEVNULL,  # gloo's connect lines
                                      stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=900)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("worker failed:\n" + "\n".join(e[-2000:] for e in errs if e))
    out = [json.loads((tmp / f"{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(tmp)
    return out


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _table(title: str, rows: list[list[str]], head: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for row in [head, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))


def _allreduce_table(title: str, res: list[dict], link: bool) -> dict:
    """Print one table (slowest rank = collective time); returns flat/hier and flat/auto."""
    half = len(res) // 2
    med = {k: max(r[k] for r in res) for k in res[0]
           if not k.endswith((":picked", ":pieces", "link_mib"))}
    rows, ratios = [], {}
    for mib in SIZES_MIB:
        f, h, lead, auto = (med[f"{mib}:{a}"] for a in ("flat", "hierarchical", "leader", "auto"))
        ratios[mib] = (f / h, f / auto)
        row = [f"{mib} MiB", f"{f * 1e3:.1f}", f"{h * 1e3:.1f} ({res[0][f'{mib}:pieces']})",
               f"{lead * 1e3:.1f}",
               f"{auto * 1e3:.1f} {res[0][f'{mib}:picked']}", f"{f / h:.2f}x",
               f"{f / lead:.2f}x", f"{f / auto:.2f}x"]
        if link:  # MiB sent over the link, A->B / B->A, measured on the first rank of each pool
            row += [f"{res[0][f'{mib}:{a}:link_mib']:.1f}/{res[half][f'{mib}:{a}:link_mib']:.1f}"
                    for a in ("flat", "hierarchical")]
        rows.append(row)
    head = ["size", "flat ms", "hier ms (pieces)", "leader ms", "auto ms (picked)", "flat/hier",
            "flat/leader", "flat/auto"]
    if link:
        head += ["link MiB flat", "link MiB hier"]
    _table(title, rows, head)
    return ratios


def main() -> None:
    """Run every part and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip-netns", action="store_true")
    ap.add_argument("--skip-loopback", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--ranks-per-pool", default="2,4",
                    help="comma list; each value runs both all-reduce tables with 2 pools")
    ap.add_argument("--pipeline-mib", type=float, default=8.0,
                    help="largest piece of the pipelined hierarchical all-reduce (0: one piece)")
    ap.add_argument("--link-gbit", type=float, default=1.0, help="slow link rate in Gbit/s")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="slow link one-way delay")
    ap.add_argument("--intra-gbps", type=float, default=5.0,
                    help="intra-pool bandwidth the communicator's link model assumes")
    ap.add_argument("--intra-latency-ms", type=float, default=1.0,
                    help="intra-pool per-step latency the link model assumes (defaults: gloo "
                         "on loopback among 4 processes on this 2-core host, measured: "
                         "all_to_all of 4 / 16 MiB ~ 4 ms + 1.2 ms/MiB)")
    ap.add_argument("--sizes", default="1,4,16,64", help="all-reduce sizes in MiB")
    ap.add_argument("--seeds", type=int, default=3, help="training seeds (median reported)")
    ap.add_argument("--variants", default="dp,compress:bf16,compress:int8,diloco:10,diloco:50,"
                    "diloco:10+int8,diloco:30+int8,diloco:50+int8",
                    help="training variants: dp | compress:CODEC | diloco:H[+CODEC]")
    args = ap.parse_args()
    global SIZES_MIB
    SIZES_MIB = tuple(int(x) for x in args.sizes.split(","))
    os.environ["HETTRAIN_BENCH_SIZES"] = args.sizes  # the workers' SIZES_MIB
    print(f"hettrain collectives bench: gloo, medians of {args.repeats} repeats, "
          f"{os.cpu_count()} CPUs")
    if not args.skip_allreduce:
        _allreduce_part(args)
    if not args.skip_train:
        _train_part(args, 4)


def _allreduce_part(args: argparse.Namespace) -> None:
    """Flat vs hierarchical vs leader vs auto, on loopback and across the slow link."""
    for per_pool in (int(x) for x in args.ranks_per_pool.split(",")):
        world = 2 * per_pool
        job = ["allreduce", str(args.repeats), str(args.pipeline_mib)]
        if not args.skip_loopback:
            loop = _allreduce_table(
                f"all-reduce on loopback, 2 pools x {per_pool} ranks, one host (plan: one node)",
                _launch(world, "127.0.0.1",
                        [*job, f"0:0:{args.intra_gbps}:{args.intra_latency_ms}"]), link=False)
            print("  loopback: hierarchical slowdown vs flat (target <= 1.1x): "
                  + ", ".join(f"{m} MiB {1 / r[0]:.2f}x" for m, r in loop.items())
                  + "; auto (picks flat on one host) slowdown: "
                  + ", ".join(f"{1 / r[1]:.2f}x" for r in loop.values()))
        if args.skip_netns:
            continue
        link = slowlink.SlowLink(args.link_gbit, args.delay_ms)
        try:
            try:
                link.__enter__()
                probe = slowlink.probe(pings=20, bulk_mib=128)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                err = getattr(e, "stderr", None) or e
                print(f"\nslow-link part skipped: could not build the namespaces ({err})")
                return

            def prefix(r, per_pool=per_pool):
                return ["ip", "netns", "exec", NS[r // per_pool]]

            res = _launch(world, ADDR[0],
                          [*job, f"{args.link_gbit}:{args.delay_ms}:{args.intra_gbps}:"
                           f"{args.intra_latency_ms}"],
                          prefix=prefix, env_for=lambda r, per_pool=per_pool: {
                              "GLOO_SOCKET_IFNAME": DEV[r // per_pool]})
            slow = _allreduce_table(
                f"all-reduce, 2 pools x {per_pool} ranks in two netns, {link.describe()} "
                f"(probed: TCP RTT {probe['rtt_ms_median']:.2f} ms, bulk "
                f"{probe['throughput_gbit']:.2f} Gbit/s)", res, link=True)
            print("  slow link: hierarchical speed-up vs flat (target >= 1.5x): "
                  + ", ".join(f"{m} MiB {r[0]:.2f}x" for m, r in slow.items())
                  + "; auto: " + ", ".join(f"{r[1]:.2f}x" for r in slow.values()))
        finally:
            link.__exit__()


def _train_part(args: argparse.Namespace, world: int) -> None:
    """Train each variant for every seed; print cross-DC bytes per step and the loss gap vs
    plain DP of the same seed (equal tokens), median over seeds."""
    variants = args.variants.split(",")
    if "dp" not in variants:
        variants.insert(0, "dp")
    seeds = range(args.seeds)
    results = {(v, sd): _launch(world, "127.0.0.1", ["train", str(args.steps), v, str(sd)])
               for sd in seeds for v in variants}
    dp_bytes = results[("dp", 0)][0]["cross_dc_bytes_per_step"]

    def loss(v, sd):
        return statistics.mean(r["loss"] for r in results[(v, sd)])

    rows = []
    for v in variants:
        b = results[(v, 0)][0]["cross_dc_bytes_per_step"]
        gaps = [100 * (loss(v, sd) / loss("dp", sd) - 1) for sd in seeds]
        rows.append([v, f"{b / 1e3:.1f}", f"{dp_bytes / b:.1f}x",
                     f"{statistics.median(loss(v, sd) for sd in seeds):.5f}",
                     f"{statistics.median(gaps):+.2f}%",
                     " ".join(f"{g:+.1f}" for g in gaps)])
    param_kb = results[("dp", 0)][0]["param_bytes"] / 1e3
    _table(f"training {args.steps} steps, MLP {param_kb:.0f} kB fp32 params, 2 DCs x 2 ranks, "
           f"{len(seeds)} seeds (cross-DC bytes summed over ranks; gap vs plain DP of the same "
           "seed, equal tokens; median)",
           rows, ["variant", "xDC kB/step", "fewer bytes", "eval loss", "loss gap",
                  "gap per seed %"])


def _worker_main(argv: list[str]) -> None:
    global SIZES_MIB
    SIZES_MIB = tuple(int(x) for x in os.environ.get("HETTRAIN_BENCH_SIZES", "1,4,16,64")
                      .split(","))
    rank, world, addr, port, out = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), argv[4]
    job = argv[5:]
    if job[0] == "allreduce":
        res = worker_allreduce(rank, world, addr, port, int(job[1]), float(job[2]), job[3])
    else:
        res = worker_train(rank, world, addr, port, int(job[1]), job[2], int(job[3]))
    Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _worker_main(sys.argv[2:])
    else:
        main()
