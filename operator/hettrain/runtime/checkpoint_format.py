"""The on-storage checkpoint format: per-rank safetensors shards + JSON manifests, no pickle.

A checkpoint is a set of **named global tensors** (``layers.7.attn.q.weight``,
``optim.layers.7.attn.q.weight.exp_avg``, ``outer.<param>.momentum``, ...). Every rank presents
the part it owns as a :class:`ShardedTensor`: the global name, the global shape, and one or more
:class:`Piece` s, each a local tensor placed in the global tensor either

- as a **box** (``offsets``: the global index of its first element in every dimension; its
  extent is the local tensor's shape) -- a TP shard, a pipeline stage's layer, a replicated
  tensor (offsets all zero), or
- as a **flat range** (``flat_start``: the local 1-D tensor is elements ``[flat_start,
  flat_start + numel)`` of the global tensor in row-major order) -- the way an optimizer whose
  state is sharded over data parallelism (ZeRO-1) partitions flattened parameters.

Each rank writes ITS OWN pieces (nothing is gathered) into one safetensors file and describes
them in a small JSON manifest; rank 0 merges the per-rank manifests into ``manifest.json``. A
loader asks for the pieces it needs in the same terms (a box or flat range of each global name
in its own layout) and reads only the overlapping stored pieces -- for a box, only the rows of
the first dimension it needs -- so any checkpoint loads into any pp/tp/dp layout. Reading parses
the safetensors header (JSON) and copies raw bytes: nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import torch

FORMAT = "hettrain-checkpoint/1"

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


class CheckpointFormatError(ValueError):
    """A checkpoint's files or manifest are inconsistent or do not fit the job."""


@dataclass(frozen=True)
class Piece:
    """A local tensor and where it sits in the global tensor (a box or a flat range)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...] | None = None
    flat_start: int | None = None

    def __post_init__(self) -> None:
        if (self.offsets is None) == (self.flat_start is None):
            raise ValueError("a Piece has exactly one of offsets (box) or flat_start (flat)")
        if self.flat_start is not None and self.tensor.dim() != 1:
            raise ValueError("a flat Piece holds a 1-D tensor")


@dataclass
class ShardedTensor:
    """One global tensor as this rank holds it: global name, global shape, local pieces."""

    name: str
    global_shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> ShardedTensor:
        """A tensor held in full (replicated or unsharded)."""
        return cls(name, tuple(tensor.shape), [Piece(tensor, offsets=(0,) * tensor.dim())])

    @classmethod
    def box(cls, name: str, tensor: torch.Tensor, global_shape: Sequence[int],
            offsets: Sequence[int]) -> ShardedTensor:
        """One contiguous block of a larger tensor, at ``offsets``."""
        return cls(name, tuple(global_shape), [Piece(tensor, offsets=tuple(offsets))])

    @classmethod
    def flat(cls, name: str, tensor: torch.Tensor, global_shape: Sequence[int],
             flat_start: int) -> ShardedTensor:
        """Elements ``[flat_start, flat_start + numel)`` of the flattened global tensor."""
        return cls(name, tuple(global_shape), [Piece(tensor.reshape(-1), flat_start=flat_start)])

    @classmethod
    def from_index(cls, name: str, tensor: torch.Tensor, dim: int,
                   index: torch.Tensor, global_size: int) -> ShardedTensor:
        """A shard holding global positions ``index`` (ascending) of dimension ``dim``:
        one box per contiguous run (e.g. the K and V halves of a fused TP shard)."""
        shape = list(tensor.shape)
        shape[dim] = global_size
        pieces, local = [], 0
        for start, length in _runs(index.tolist()):
            offsets = [0] * tensor.dim()
            offsets[dim] = start
            pieces.append(Piece(tensor.narrow(dim, local, length), offsets=tuple(offsets)))
            local += length
        return cls(name, tuple(shape), pieces)


def _runs(index: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs ``(start, length)`` of an ascending index list."""
    runs: list[tuple[int, int]] = []
    for i in index:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _raw(t: torch.Tensor) -> bytes:
    """The little-endian bytes of a CPU tensor (any dtype)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_safetensors(f: IO[bytes], tensors: Sequence[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> int:
    """Stream ``tensors`` into ``f`` in the safetensors layout; returns the bytes written.

    One tensor is converted at a time, so the peak extra memory is the largest tensor, not
    the file. The result loads with ``safetensors.torch.load_file``.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for key, t in tensors:
        if t.dtype not in DTYPES:
            raise CheckpointFormatError(f"tensor {key}: dtype {t.dtype} not storable")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for _, t in tensors:
        f.write(_raw(t))
    return 8 + len(blob) + offset


