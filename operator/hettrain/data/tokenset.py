"""The token set format written by ``hettrain data prepare`` and read by the runtime.

A token set is one directory::

    manifest.json        format, tokenizer (sha256, vocab size, EOS id), dtype, splits
    tokenizer.json       the tokenizer it was made with (its sha256 is the tokenizer hash)
    train-00000.bin      raw little-endian token ids (dtype), documents packed, EOS after each
    train.idx            uint64 little-endian: end offset of every document in the split
    validation-00000.bin, validation.idx

Each split is one token stream cut into shards of at most ``shard_tokens`` tokens (a document
may continue in the next shard); the index gives the document boundaries in the stream. The
manifest lists every file with its sha256 and the token count of every shard.

This module is the standard library only: it parses and checks a manifest, so ``hettrain
validate`` can compare a local dataset's vocabulary with the model's without numpy or torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "hettrain-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "validation")
DTYPES = {"uint16": 2, "uint32": 4}
UINT16_MAX_VOCAB = 65536


class TokenSetError(ValueError):
    """A token set (or its manifest) is missing, malformed or does not fit the job."""


def dtype_for_vocab(vocab_size: int) -> str:
    """``uint16`` when every id fits (vocab ≤ 65536), else ``uint32``."""
    if vocab_size < 1:
        raise ValueError(f"vocab size must be >= 1 (got {vocab_size})")
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def shard_name(split: str, index: int) -> str:
    """File name of shard ``index`` of ``split``."""
    return f"{split}-{index:05d}.bin"


def index_name(split: str) -> str:
    """File name of the document index of ``split``."""
    return f"{split}.idx"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a split: name, sha256, size in bytes, and for a shard its token count."""

    file: str
    sha256: str
    bytes: int
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Split:
    """One split: its shards in stream order, its document index, totals."""

    name: str
    tokens: int
    documents: int
    shards: tuple[FileEntry, ...]
    index: FileEntry


@dataclass(frozen=True, slots=True)
class Manifest:
    """A parsed ``manifest.json``."""

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str
    splits: Mapping[str, Split]
    raw: Mapping[str, Any]

    @property
    def itemsize(self) -> int:
        """Bytes per token."""
        return DTYPES[self.dtype]

    def files(self) -> list[FileEntry]:
        """Every file the manifest vouches for (shards, indexes, the tokenizer)."""
        out = [FileEntry(TOKENIZER, self.tokenizer_sha256, -1)]
        for s in self.splits.values():
            out.extend(s.shards)
            out.append(s.index)
        return out


