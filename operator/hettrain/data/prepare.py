"""``hettrain data prepare``: tokenize text / JSONL / Parquet files into a token set.

Documents are read in input order (directories: their files sorted by name), tokenized in
batches with a Hugging Face ``tokenizers`` tokenizer, and packed into one token stream per split
with the EOS id after every document. Document ``i`` (counted over all inputs) goes to the
validation split when ``floor((i+1)·f) > floor(i·f)`` for the validation fraction ``f``: exactly
``floor(n·f)`` documents, spread evenly, the same on every run. The output directory is written
under a temporary name next to it and renamed only when complete, so an error or an interrupt
leaves nothing half-written. See :mod:`hettrain.data.tokenset` for the format.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from hettrain.data import tokenset as ts

FORMATS = ("text", "jsonl", "parquet")
TEXT_UNITS = ("file", "paragraph")
EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "jsonl",
              ".ndjson": "jsonl", ".parquet": "parquet"}
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16
BATCH_DOCS = 256


class PrepareError(ValueError):
    """Bad input for ``data prepare``: the message names the option or file and the fix."""


@dataclass(frozen=True, slots=True)
class PrepareOptions:
    """What ``prepare`` reads and how it splits and shards the result."""

    inputs: tuple[str, ...]
    out: str
    tokenizer: str
    eos: str | None = None
    input_format: str | None = None  # None: from each file's extension
    text_unit: str = "file"
    jsonl_field: str = "text"
    parquet_column: str = "text"
    validation_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    force: bool = False


def _path_error(what: str, path: Path, exc: OSError) -> PrepareError:
    """The one-line error for a path of ``what`` (a flag or ``INPUT``) the OS refuses."""
    if exc.errno == errno.ENAMETOOLONG:
        return PrepareError(f"{what} {path}: file name too long for the file system; choose "
                            "a shorter path")
    return PrepareError(f"{what} {path}: cannot access: {exc.strerror or exc}")


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(source: str) -> tuple[Any, Path]:
    """``(Tokenizer, path of its tokenizer.json)`` from a file or a pretrained directory."""
    from tokenizers import Tokenizer

    path = Path(source)
    try:
        is_dir = path.is_dir()
        is_file = (path / ts.TOKENIZER).is_file() if is_dir else path.is_file()
    except OSError as exc:
        raise _path_error("--tokenizer", path, exc) from None
    if is_dir:
        path = path / ts.TOKENIZER
        if not is_file:
            raise PrepareError(f"--tokenizer {source}: directory has no {ts.TOKENIZER}; give a "
                               "tokenizer.json or a pretrained directory that contains one")
    elif not is_file:
        try:
            exists = path.exists()
        except OSError:
            exists = False
        raise PrepareError(f"--tokenizer {source}: " + (
            "not a regular file (a FIFO, socket or device); give a tokenizer.json" if exists
            else "no such file or directory"))
    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as exc:  # tokenizers raises its own Exception types
        raise PrepareError(f"--tokenizer {path}: not a Hugging Face tokenizer.json "
                           f"({' '.join(str(exc).split())[:200]})") from None


def find_eos(tokenizer: Any, eos: str | None) -> tuple[str, int]:
    """The end-of-document token and its id: ``eos`` if given, else a well-known one."""
    if eos is not None:
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise PrepareError(f"--eos {eos!r}: not in the tokenizer's vocabulary")
        return eos, token_id
    for cand in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(cand)
        if token_id is not None:
            return cand, token_id
    raise PrepareError("--eos: the tokenizer has none of " + ", ".join(EOS_CANDIDATES)
                       + "; name its end-of-document token with --eos")


# ---------------------------------------------------------------- documents


def expand_inputs(inputs: Sequence[str], forced: str | None = None) -> list[Path]:
    """Files in order; a directory contributes its files (recursively) sorted by path: those
    with a known extension, or every file when the format is ``forced``."""
    if not inputs:
        raise PrepareError("INPUT: give at least one file or directory")
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        try:
            is_dir, is_file, exists = p.is_dir(), p.is_file(), p.exists()
        except OSError as exc:
            raise _path_error("INPUT", p, exc) from None
        if is_dir:
            found = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith(".")
                           and (forced or q.suffix.lower() in EXTENSIONS))
            if not found:
                raise PrepareError(f"{raw}: directory has no {', '.join(EXTENSIONS)} files; "
                                   "name the files, or set --format")
            files.extend(found)
        elif is_file:
            files.append(p)
        elif exists:
            raise PrepareError(f"INPUT {raw}: not a regular file or directory (a FIFO, socket "
                               "or device); give text, JSONL or Parquet files or directories "
                               "of them")
        else:
            raise PrepareError(f"{raw}: no such file or directory")
    return files


def input_format(path: Path, forced: str | None) -> str:
    """The reader for ``path``: ``forced`` or from its extension."""
    if forced:
        return forced
    fmt = EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise PrepareError(f"{path}: unknown extension {path.suffix or '(none)'!r}; use "
                           f"{', '.join(EXTENSIONS)} or set --format {'|'.join(FORMATS)}")
    return fmt


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8"
                           ) from None
    except OSError as exc:
        raise PrepareError(f"{path}: cannot read: {exc.strerror or exc}") from None


def text_documents(path: Path, unit: str) -> Iterator[str]:
    """A text file as one document, or one document per blank-line-separated paragraph."""
    text = _read_text(path)
    if unit == "file":
        if text.strip():
            yield text
        return
    for para in re.split(r"\n[ \t\r]*\n", text):
        if para.strip():
            yield para.strip("\n")


def jsonl_documents(path: Path, field_name: str) -> Iterator[str]:
    """The string ``field_name`` of every JSON object line."""
    for n, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PrepareError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise PrepareError(f"{path}:{n}: invalid JSON (nested too deeply)") from None
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            raise PrepareError(f"{path}:{n}: invalid JSON value "
                               f"({ts.json_value_error(exc)})") from None
        if not isinstance(obj, dict) or field_name not in obj:
            keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
            raise PrepareError(f"{path}:{n}: no field {field_name!r} (has: {keys}); choose it "
                               "with --jsonl-field")
        value = obj[field_name]
        if not isinstance(value, str):
            raise PrepareError(f"{path}:{n}: field {field_name!r} is "
                               f"{type(value).__name__}, not a string; choose the text field "
                               "with --jsonl-field")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate escape such as "\\ud800"
            raise PrepareError(f"{path}:{n}: field {field_name!r} is not valid Unicode (unpaired "
                               f"surrogate {value[exc.start]!r} at character {exc.start}); "
                               "fix or drop the line") from None
        if value:
            yield value


def parquet_documents(path: Path, column: str) -> Iterator[str]:
    """The string column ``column`` of a Parquet file, row by row (nulls skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise PrepareError(f"{path}: not a Parquet file ({' '.join(str(exc).split())[:200]})"
                           ) from None
    names = pf.schema_arrow.names
    if column not in names:
        raise PrepareError(f"{path}: no column {column!r} (has: {', '.join(names)}); choose it "
                           "with --parquet-column")
    kind = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PrepareError(f"{path}: column {column!r} is {kind}, not a string; choose the "
                           "text column with --parquet-column")
    batches = pf.iter_batches(columns=[column], batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
            values = [] if batch is None else batch.column(0).to_pylist()
        except (pa.ArrowException, OSError) as exc:  # e.g. corrupt compressed pages
            raise PrepareError(f"{path}: corrupt Parquet data "
                               f"({' '.join(str(exc).split())[:200]}); write the file again"
                               ) from None
        if batch is None:
            return
        for value in values:
            if value:
                yield value


def documents(files: Sequence[Path], opts: PrepareOptions) -> Iterator[tuple[int, str]]:
    """``(file index, document text)`` over all inputs in order."""
    readers: dict[str, Callable[[Path], Iterator[str]]] = {
        "text": lambda p: text_documents(p, opts.text_unit),
        "jsonl": lambda p: jsonl_documents(p, opts.jsonl_field),
        "parquet": lambda p: parquet_documents(p, opts.parquet_column),
    }
    for i, path in enumerate(files):
        yield from ((i, doc) for doc in readers[input_format(path, opts.input_format)](path))


# ---------------------------------------------------------------- writer


@dataclass
class SplitWriter:
    """Appends documents to one split's shards (rolling over at ``shard_tokens``)."""

    directory: Path
    name: str
    dtype: str
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    tokens: int = 0
    _file: Any = None
    _hash: Any = None
    _in_shard: int = 0

    def _open(self) -> None:
        name = ts.shard_name(self.name, len(self.shards))
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 - closed in _close
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self.shards.append({"file": name})

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self.shards[-1].update(sha256=self._hash.hexdigest(), tokens=self._in_shard,
                               bytes=self._in_shard * ts.DTYPES[self.dtype])
        self._file = None

    def add(self, ids: np.ndarray) -> None:
        """Append one document's ids (EOS included)."""
        pos = 0
        while pos < len(ids):
            if self._file is None or self._in_shard == self.shard_tokens:
                self._close()
                self._open()
            take = min(len(ids) - pos, self.shard_tokens - self._in_shard)
            blob = ids[pos:pos + take].astype("<" + ("u2" if self.dtype == "uint16" else "u4"))
            data = blob.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._in_shard += take
            pos += take
        self.tokens += len(ids)
        self.ends.append(self.tokens)

    def finish(self) -> dict[str, Any]:
        """Close the last shard, write the index; the split's manifest entry."""
        self._close()
        index = np.asarray(self.ends, dtype="<u8").tobytes()
        name = ts.index_name(self.name)
        (self.directory / name).write_bytes(index)
        return {"tokens": self.tokens, "documents": len(self.ends), "shards": self.shards,
                "index": {"file": name, "sha256": hashlib.sha256(index).hexdigest(),
                          "bytes": len(index)}}

    def abort(self) -> None:
        """Close the open shard without recording it."""
        if self._file is not None:
            self._file.close()
            self._file = None


def is_validation(i: int, fraction: Fraction) -> bool:
    """Document ``i`` belongs to the validation split (``floor(n·f)`` of ``n``, evenly)."""
    return (i + 1) * fraction // 1 > i * fraction // 1


def _check_options(opts: PrepareOptions) -> None:
    if not 0.0 <= opts.validation_fraction < 1.0:
        raise PrepareError(f"--validation-fraction {opts.validation_fraction}: must be in "
                           "[0, 1)")
    if opts.shard_tokens < 1:
        raise PrepareError(f"--shard-tokens {opts.shard_tokens}: must be >= 1")
    if opts.input_format is not None and opts.input_format not in FORMATS:
        raise PrepareError(f"--format {opts.input_format}: must be one of {', '.join(FORMATS)}")
    if opts.text_unit not in TEXT_UNITS:
        raise PrepareError(f"--text-unit {opts.text_unit}: must be one of "
                           f"{', '.join(TEXT_UNITS)}")
    out = Path(opts.out)
    try:
        exists = out.exists()
        is_set = exists and (out / ts.MANIFEST).is_file()
        parent_is_dir = out.parent.is_dir()
    except OSError as exc:
        raise _path_error("--out", out, exc) from None
    if exists and not opts.force:
        raise PrepareError(f"--out {out}: already exists; choose another directory or pass "
                           "--force to replace it")
    if exists and not is_set:
        raise PrepareError(f"--out {out}: exists and is not a token set; --force replaces only "
                           "token sets, choose another directory")
    if not parent_is_dir:
        raise PrepareError(f"--out {out}: parent directory {out.parent} does not exist")


def prepare(opts: PrepareOptions, log: Callable[[str], None] = lambda _: None) -> dict:
    """Write the token set ``opts.out``; returns its manifest. Nothing is left on error."""
    _check_options(opts)
    files = expand_inputs(opts.inputs, opts.input_format)
    for p in files:
        input_format(p, opts.input_format)  # unknown extensions fail before any work
    tokenizer, tok_path = load_tokenizer(opts.tokenizer)
    eos_token, eos_id = find_eos(tokenizer, opts.eos)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = ts.dtype_for_vocab(vocab)
    fraction = Fraction(str(opts.validation_fraction)).limit_denominator(1_000_000)
    out = Path(opts.out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:  # out's name fits, the temporary one does not
            raise PrepareError(f"--out {out}: name too long for the temporary directory "
                               "written first (.NAME.tmp-PID); choose a shorter name") from None
        raise _path_error("--out", out, exc) from None
    writers = {s: SplitWriter(tmp, s, dtype, opts.shard_tokens) for s in ts.SPLITS}
    per_file = [0] * len(files)
    try:
        count = 0
        pending: list[tuple[int, str]] = []

        def flush() -> None:
            nonlocal count
            encodings = tokenizer.encode_batch([d for _, d in pending],
                                               add_special_tokens=False)
            for (fi, _), enc in zip(pending, encodings, strict=True):
                ids = np.fromiter(enc.ids, dtype=np.int64, count=len(enc.ids))
                if not len(ids):
                    continue
                per_file[fi] += 1
                split = "validation" if is_validation(count, fraction) else "train"
                writers[split].add(np.append(ids, eos_id))
                count += 1
            pending.clear()

        for item in documents(files, opts):
            pending.append(item)
            if len(pending) >= BATCH_DOCS:
                flush()
        if pending:
            flush()
        splits = {s: w.finish() for s, w in writers.items()}
        if splits["train"]["tokens"] == 0:
            raise PrepareError(f"INPUT: no text found in {len(files)} file(s); check the "
                               "files and --jsonl-field / --parquet-column")
        if fraction and splits["validation"]["documents"] == 0:
            raise PrepareError(f"--validation-fraction {opts.validation_fraction}: selects none "
                               f"of the {count} documents; give more documents (e.g. "
                               "--text-unit paragraph) or set --validation-fraction 0")
        shutil.copyfile(tok_path, tmp / ts.TOKENIZER)
        manifest = {
            "format": ts.FORMAT, "version": ts.VERSION, "dtype": dtype,
            "tokenizer": {"sha256": ts.sha256_file(tmp / ts.TOKENIZER), "vocab_size": vocab,
                          "eos_id": eos_id, "eos_token": eos_token},
            "validation_fraction": opts.validation_fraction,
            "shard_tokens": opts.shard_tokens,
            "inputs": [{"path": str(p), "sha256": ts.sha256_file(p), "documents": n}
                       for p, n in zip(files, per_file, strict=True)],
            "splits": splits,
        }
        ts.parse_manifest(manifest)  # the reader accepts what the writer wrote
        (tmp / ts.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _publish(tmp, out)
    except BaseException:
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}: {splits['train']['tokens']} train tokens in "
        f"{splits['train']['documents']} documents, {splits['validation']['tokens']} "
        f"validation tokens in {splits['validation']['documents']} documents, {dtype}, vocab "
        f"{vocab}, EOS {eos_token!r} = {eos_id}")
    return manifest


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out`` (an existing token set is replaced)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        with contextlib.suppress(OSError):
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