Reader = Callable[[int, int], bytes]  # (start, end) byte range of one file


class SafetensorsFile:
    """Range reads of one safetensors file through ``read(start, end)`` (header parsed once)."""

    def __init__(self, name: str, read: Reader) -> None:
        self.name, self._read = name, read
        (n,) = struct.unpack("<Q", read(0, 8))
        if n > 100 * 2**20:
            raise CheckpointFormatError(f"{name}: safetensors header of {n} bytes is corrupt")
        header = json.loads(read(8, 8 + n))
        self.metadata = header.pop("__metadata__", {})
        self.entries: dict[str, dict[str, Any]] = header
        self.data_start = 8 + n

    def read_rows(self, key: str, row_start: int = 0, row_end: int | None = None) -> torch.Tensor:
        """Rows ``[row_start, row_end)`` of the first dimension of tensor ``key`` (all of a
        0-d tensor); only those bytes are read."""
        e = self.entries.get(key)
        if e is None:
            raise CheckpointFormatError(f"{self.name}: no tensor {key!r}")
        dtype = TORCH_DTYPES.get(e["dtype"])
        if dtype is None:
            raise CheckpointFormatError(f"{self.name}: tensor {key!r} dtype {e['dtype']}")
        shape = list(e["shape"])
        begin, end = e["data_offsets"]
        if shape:
            row_end = shape[0] if row_end is None else row_end
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + row_start * row_bytes, begin + row_end * row_bytes
            shape[0] = row_end - row_start
        data = self._read(self.data_start + begin, self.data_start + end)
        if len(data) != end - begin:
            raise CheckpointFormatError(f"{self.name}: tensor {key!r} is truncated")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def piece_entries(st: ShardedTensor, prefix_key: str) -> list[tuple[str, Piece, dict]]:
    """(safetensors key, piece, manifest record) for each piece of ``st``."""
    out = []
    for i, p in enumerate(st.pieces):
        key = f"{prefix_key}{st.name}#{i}"
        rec: dict[str, Any] = {"key": key}
        if p.offsets is not None:
            rec.update(offsets=list(p.offsets), shape=list(p.tensor.shape))
        else:
            rec.update(flat_start=p.flat_start, numel=p.tensor.numel())
        out.append((key, p, rec))
    return out


def _numel(rec: dict) -> int:
    return rec["numel"] if "flat_start" in rec else math.prod(rec["shape"])


def merge_manifests(rank_manifests: Iterable[dict], meta: dict) -> dict:
    """One checkpoint manifest from the per-rank ones; checks every tensor is covered exactly
    once (the sum of its pieces equals its size) with one shape and dtype."""
    tensors: dict[str, dict[str, Any]] = {}
    for m in rank_manifests:
        for name, t in m["tensors"].items():
            cur = tensors.setdefault(name, {"global_shape": t["global_shape"],
                                            "dtype": t["dtype"], "pieces": []})
            if cur["global_shape"] != t["global_shape"] or cur["dtype"] != t["dtype"]:
                raise CheckpointFormatError(
                    f"tensor {name}: rank {m['rank']} wrote shape {t['global_shape']} "
                    f"{t['dtype']}, another rank {cur['global_shape']} {cur['dtype']}")
            cur["pieces"].extend({**p, "file": m["file"]} for p in t["pieces"])
    for name, t in tensors.items():
        have, want = sum(_numel(p) for p in t["pieces"]), math.prod(t["global_shape"])
        if have != want:
            raise CheckpointFormatError(f"tensor {name}: pieces hold {have} of {want} elements "
                                        "(a shard is missing or written twice)")
    return {"format": FORMAT, "meta": meta, "tensors": tensors}


def _flat_index(rec_or_piece: dict, global_shape: Sequence[int]) -> torch.Tensor:
    """Global row-major flat indices of a box or flat range (ascending)."""
    if "flat_start" in rec_or_piece:
        return torch.arange(rec_or_piece["flat_start"],
                            rec_or_piece["flat_start"] + rec_or_piece["numel"])
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    idx = torch.zeros((), dtype=torch.long)
    for d, (o, n) in enumerate(zip(rec_or_piece["offsets"], rec_or_piece["shape"], strict=True)):
        idx = idx.unsqueeze(-1) + (torch.arange(o, o + n) * strides[d])
    return idx.reshape(-1)


