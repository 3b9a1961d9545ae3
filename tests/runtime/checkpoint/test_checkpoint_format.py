"""The checkpoint format and local storage: safetensors compatibility, resharding against
brute-force slicing, reads limited to the needed rows, atomic publish, retention, async
snapshots, validation errors."""

from __future__ import annotations

import io
import itertools
import json
import math

import pytest
import torch

from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.checkpoint_format import (
    CheckpointFormatError,
    SafetensorsFile,
    ShardedTensor,
    write_safetensors,
)

META = {"model": {"layers": 2, "hidden": 8}}


def test_streamed_file_is_a_safetensors_file():
    from safetensors.torch import load as st_load  # the reference implementation

    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
               ("c", torch.tensor(7.0)), ("d", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
               ("e", torch.empty(0, 4)), ("f", torch.randn(4, 2).t())]  # f: not contiguous
    buf = io.BytesIO()
    n = write_safetensors(buf, tensors, {"format": "x"})
    assert n == len(buf.getvalue())
    ref = st_load(buf.getvalue())  # the reference library reads it
    for k, t in tensors:
        assert ref[k].dtype == t.dtype and torch.equal(ref[k], t), k
    f = SafetensorsFile("mem", lambda a, b: buf.getvalue()[a:b])
    assert f.metadata == {"format": "x"}
    assert torch.equal(f.read_rows("d", 1, 2), tensors[3][1][1:2])


def _save(store, step, per_rank, keep=3, world=None):
    world = world or len(per_rank)
    savers = [ckpt.Checkpointer(store, r, world, keep=keep, async_save=False)
              for r in range(world)]
    for r in reversed(range(world)):  # rank 0 last: it publishes once all manifests exist
        savers[r].save(step, per_rank[r], META)
    return savers


def _tp_split(name, full, dim, parts):
    """``parts`` ascending index lists of ``dim``: one ShardedTensor per owner (TP style)."""
    return [ShardedTensor.from_index(name, full.index_select(dim, torch.tensor(ix)), dim,
                                     torch.tensor(ix), full.shape[dim]) for ix in parts]


def _flat_split(name, full, cuts):
    flat = full.reshape(-1)
    bounds = [0, *cuts, flat.numel()]
    return [ShardedTensor.flat(name, flat[a:b].clone(), full.shape, a)
            for a, b in itertools.pairwise(bounds)]


