"""The runtime's token-set reader: samples are exact windows of the stream, each epoch is a
permutation, the global batch of a step is the same for every dp / microbatch layout, the
validation split is read in order, and a bad or mismatched token set is refused at start-up."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from tests.data.conftest import CORPUS, TOKENIZER

from hettrain.data import tokenset as ts
from hettrain.data.prepare import PrepareOptions, prepare
from hettrain.data.tokenset import TokenSetError
from hettrain.runtime.dataset import (
    SyntheticData,
    TokenDataset,
    epoch_key,
    open_data,
    permute,
    rows_microbatches,
)

SEQ = 32
VOCAB = 2048


def _tokens(directory: Path, split: str) -> np.ndarray:
    m = ts.read_manifest(directory)
    return np.concatenate([np.fromfile(directory / s.file, dtype="<u2")
                           for s in m.splits[split].shards]).astype(np.int64)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 4099])
def test_permute_is_a_bijection_of_0_n_and_depends_on_the_key(n):
    seen = [permute(np.arange(n, dtype=np.uint64), n, key) for key in (1, 2)]
    for p in seen:
        assert np.array_equal(np.sort(p), np.arange(n))
    if n >= 64:
        assert not np.array_equal(seen[0], seen[1])
        assert not np.array_equal(seen[0], np.arange(n))  # actually shuffled
    one = [int(permute(np.array([i], dtype=np.uint64), n, 1)[0]) for i in range(min(n, 50))]
    assert one == seen[0][: len(one)].tolist()  # element-wise == whole-array


def test_samples_are_windows_of_the_stream_and_epochs_cover_every_sample(opticks_set):
    ds = TokenDataset(opticks_set, seq_len=SEQ, model_vocab=VOCAB)
    stream = _tokens(opticks_set, "train")
    assert ds.train_samples == (len(stream) - 1) // SEQ
    for j in (0, 1, 17, ds.train_samples - 1):
        assert np.array_equal(ds.sample(j), stream[j * SEQ:j * SEQ + SEQ + 1])
    batch = 64
    steps = -(-2 * ds.train_samples // batch)  # two epochs and a bit
    ids = np.concatenate([ds.sample_ids(5, k, batch) for k in range(steps)])
    n = ds.train_samples
    for e in range(2):
        assert np.array_equal(np.sort(ids[e * n:(e + 1) * n]), np.arange(n))
    assert not np.array_equal(ids[:n], ids[n:2 * n])  # a new order every epoch
    assert np.array_equal(ids[:n], permute(np.arange(n, dtype=np.uint64), n, epoch_key(5, 0)))
    x, y = ds.global_batch(5, 3, 8)
    want = np.stack([stream[j * SEQ:j * SEQ + SEQ + 1] for j in ds.sample_ids(5, 3, 8)])
    assert torch.equal(x, torch.from_numpy(want[:, :-1])) and torch.equal(
        y, torch.from_numpy(want[:, 1:]))
    assert x.dtype == torch.int64 and x.shape == (8, SEQ)


LAYOUTS = [(1, 16, 1), (1, 1, 16), (2, 2, 4), (4, 1, 4), (8, 2, 1), (16, 1, 1)]  # dp, mb, M


@pytest.mark.parametrize("step", [0, 1, 7, 250])
def test_the_global_batch_of_a_step_is_the_same_for_every_layout(opticks_set, step):
    ds = TokenDataset(opticks_set, seq_len=SEQ, model_vocab=VOCAB, verify="size")
    batches = []
    for dp, mb, m in LAYOUTS:  # each replica's rows, cut as the trainer cuts them
        x, y = ds.global_batch(11, step, dp * mb * m)
        rows = [b for d in range(dp) for b in rows_microbatches(x, y, d * mb * m, mb, m)]
        assert all(x.shape == (mb, SEQ) for x, _ in rows) and len(rows) == dp * m
        batches.append((torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])))
    for x, y in batches[1:]:
        assert torch.equal(x, batches[0][0]) and torch.equal(y, batches[0][1])
    other = ds.global_batch(12, step, 16)[0]
    assert not torch.equal(other, batches[0][0])  # the seed matters


def test_validation_batches_read_the_validation_split_in_order(opticks_set):
    ds = TokenDataset(opticks_set, seq_len=SEQ, model_vocab=VOCAB)
    val = _tokens(opticks_set, "validation")
    nv = ds.validation_samples
    assert nv == (len(val) - 1) // SEQ > 4
    x, y = ds.validation_batch(1, 4)
    for r in range(4):
        j = (4 + r) % nv
        assert x[r].tolist() == val[j * SEQ:j * SEQ + SEQ].tolist()
        assert y[r].tolist() == val[j * SEQ + 1:j * SEQ + SEQ + 1].tolist()
    train = _tokens(opticks_set, "train")
    assert not any(np.array_equal(x[0].numpy(), train[i:i + SEQ]) for i in range(0, 4000))


def test_tokenizer_larger_than_the_model_vocab_is_refused_naming_the_field(opticks_set):
    with pytest.raises(TokenSetError, match=r"spec.model.vocab: 1000 is smaller than the "
                                            r"tokenizer vocabulary .* \(2048\); set the model "
                                            r"vocab to at least 2048"):
        open_data({"uri": str(opticks_set)}, seed=1, seq_len=SEQ, vocab=1000)


def test_too_long_sequences_and_missing_sets_are_refused(opticks_set, tmp_path):
    with pytest.raises(TokenSetError, match="fewer than seqLen"):
        TokenDataset(opticks_set, seq_len=10**6, model_vocab=VOCAB)
    with pytest.raises(TokenSetError, match=r"spec.data.uri: .*nowhere: no such directory"):
        open_data({"uri": str(tmp_path / "nowhere")}, seed=1, seq_len=SEQ, vocab=VOCAB)


def test_a_changed_shard_fails_start_up_checks(opticks_set, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(opticks_set, copy)
    shard = copy / "train-00000.bin"
    blob = bytearray(shard.read_bytes())
    blob[10] ^= 0x40
    shard.write_bytes(bytes(blob))
    with pytest.raises(TokenSetError, match="sha256 differs"):
        TokenDataset(copy, seq_len=SEQ, model_vocab=VOCAB)
    TokenDataset(copy, seq_len=SEQ, model_vocab=VOCAB, verify="size")  # size-only: accepted
    shard.write_bytes(bytes(blob[:-2]))
    with pytest.raises(TokenSetError, match="truncated"):
        TokenDataset(copy, seq_len=SEQ, model_vocab=VOCAB, verify="size")


def test_an_object_store_uri_is_downloaded_verified_and_reads_the_same(opticks_set, tmp_path):
    fs = fsspec.filesystem("memory")
    for f in opticks_set.iterdir():
        fs.pipe_file(f"/sets/opticks/{f.name}", f.read_bytes())
    cache = tmp_path / "cache"
    remote = open_data({"uri": "memory://sets/opticks"}, seed=4, seq_len=SEQ, vocab=VOCAB,
                       cache_dir=cache)
    local = open_data({"uri": str(opticks_set)}, seed=4, seq_len=SEQ, vocab=VOCAB)
    for step in (0, 9):
        # replica 1 of 2, two microbatches of 2 sequences
        a = rows_microbatches(*remote.global_batch(4, step, 8), 4, 2, 2)
        b = rows_microbatches(*local.global_batch(4, step, 8), 4, 2, 2)
        assert len(a) == len(b) == 2
        assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
                   for p, q in zip(a, b, strict=True))
    assert len([p for p in cache.rglob("*") if p.is_file()]) == len(list(opticks_set.iterdir()))
    blob = bytearray(fs.cat_file("/sets/opticks/validation-00000.bin"))
    blob[0] ^= 1
    fs.pipe_file("/sets/opticks/validation-00000.bin", bytes(blob))
    fs.pipe_file("/sets/opticks/manifest.json",  # a new manifest: a new cache entry
                 fs.cat_file("/sets/opticks/manifest.json") + b" ")
    with pytest.raises(TokenSetError, match=r"validation-00000\.bin: sha256 differs"):
        open_data({"uri": "memory://sets/opticks"}, seed=4, seq_len=SEQ, vocab=VOCAB,
                  cache_dir=cache)
    with pytest.raises(TokenSetError, match=r"memory://sets/none: no manifest.json there"):
        open_data({"uri": "memory://sets/none"}, seed=4, seq_len=SEQ, vocab=VOCAB,
                  cache_dir=cache)


def test_synthetic_only_when_the_plan_says_so(opticks_set):
    assert isinstance(open_data({"synthetic": True}, seed=1, seq_len=SEQ, vocab=256),
                      SyntheticData)
    with pytest.raises(ValueError, match="names no data"):  # no data section: refused
        open_data({}, seed=1, seq_len=SEQ, vocab=256)
    assert isinstance(open_data({"uri": str(opticks_set)}, seed=1, seq_len=SEQ, vocab=VOCAB),
                      TokenDataset)


def test_samples_spanning_shard_boundaries_read_like_one_stream(opticks_set, tmp_path):
    out = tmp_path / "sharded"
    prepare(PrepareOptions(inputs=(str(CORPUS),), out=str(out), tokenizer=str(TOKENIZER),
                           text_unit="paragraph", shard_tokens=1000))
    sharded = TokenDataset(out, seq_len=SEQ, model_vocab=VOCAB)
    whole = TokenDataset(opticks_set, seq_len=SEQ, model_vocab=VOCAB)
    assert len(sharded.train.maps) > 70
    assert sharded.train_samples == whole.train_samples
    for j in range(0, whole.train_samples, 7):  # many windows straddle a 1000-token boundary
        assert np.array_equal(sharded.sample(j), whole.sample(j)), j
    assert torch.equal(sharded.global_batch(3, 5, 16)[0], whole.global_batch(3, 5, 16)[0])
