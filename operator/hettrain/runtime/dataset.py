"""The runtime's data: a prepared token set (``hettrain data prepare``) or the synthetic pool.

Determinism contract (docs/data.md): the global batch of optimizer step ``k`` is rows
``k·B .. k·B+B-1`` of an endless sequence of training samples, ``B`` = the global batch in
sequences. Global row ``g`` is sample ``π_e(g mod N)`` of epoch ``e = g div N``, where ``N`` is
the number of samples in the train split and ``π_e`` a pseudo-random permutation of ``[0, N)``
keyed by ``(seed, e)`` (a Feistel network with cycle walking: O(1) memory, any ``N``). Sample
``j`` is tokens ``[j·S, j·S+S+1)`` of the split's token stream (``S`` = the model's sequence
length): inputs are the first ``S``, targets the last ``S``. Replica ``d`` owns rows
``[d·mb·M, (d+1)·mb·M)`` of the global batch and microbatch ``m`` the ``m``-th ``mb`` of them.
So the tokens of a step depend only on (seed, step, global batch), never on dp/pp/tp or the
microbatch split, and a resume on another layout continues with exactly the next tokens.

Validation batch ``v`` is rows ``v·B ..`` of the validation split's samples in order (wrapping).

A local path (a PVC mount) is memory-mapped in place; any other fsspec URI (``s3://...``) is
downloaded once into a cache directory, each file checked against its sha256, then mapped.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hettrain.data import tokenset as ts
from hettrain.data.tokenset import TokenSetError
from hettrain.runtime import data as synthetic

log = logging.getLogger("hettrain.runtime.dataset")
VERIFY_MODES = ("full", "size")
_M64 = (1 << 64) - 1
Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------- permutation


def _splitmix(x: int) -> int:
    """splitmix64 of a Python int (a well-mixed 64-bit key)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(v: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    v = v ^ (v >> np.uint64(30))
    v = v * np.uint64(0xBF58476D1CE4E5B9)
    v = v ^ (v >> np.uint64(27))
    v = v * np.uint64(0x94D049BB133111EB)
    return v ^ (v >> np.uint64(31))


def permute(idx: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """``π(idx)`` for a pseudo-random permutation ``π`` of ``[0, n)`` chosen by ``key``.

    A balanced Feistel network on the smallest even number of bits covering ``n`` is a
    permutation of that power-of-two domain; applying it again while a value is ``>= n``
    (cycle walking) restricts it to ``[0, n)``. Needs no table, so ``n`` can be any size.
    """
    idx = np.asarray(idx, dtype=np.uint64)
    if n < 1:
        raise ValueError(f"permutation of an empty range (n={n})")
    if np.any(idx >= np.uint64(n)):
        raise ValueError(f"index outside [0, {n})")
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64(_splitmix(key * 0x100000001B3 + r)) for r in range(rounds)]

    def once(v: np.ndarray) -> np.ndarray:
        left, right = v >> half, v & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    out = once(idx)
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = once(out[outside])
        outside = out >= np.uint64(n)
    return out


def epoch_key(seed: int, epoch: int) -> int:
    """The permutation key of one epoch."""
    return _splitmix(_splitmix(seed) ^ epoch)


# ---------------------------------------------------------------- token streams


class TokenStream:
    """One split's shards, memory-mapped, read as a single stream of token ids."""

    def __init__(self, directory: Path, split: ts.Split, dtype: str) -> None:
        self.split = split
        self.maps = [np.memmap(directory / s.file, dtype=np.dtype(dtype).newbyteorder("<"),
                               mode="r")
                     for s in split.shards if s.tokens]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        self.tokens = int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start+length)`` as int64 (may span shards)."""
        if start < 0 or start + length > self.tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the stream of "
                             f"{self.tokens}")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < length:
            offset = start + pos - int(self.starts[shard])
            take = min(length - pos, len(self.maps[shard]) - offset)
            out[pos:pos + take] = self.maps[shard][offset:offset + take]
            pos += take
            shard += 1
        return out


# ---------------------------------------------------------------- sources


class DataSource(Protocol):
    """What the trainer reads: a step's global batch (each replica cuts its rows from it,
    :func:`rows_microbatches`) and validation batches."""

    def validation_batch(self, index: int, batch: int) -> Batch:
        """Validation batch ``index`` of ``batch`` sequences."""
        ...

    def global_batch(self, seed: int, step: int, batch: int) -> Batch:
        """The whole global batch (``batch`` rows) of optimizer step ``step``."""
        ...


def rows_microbatches(x: torch.Tensor, y: torch.Tensor, offset: int, micro_batch: int,
                      num_microbatches: int) -> list[Batch]:
    """Rows ``[offset, offset + micro_batch·num_microbatches)`` of a global batch, cut into
    microbatches (a replica of a replica group: its group's row offset, then its block)."""
    end = offset + micro_batch * num_microbatches
    if offset < 0 or end > x.shape[0]:
        raise ValueError(f"rows [{offset}, {end}) outside a global batch of {x.shape[0]}")
    return [(x[a:a + micro_batch], y[a:a + micro_batch])
            for a in range(offset, end, micro_batch)]


@dataclass
class SyntheticData:
    """The synthetic pool of :mod:`hettrain.runtime.data` (``spec.data.synthetic: true``)."""

    seed: int
    seq_len: int
    vocab: int

    def global_batch(self, seed: int, step: int, batch: int) -> Batch:
        """As :func:`hettrain.runtime.data.global_batch`."""
        return synthetic.global_batch(seed, step, batch, self.seq_len, self.vocab)

    def validation_batch(self, index: int, batch: int) -> Batch:
        """Draws from the same pool with other indices: there is no held-out synthetic data."""
        return synthetic.global_batch(self.seed, -1 - index, batch, self.seq_len, self.vocab)


class TokenDataset:
    """A verified token set, read as fixed-length samples (see the module docstring)."""

    def __init__(self, directory: str | Path, *, seq_len: int, model_vocab: int,
                 verify: str = "full", where: str = "spec.data.uri") -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: must be one of {VERIFY_MODES}")
        self.directory = Path(directory)
        self.manifest = ts.read_manifest(self.directory)
        ts.check_model_vocab(self.manifest, model_vocab, dataset=str(directory))
        ts.verify_files(self.directory, self.manifest, checksums=verify == "full")
        self.seq_len = seq_len
        self.train = TokenStream(self.directory, self.manifest.splits["train"],
                                 self.manifest.dtype)
        self.validation = TokenStream(self.directory, self.manifest.splits["validation"],
                                      self.manifest.dtype)
        self.train_samples = max(0, (self.train.tokens - 1) // seq_len)
        self.validation_samples = max(0, (self.validation.tokens - 1) // seq_len)
        if self.train_samples < 1:
            raise TokenSetError(f"{where}: the train split of {directory} has "
                                f"{self.train.tokens} tokens, fewer than seqLen+1 = "
                                f"{seq_len + 1}; prepare more text or lower spec.model.seqLen")
        top = max(int(m.max(initial=0)) for m in self.train.maps) if verify == "full" else 0
        if top >= model_vocab:  # (read anyway for the sha256) ids the embedding cannot take
            raise TokenSetError(f"{where}: token id {top} in {directory} >= the model vocab "
                                f"{model_vocab}")

    def sample(self, j: int, split: str = "train") -> np.ndarray:
        """Sample ``j`` of ``split``: ``seq_len + 1`` tokens."""
        stream = self.train if split == "train" else self.validation
        return stream.window(j * self.seq_len, self.seq_len + 1)

    def sample_ids(self, seed: int, step: int, batch: int) -> np.ndarray:
        """The train sample index of every row of step ``step``'s global batch."""
        g = step * batch + np.arange(batch, dtype=np.int64)
        n = self.train_samples
        epochs, pos = g // n, g % n
        out = np.empty(batch, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = permute(pos[sel].astype(np.uint64), n, epoch_key(seed, int(e)))
        return out

    def global_batch(self, seed: int, step: int, batch: int) -> Batch:
        """``(inputs, targets)`` of shape ``[batch, seq_len]`` for optimizer step ``step``."""
        rows = np.stack([self.sample(int(j)) for j in self.sample_ids(seed, step, batch)])
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def validation_batch(self, index: int, batch: int) -> Batch:
        """Validation rows ``index·batch ..`` in order, wrapping around the split."""
        if self.validation_samples < 1:
            raise TokenSetError(f"{self.directory}: no validation split with at least "
                                f"{self.seq_len + 1} tokens (prepare with "
                                "--validation-fraction > 0 and more text)")
        ids = (index * batch + np.arange(batch)) % self.validation_samples
        t = torch.from_numpy(np.stack([self.sample(int(j), "validation") for j in ids]))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


# ---------------------------------------------------------------- opening


def default_cache_dir() -> Path:
    """Where object-store token sets are downloaded when ``HETTRAIN_DATA_CACHE`` is unset."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hettrain" / "data"


def materialize(uri: str, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding the token set at ``uri``: the path itself when local, else a
    verified download (fsspec) into ``cache_dir`` (reused when already complete)."""
    if ts.is_local(uri):
        path = ts.local_path(uri)
        if not path.is_dir():
            raise TokenSetError(f"spec.data.uri: {uri}: no such directory; run 'hettrain data "
                                "prepare' or fix the path (a PVC is mounted at spec.data.pvc's "
                                "mount point)")
        return path
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri)
        text = fs.cat_file(f"{root.rstrip('/')}/{ts.MANIFEST}")
    except FileNotFoundError:
        raise TokenSetError(f"spec.data.uri: {uri}: no {ts.MANIFEST} there; upload a token set "
                            "written by 'hettrain data prepare'") from None
    except Exception as exc:  # credentials, endpoint, missing fsspec backend ...
        raise TokenSetError(f"spec.data.uri: {uri}: cannot read "
                            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    manifest = ts.manifest_from_bytes(text, f"{uri}/{ts.MANIFEST}")
    digest = hashlib.sha256(uri.encode() + b"\0" + text).hexdigest()[:16]
    dest = Path(cache_dir or default_cache_dir()) / digest
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest.files():
        target = dest / entry.file
        if target.is_file() and ts.sha256_file(target) == entry.sha256:
            continue
        tmp = dest / f".{entry.file}.{os.getpid()}"
        try:
            fs.get_file(f"{root.rstrip('/')}/{entry.file}", str(tmp))
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            raise TokenSetError(f"spec.data.uri: {uri}/{entry.file}: cannot download "
                                f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
                                ) from None
        if ts.sha256_file(tmp) != entry.sha256:
            tmp.unlink(missing_ok=True)
            raise TokenSetError(f"{uri}/{entry.file}: sha256 differs from the manifest; the "
                                "object is corrupt or was changed")
        os.replace(tmp, target)
    tmp = dest / f".{ts.MANIFEST}.{os.getpid()}"
    tmp.write_bytes(text)
    os.replace(tmp, dest / ts.MANIFEST)  # last: a complete copy has its manifest
    log.info("token set %s cached in %s", uri, dest)
    return dest


def open_data(data: dict[str, Any], *, seed: int, seq_len: int, vocab: int,
              verify: str = "full", cache_dir: str | Path | None = None) -> DataSource:
    """The source a plan's ``data`` section names: the synthetic pool only when it says
    ``synthetic``; a plan without data is refused (ValueError naming ``plan.data``)."""
    uri = data.get("uri")
    if data.get("synthetic"):
        return SyntheticData(seed, seq_len, vocab)
    if not uri:
        raise ValueError(f"plan.data={data!r} names no data: set spec.data.uri, spec.data.pvc "
                         "+ path, or spec.data.synthetic: true")
    local = materialize(uri, cache_dir)
    if not ts.is_local(uri):
        verify = "size"  # every file was just checked against its sha256
    return TokenDataset(local, seq_len=seq_len, model_vocab=vocab, verify=verify)