def test_resharding_matches_brute_force_slicing(tmp_path):
    """Stored as TP shards with split index runs (like fused K/V) and as ZeRO-style flat
    ranges; loaded into random boxes and flat ranges: always the brute-force slice."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g)
    z = torch.randn(5, 7, generator=g)
    s = torch.tensor(3.0)
    w_parts = _tp_split("w", w, 0, [[0, 1, 4, 5], [2, 3, 6, 7]])  # two runs each
    z_parts = _flat_split("z", z, [4, 19])  # three DP ranks
    per_rank = [[w_parts[0], z_parts[0], ShardedTensor.whole("s", s)],
                [w_parts[1], z_parts[1]], [z_parts[2]]]
    store = ckpt.CheckpointStore.open(str(tmp_path))
    _save(store, 1, per_rank)
    assert store.committed_steps() == [1]
    rng = torch.Generator().manual_seed(1)
    for _ in range(40):
        for name, full in (("w", w), ("z", z)):
            lo = [int(torch.randint(0, n, (1,), generator=rng)) for n in full.shape]
            hi = [int(torch.randint(a + 1, n + 1, (1,), generator=rng))
                  for a, n in zip(lo, full.shape, strict=True)]
            box = torch.zeros([b - a for a, b in zip(lo, hi, strict=True)])
            a = int(torch.randint(0, full.numel(), (1,), generator=rng))
            b = int(torch.randint(a + 1, full.numel() + 1, (1,), generator=rng))
            flat = torch.zeros(b - a)
            got = ckpt.load(store, 1, [ShardedTensor.box(name, box, full.shape, lo),
                                       ShardedTensor.flat(name, flat, full.shape, a)])
            assert got == {name}
            want = full[tuple(slice(x, y) for x, y in zip(lo, hi, strict=True))]
            assert torch.equal(box, want)
            assert torch.equal(flat, full.reshape(-1)[a:b])
    t = torch.zeros(())
    ckpt.load(store, 1, [ShardedTensor.whole("s", t)])
    assert t.item() == 3.0


def test_a_box_reads_only_its_rows(tmp_path):
    full = torch.randn(100, 16)
    store = ckpt.CheckpointStore.open(str(tmp_path))
    _save(store, 2, [[ShardedTensor.whole("big", full)]])
    path = tmp_path / "step-2" / "rank-00000.safetensors"
    data = path.read_bytes()
    ranges = []

    def read(a, b):
        ranges.append((a, b))
        return data[a:b]

    f = SafetensorsFile("x", read)
    rows = f.read_rows(next(iter(f.entries)), 10, 12)
    assert torch.equal(rows, full[10:12])
    assert ranges[-1][1] - ranges[-1][0] == 2 * 16 * 4  # 2 rows of 16 fp32, nothing else


def test_a_killed_save_is_invisible_and_cleaned(tmp_path):
    store = ckpt.CheckpointStore.open(str(tmp_path))
    x = torch.arange(6.0)
    _save(store, 3, [[ShardedTensor.whole("x", x)]])
    # step 6: rank 1 wrote its shard, rank 0 died before writing (no manifest, no marker)
    r1 = ckpt.Checkpointer(store, 1, 2, async_save=False)
    r1.save(6, [], META)
    assert (tmp_path / "step-6.tmp" / "rank-00001.json").exists()
    assert store.latest_step() == 3
    # a rank 0 that gives up waiting for a rank publishes nothing
    r0 = ckpt.Checkpointer(store, 0, 3, async_save=True, commit_timeout_s=0.3)
    r0.save(7, [ShardedTensor.whole("x", x)], META)
    with pytest.raises(ckpt.CheckpointStorageError, match="did not finish"):
        r0.wait()
    assert store.latest_step() == 3
    # the next run's prepare() removes both before anyone saves
    ckpt.Checkpointer(store, 0, 1).prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-3"]


def test_retention_keeps_the_newest_k(tmp_path):
    store = ckpt.CheckpointStore.open(str(tmp_path))
    for step in range(1, 6):
        _save(store, step, [[ShardedTensor.whole("x", torch.full((2,), float(step)))]], keep=2)
    assert store.committed_steps() == [4, 5]
    assert (tmp_path / "latest").read_text() == "step-5"
    out = torch.zeros(2)
    ckpt.load(store, 5, [ShardedTensor.whole("x", out)])
    assert out.tolist() == [5.0, 5.0]


def test_async_save_snapshots_before_returning(tmp_path):
    store = ckpt.CheckpointStore.open(str(tmp_path))
    x = torch.ones(1000)
    saver = ckpt.Checkpointer(store, 0, 1, async_save=True)
    rec = saver.save(1, [ShardedTensor.whole("x", x)], META)
    x.mul_(5)  # training goes on while the writer thread runs
    saver.wait()
    assert rec.published and rec.bytes > 4000
    out = torch.zeros(1000)
    ckpt.load(store, 1, [ShardedTensor.whole("x", out)])
    assert torch.equal(out, torch.ones(1000))


def test_resume_validates_the_checkpoint_against_the_job(tmp_path):
    store = ckpt.CheckpointStore.open(str(tmp_path))
    _save(store, 1, [[ShardedTensor.whole("x", torch.zeros(4, 2))]])
    with pytest.raises(CheckpointFormatError, match=r"model.hidden=8, the job has 16"):
        ckpt.load(store, 1, [ShardedTensor.whole("x", torch.zeros(4, 2))],
                  model={"layers": 2, "hidden": 16})
    with pytest.raises(CheckpointFormatError, match=r"tensor x has shape \[4, 2\], the job "
                                                    r"expects \[4, 3\]"):
        ckpt.load(store, 1, [ShardedTensor.whole("x", torch.zeros(4, 3))])
    with pytest.raises(CheckpointFormatError, match="lacks tensor y"):
        ckpt.load(store, 1, [ShardedTensor.whole("y", torch.zeros(1))])
    # optimizer / outer / rng state may be absent (another optimizer or cross-DC mode)
    assert ckpt.load(store, 1, [ShardedTensor.whole("optim.x.exp_avg", torch.zeros(1))]) == set()


def test_merge_refuses_a_missing_or_duplicated_shard(tmp_path):
    store = ckpt.CheckpointStore.open(str(tmp_path))
    w = torch.randn(4, 2)
    half = _tp_split("w", w, 0, [[0, 1], [2, 3]])
    with pytest.raises(CheckpointFormatError, match="pieces hold 4 of 8 elements"):
        _save(store, 1, [[half[0]]])
    with pytest.raises(CheckpointFormatError, match="pieces hold 12 of 8"):
        _save(store, 2, [[half[0], half[1]], [half[1]]])
    assert store.latest_step() is None


def test_no_pickle_anywhere(tmp_path):
    """Every file of a checkpoint is JSON or safetensors (header JSON + raw bytes)."""
    store = ckpt.CheckpointStore.open(str(tmp_path))
    _save(store, 1, [[ShardedTensor.whole("x", torch.randn(3))]])
    for p in (tmp_path / "step-1").iterdir():
        raw = p.read_bytes()
        if p.suffix == ".safetensors":
            n = int.from_bytes(raw[:8], "little")
            json.loads(raw[8:8 + n])
            assert len(raw) == 8 + n + 3 * 4
        elif p.name != "COMMITTED":
            json.loads(raw)
    manifest = json.loads((tmp_path / "step-1" / "manifest.json").read_text())
    assert manifest["meta"]["step"] == 1 and math.prod(
        manifest["tensors"]["x"]["global_shape"]) == 3


def test_zero1_style_state_reshards_across_dp_degrees(tmp_path):
    """A model saved by DP replica 0 plus AdamW moments sharded over 2 replicas as flat ranges
    (the ``sharded`` hook of job_state) load into 3 replicas' ranges exactly."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    moments = {n: torch.randn(p.numel()) for n, p in model.named_parameters()}

    def zero_state(ranks, r, source):
        out = []
        for n, p in model.named_parameters():
            bounds = [p.numel() * i // ranks for i in range(ranks + 1)]
            a, b = bounds[r], bounds[r + 1]
            out.append(ShardedTensor.flat(f"optim.{n}.exp_avg", source[n][a:b], p.shape, a))
        return out

    store = ckpt.CheckpointStore.open(str(tmp_path))
    per_rank = [ckpt.job_state(model, None, dp_index=r, sharded=zero_state(2, r, moments))
                for r in range(2)]
    _save(store, 1, per_rank)
    for r in range(3):
        fresh = {n: torch.zeros(p.numel()) for n, p in model.named_parameters()}
        targets = ckpt.job_state(model, None, for_save=False,
                                 sharded=zero_state(3, r, fresh))
        loaded = ckpt.load(store, 1, targets)
        assert {"weight", "bias", "optim.weight.exp_avg"} <= loaded
        for n, p in model.named_parameters():
            bounds = [p.numel() * i // 3 for i in range(4)]
            a, b = bounds[r], bounds[r + 1]
            assert torch.equal(fresh[n][a:b], moments[n][a:b])