def _need(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise TokenSetError(f"{where}: missing {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TokenSetError(f"{where}.{key}: wrong type {type(value).__name__}")
    return value


def _file(d: Any, where: str, *, shard: bool) -> FileEntry:
    name = _need(d, "file", str, where)
    if "/" in name or name in ("", ".", ".."):
        raise TokenSetError(f"{where}.file: {name!r} must be a plain file name")
    entry = FileEntry(name, _need(d, "sha256", str, where), _need(d, "bytes", int, where),
                      _need(d, "tokens", int, where) if shard else 0)
    if entry.bytes < 0 or entry.tokens < 0:
        raise TokenSetError(f"{where}: negative size")
    return entry


def parse_manifest(data: Any, where: str = MANIFEST) -> Manifest:
    """Check a manifest dict (from JSON) and return it parsed; errors name the key."""
    if not isinstance(data, Mapping):
        raise TokenSetError(f"{where}: must be a JSON object")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise TokenSetError(f"{where}: not a {FORMAT} v{VERSION} manifest (format="
                            f"{data.get('format')!r}, version={data.get('version')!r}); "
                            "write it with 'hettrain data prepare'")
    dtype = _need(data, "dtype", str, where)
    if dtype not in DTYPES:
        raise TokenSetError(f"{where}.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    tok = _need(data, "tokenizer", Mapping, where)
    vocab = _need(tok, "vocab_size", int, f"{where}.tokenizer")
    eos = _need(tok, "eos_id", int, f"{where}.tokenizer")
    if dtype != dtype_for_vocab(vocab):
        raise TokenSetError(f"{where}.dtype: {dtype} does not match vocab_size {vocab}")
    if not 0 <= eos < vocab:
        raise TokenSetError(f"{where}.tokenizer.eos_id: {eos} outside the vocabulary [0, {vocab})")
    splits_raw = _need(data, "splits", Mapping, where)
    splits = {}
    for name in SPLITS:
        w = f"{where}.splits.{name}"
        s = _need(splits_raw, name, Mapping, f"{where}.splits")
        shards_raw = _need(s, "shards", list, w)
        shards = tuple(_file(x, f"{w}.shards[{i}]", shard=True)
                       for i, x in enumerate(shards_raw))
        split = Split(name, _need(s, "tokens", int, w), _need(s, "documents", int, w), shards,
                      _file(_need(s, "index", Mapping, w), f"{w}.index", shard=False))
        if sum(x.tokens for x in shards) != split.tokens:
            raise TokenSetError(f"{w}.tokens: {split.tokens} is not the sum of its shards")
        for i, x in enumerate(shards):
            if x.bytes != x.tokens * DTYPES[dtype]:
                raise TokenSetError(f"{w}.shards[{i}]: {x.bytes} bytes for {x.tokens} {dtype} "
                                    "tokens")
        if split.index.bytes != 8 * split.documents:
            raise TokenSetError(f"{w}.index: {split.index.bytes} bytes for "
                                f"{split.documents} documents")
        splits[name] = split
    return Manifest(dtype=dtype, vocab_size=vocab, eos_id=eos,
                    tokenizer_sha256=_need(tok, "sha256", str, f"{where}.tokenizer"),
                    splits=splits, raw=dict(data))


def read_manifest(directory: str | Path) -> Manifest:
    """The parsed manifest of a local token set directory."""
    path = Path(directory) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TokenSetError(f"{path}: no such file; is {directory} a token set written by "
                            "'hettrain data prepare'?") from None
    except OSError as exc:
        raise TokenSetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return manifest_from_bytes(raw, str(path))


def manifest_from_bytes(raw: bytes, where: str) -> Manifest:
    """The parsed manifest from a ``manifest.json``'s bytes (a local file or an object store's);
    not UTF-8, not JSON, nested too deeply or holding a too long number: a
    :class:`TokenSetError` naming ``where``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenSetError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                            f"{exc.start}); write the token set again with 'hettrain data "
                            "prepare'") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenSetError(f"{where}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise TokenSetError(f"{where}: invalid JSON (nested too deeply); write the token set "
                            "again with 'hettrain data prepare'") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise TokenSetError(f"{where}: invalid JSON value ({json_value_error(exc)}); write the "
                            "token set again with 'hettrain data prepare'") from None
    return parse_manifest(data, where)


def json_value_error(exc: ValueError) -> str:
    """A short, one-line reason for a ``ValueError`` from ``json.loads`` that is not a syntax
    error (Python's 4300-digit integer limit), without its advice about interpreter settings."""
    return " ".join(str(exc).split(";")[0].split())[:200]


def verify_files(directory: str | Path, manifest: Manifest, *, checksums: bool = True) -> None:
    """Every file exists with its recorded size, and (``checksums``) its sha256."""
    for entry in manifest.files():
        path = Path(directory) / entry.file
        if not path.is_file():
            raise TokenSetError(f"{path}: missing (listed in {MANIFEST}); prepare the token "
                                "set again")
        size = path.stat().st_size
        if entry.bytes >= 0 and size != entry.bytes:
            raise TokenSetError(f"{path}: {size} bytes, the manifest says {entry.bytes}; the "
                                "file is truncated or was changed")
        if checksums and sha256_file(path) != entry.sha256:
            raise TokenSetError(f"{path}: sha256 differs from {MANIFEST}; the file is corrupt "
                                "or was changed")


def check_model_vocab(manifest: Manifest, model_vocab: int, where: str = "spec.model.vocab",
                      dataset: str = "") -> None:
    """The model's embedding must cover every token id: tokenizer vocab ≤ model vocab."""
    if manifest.vocab_size > model_vocab:
        src = f" of {dataset}" if dataset else ""
        raise TokenSetError(f"{where}: {model_vocab} is smaller than the tokenizer vocabulary"
                            f"{src} ({manifest.vocab_size}); set the model vocab to at least "
                            f"{manifest.vocab_size} or prepare the data with a smaller tokenizer")


def check_job_data(spec: Any) -> None:
    """``hettrain validate`` / ``plan``: when the job's token set (``spec.data.uri``) is a local
    directory visible here, its manifest must parse and its vocabulary fit ``spec.model.vocab``.
    Object-store URIs and PVC paths are checked by the runtime at start-up instead."""
    from hettrain.api.spec import SpecError

    uri = spec.data.uri
    try:
        if not uri or not is_local(uri) or not (local_path(uri) / MANIFEST).is_file():
            return
    except OSError:  # e.g. a name too long for this file system: not a set visible here
        return
    try:
        manifest = read_manifest(local_path(uri))
        check_model_vocab(manifest, spec.model.vocab, dataset=uri)
    except TokenSetError as exc:
        field, _, message = str(exc).partition(": ")
        if field != "spec.model.vocab":
            field, message = "spec.data.uri", str(exc)
        raise SpecError(field, message) from None


def is_local(uri: str) -> bool:
    """True for a plain path or ``file://`` URI; false for object stores (``s3://`` ...)."""
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> Path:
    """The path of a local ``uri`` (``file://`` stripped)."""
    return Path(uri.removeprefix("file://"))