def _target_rec(p: Piece) -> dict:
    if p.offsets is not None:
        return {"offsets": list(p.offsets), "shape": list(p.tensor.shape)}
    return {"flat_start": p.flat_start, "numel": p.tensor.numel()}


def fill_piece(target: Piece, name: str, entry: dict, open_file: Callable[[str], SafetensorsFile]
               ) -> int:
    """Copy every stored piece of ``entry`` overlapping ``target`` into it; returns the number
    of target elements filled (the caller checks full coverage)."""
    shape = entry["global_shape"]
    tgt = _target_rec(target)
    filled = 0
    for src in entry["pieces"]:
        if "offsets" in src and "offsets" in tgt:
            lo = [max(a, b) for a, b in zip(src["offsets"], tgt["offsets"], strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(
                src["offsets"], src["shape"], tgt["offsets"], tgt["shape"], strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            f = open_file(src["file"])
            if not shape:  # a 0-d tensor
                data = f.read_rows(src["key"])
                target.tensor.copy_(data)
                filled += 1
                continue
            r0 = lo[0] - src["offsets"][0]
            data = f.read_rows(src["key"], r0, hi[0] - src["offsets"][0])
            s_sl = tuple([slice(0, hi[0] - lo[0])] + [
                slice(low - o, h - o) for low, h, o in zip(lo[1:], hi[1:], src["offsets"][1:],
                                                          strict=True)])
            t_sl = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, tgt["offsets"],
                                                                    strict=True))
            with torch.no_grad():
                target.tensor[t_sl].copy_(data[s_sl])
            filled += math.prod(h - low for low, h in zip(lo, hi, strict=True))
            continue
        # a flat range on either side: match global flat indices (both ascending)
        s_idx, t_idx = _flat_index(src, shape), _flat_index(tgt, shape)
        if s_idx.numel() == 0 or t_idx.numel() == 0 or s_idx[-1] < t_idx[0] \
                or t_idx[-1] < s_idx[0]:
            continue
        pos = torch.searchsorted(s_idx, t_idx).clamp(max=s_idx.numel() - 1)
        hit = s_idx[pos] == t_idx
        if not bool(hit.any()):
            continue
        data = open_file(src["file"]).read_rows(src["key"]).reshape(-1)
        with torch.no_grad():
            flat = target.tensor.view(-1) if target.tensor.is_contiguous() else None
            if flat is None:
                raise CheckpointFormatError(f"tensor {name}: target piece not contiguous")
            flat[hit] = data[pos[hit]].to(flat.dtype)
        filled += int(hit.sum())
    return filled


def range_boxes(shape: Sequence[int], start: int, end: int
                ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``[start, end)`` (row-major) of a tensor of ``shape`` as boxes ``(offsets,
    extent)``, in order; each box is a contiguous run of the flat range, so the boxes' element
    counts sum to ``end - start`` and consecutive boxes continue where the previous ended."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(end, row)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if r0 == r1:
        return [((r0, *o), (1, *e)) for o, e in range_boxes(shape[1:], c0, c1)]
    if c0:
        out += [((r0, *o), (1, *e)) for o, e in range_boxes(shape[1:], c0, row)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if c1:
        out += [((r1, *o), (1, *e)) for o, e in range_boxes(shape[1:], 0, c1)]
    return out


def local_range_pieces(data: torch.Tensor, local_shape: Sequence[int], start: int, *,
                       dim: int | None = None, index: Sequence[int] | None = None
                       ) -> list[Piece]:
    """Box pieces of the GLOBAL tensor holding ``data``: elements ``[start, start +
    data.numel())`` of a local tensor of ``local_shape``, whose position ``i`` along ``dim``
    is global position ``index[i]`` (a TP shard; ``dim=None``: the local tensor is the global
    one). The pieces are views of ``data`` (no copy): a ZeRO-1 optimizer slice of a flat
    buffer, saved or loaded in place, reshards onto any tp/dp layout."""
    out, pos = [], 0
    for offsets, extent in range_boxes(local_shape, start, start + data.numel()):
        n = math.prod(extent)
        box = data[pos:pos + n].view(extent)
        pos += n
        if dim is None or index is None:
            out.append(Piece(box, offsets=offsets))
            continue
        lo, local = offsets[dim], 0
        for run_start, length in _runs([int(i) for i in index[lo:lo + extent[dim]]]):
            glob = list(offsets)
            glob[dim] = run_start
            out.append(Piece(box.narrow(dim, local, length), offsets=tuple(glob)))
            local += length
    return out
