"""Sequence parallelism's collectives on two real gloo ranks, against the whole-sequence math:
the gather and the reduce-scatter of shards (also with the TP indices in the opposite order
to the group ranks), and the column-parallel group that keeps only its input's shard."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hettrain.runtime.model import _GatherLinears
from hettrain.runtime.tensor_parallel import TPGroup, gather_sequence, scatter_sequence

RANKS = 2


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rank(rank: int, store: str, members: tuple[int, ...], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=RANKS)
    index = members[rank]
    tp = TPGroup(dist.group.WORLD, None, RANKS, index, members)
    b, s, h, f = 2, 6, 4, 5
    n = s // RANKS
    x = _data(0, b, s, h)  # the whole sequence, the same on every rank
    mine = slice(index * n, (index + 1) * n)
    res: dict[str, float] = {}

    shard = x[:, mine].clone().requires_grad_()
    whole = gather_sequence(shard, tp)
    res["gather"] = float((whole - x).abs().max())
    g = _data(10, b, s, h)  # every rank's consumer (a stage output's) the same gradient
    whole.backward(g)
    res["gather_grad"] = float((shard.grad - g[:, mine]).abs().max())

    part = _data(20 + index, b, s, h).requires_grad_()  # a row-parallel partial sum
    mine_sum = scatter_sequence(part, tp, summed=True)
    res["scatter"] = float((mine_sum - (_data(20, b, s, h) + _data(21, b, s, h))[:, mine])
                           .abs().max())
    mine_sum.backward(_data(30, b, n, h) if index == 0 else _data(31, b, n, h))
    want = torch.cat([_data(30, b, n, h), _data(31, b, n, h)], dim=1)
    res["scatter_grad"] = float((part.grad - want).abs().max())

    w1, w2 = (_data(40, f, h).requires_grad_(), _data(41, f, h).requires_grad_())
    shard = x[:, mine].clone().requires_grad_()
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t):
        y1, y2 = _GatherLinears.apply(shard, tp, w1, w2)
    res["saved_input"] = saved[0]  # then the two weights
    res["linear"] = float(max((y1 - F.linear(x, w1)).abs().max(),
                              (y2 - F.linear(x, w2)).abs().max()))
    g1, g2 = _data(50 + index, b, s, f), _data(60 + index, b, s, f)
    torch.autograd.backward((y1, y2), (g1, g2))
    gx = sum(_data(50 + r, b, s, f) @ w1.detach() + _data(60 + r, b, s, f) @ w2.detach()
             for r in range(RANKS))
    res["linear_grad_x"] = float((shard.grad - gx[:, mine]).abs().max())
    gw1 = g1.reshape(-1, f).t() @ x.reshape(-1, h)
    res["linear_grad_w"] = float((w1.grad - gw1).abs().max())
    dist.barrier()
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def _run(members: tuple[int, ...]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out"
        mp.start_processes(_rank, args=(f"{tmp}/store", members, out), nprocs=RANKS,
                           start_method="spawn")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(RANKS)]


def test_sequence_parallel_collectives_match_the_whole_sequence():
    for members in ((0, 1), (1, 0)):  # TP index of each group rank
        for res in _run(members):
            assert res.pop("saved_input") == 2 * 3 * 4  # the shard, not the gathered input
            assert max(res.values()) < 1e-12, (members, res)
