"""``hettrain data prepare``: every document's tokens are the tokenizer's, packed with EOS, in
the split the rule says; the format (dtype, shards, index, manifest checksums) holds; bad input is
one line naming the option or file, and nothing is left half-written."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.data.conftest import CORPUS, TOKENIZER
from tokenizers import Tokenizer, models, pre_tokenizers

from hettrain.cli import main
from hettrain.data import tokenset as ts
from hettrain.data.prepare import PrepareOptions, is_validation, prepare, text_documents

TOK = Tokenizer.from_file(str(TOKENIZER))
EOS = TOK.token_to_id("<|endoftext|>")


def _stream(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(all tokens of a split, document end offsets) read back with plain numpy."""
    m = json.loads((directory / ts.MANIFEST).read_text())
    dtype = "<u2" if m["dtype"] == "uint16" else "<u4"
    parts = [np.fromfile(directory / s["file"], dtype=dtype) for s in m["splits"][split]["shards"]]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    ends = np.fromfile(directory / ts.index_name(split), dtype="<u8")
    return tokens, ends


def _documents(directory: Path, split: str) -> list[list[int]]:
    tokens, ends = _stream(directory, split)
    starts = np.concatenate([[0], ends[:-1]]).astype(int)
    return [tokens[a:b].tolist() for a, b in zip(starts, ends.astype(int), strict=True)]


def _expect_split(docs: list[str], fraction: float, tok=TOK, eos=EOS) -> dict[str, list]:
    """Brute force: encode each document alone, append EOS, assign by the documented rule."""
    f = Fraction(str(fraction))
    out: dict[str, list] = {"train": [], "validation": []}
    for i, d in enumerate(docs):
        split = "validation" if (i + 1) * f // 1 > i * f // 1 else "train"
        out[split].append([*tok.encode(d, add_special_tokens=False).ids, eos])
    return out


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["data", "prepare", *argv])
    return code, capsys.readouterr().err


def test_shipped_corpus_paragraphs_are_packed_with_eos_and_split_evenly(opticks_set):
    docs = [d for p in sorted(CORPUS.glob("*.txt")) for d in text_documents(p, "paragraph")]
    want = _expect_split(docs, 0.05)
    assert _documents(opticks_set, "train") == want["train"]
    assert _documents(opticks_set, "validation") == want["validation"]
    assert len(want["validation"]) == len(docs) // 20 > 10
    m = ts.read_manifest(opticks_set)
    assert (m.dtype, m.vocab_size, m.eos_id) == ("uint16", 2048, EOS)
    assert m.tokenizer_sha256 == ts.sha256_file(TOKENIZER)
    ts.verify_files(opticks_set, m)  # every sha256 and size as recorded
    text = TOK.decode(_documents(opticks_set, "train")[3][:-1])
    assert text == docs[3]  # byte-level BPE: decoding gives the paragraph back


def test_jsonl_and_parquet_inputs_give_the_same_tokens_as_text(tmp_path):
    docs = ["Of the Refrangibility of Rays.", "", "Light is ♦ refracted\n\ntwice.", "Qu. 31",
            "Obs. 4"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"id": i, "body": d})
                                                for i, d in enumerate(docs)) + "\n\n")
    pq.write_table(pa.table({"id": list(range(5)), "body": docs}), tmp_path / "a.parquet")
    sets = {}
    for name, flag in (("a.jsonl", "--jsonl-field"), ("a.parquet", "--parquet-column")):
        out = tmp_path / f"out-{name}"
        prepare(PrepareOptions(inputs=(str(tmp_path / name),), out=str(out),
                               tokenizer=str(CORPUS), validation_fraction=0.25,
                               **{flag.removeprefix("--").replace("-", "_"): "body"}))
        sets[name] = out
    want = _expect_split([d for d in docs if d], 0.25)  # empty documents are dropped
    for out in sets.values():
        assert _documents(out, "train") == want["train"]
        assert _documents(out, "validation") == want["validation"]
    assert (sets["a.jsonl"] / "train-00000.bin").read_bytes() == \
        (sets["a.parquet"] / "train-00000.bin").read_bytes()


def test_small_shards_hold_the_same_stream_and_documents_may_span_them(tmp_path, opticks_set):
    out = tmp_path / "sharded"
    prepare(PrepareOptions(inputs=(str(CORPUS),), out=str(out), tokenizer=str(TOKENIZER),
                           text_unit="paragraph", shard_tokens=10_000))
    m = ts.read_manifest(out)
    shards = m.splits["train"].shards
    assert len(shards) == -(-m.splits["train"].tokens // 10_000) >= 8
    assert all(s.tokens == 10_000 for s in shards[:-1])
    for split in ts.SPLITS:
        a, b = _stream(out, split), _stream(opticks_set, split)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    ts.verify_files(out, m)


def test_vocab_above_65536_is_stored_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = ["w0 w69999 w65534 w65535", "w12345 nope w69998"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    out = tmp_path / "out"
    prepare(PrepareOptions(inputs=(str(tmp_path / "d.jsonl"),), out=str(out),
                           tokenizer=str(tmp_path), validation_fraction=0))
    m = ts.read_manifest(out)
    assert (m.dtype, m.vocab_size, m.eos_id) == ("uint32", 70_002, 1)
    assert _documents(out, "train") == [[2, 70_001, 65_536, 65_537, 1], [12_347, 0, 70_000, 1]]
    assert ts.dtype_for_vocab(65_536) == "uint16" and ts.dtype_for_vocab(65_537) == "uint32"


def test_same_input_same_bytes(tmp_path, opticks_set):
    out = tmp_path / "again"
    prepare(PrepareOptions(inputs=(str(CORPUS),), out=str(out), tokenizer=str(TOKENIZER),
                           text_unit="paragraph"))
    for f in opticks_set.iterdir():
        if f.name != ts.MANIFEST:
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert json.loads((out / ts.MANIFEST).read_text())["splits"] == \
        json.loads((opticks_set / ts.MANIFEST).read_text())["splits"]


def test_validation_rule_takes_floor_n_f_evenly_spread():
    for n, f in ((100, "0.05"), (341, "0.05"), (7, "0.5"), (10, "0.3")):
        picked = [i for i in range(n) if is_validation(i, Fraction(f))]
        assert len(picked) == int(n * Fraction(f))
        gaps = np.diff([-1, *picked])
        assert gaps.max() - gaps.min() <= 1  # evenly spread


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("args, needle", [
    (["missing.txt"], "missing.txt: no such file or directory"),
    (["{d}/x.csv"], "x.csv: unknown extension '.csv'"),
    (["{d}/bad.jsonl"], "bad.jsonl:3: no field 'text' (has: body); choose it with --jsonl-field"),
    (["{d}/t.parquet"], "no column 'text' (has: body); choose it with --parquet-column"),
    (["{d}/a.txt", "--tokenizer", "{d}"], "--tokenizer {d}: directory has no tokenizer.json"),
    (["{d}/a.txt", "--eos", "<nope>"], "--eos '<nope>': not in the tokenizer's vocabulary"),
    (["{d}/a.txt"], "--validation-fraction 0.05: selects none of the 1 documents"),
    (["{d}/a.txt", "--validation-fraction", "1.5"], "--validation-fraction 1.5: must be in"),
    (["{d}/a.txt", "--out", "{d}/exists"], "--out {d}/exists: already exists; choose another"),
    (["{d}/latin1.txt"], "latin1.txt: not UTF-8 text"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys, args, needle):
    d = tmp_path / "in"
    d.mkdir()
    (d / "x.csv").write_text("a,b\n")
    (d / "a.txt").write_text("one small document\n")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    # the bad line comes after good ones: the failure happens while shards are being written
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"body": "no"}\n')
    pq.write_table(pa.table({"body": ["x"]}), d / "t.parquet")
    (d / "exists").mkdir()
    (d / "exists" / ts.MANIFEST).write_text("{}")
    argv = [a.format(d=d) for a in args]
    if "--tokenizer" not in argv:
        argv += ["--tokenizer", str(TOKENIZER)]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    code, err = _run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert needle.format(d=d) in err, err
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_force_replaces_a_token_set_atomically_and_a_failure_keeps_the_old(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "first version"}\n{"text": "second document"}\n')
    out = tmp_path / "set"
    base = [str(src), "--tokenizer", str(TOKENIZER), "--out", str(out),
            "--validation-fraction", "0.5"]
    assert _run(capsys, *base)[0] == 0
    before = (out / ts.MANIFEST).read_text()
    src.write_text('{"text": "new"}\n{"oops": 1}\n')
    assert _run(capsys, *base, "--force")[0] == 2
    assert (out / ts.MANIFEST).read_text() == before  # the old set is untouched
    src.write_text('{"text": "replaced text"}\n{"text": "and more"}\n')
    assert _run(capsys, *base, "--force")[0] == 0
    assert (out / ts.MANIFEST).read_text() != before
    assert _leftovers(tmp_path) == []
    assert _documents(out, "train") == [[*TOK.encode("replaced text").ids, EOS]]


def test_verify_catches_a_changed_or_truncated_shard(tmp_path, capsys, opticks_set):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(opticks_set, copy)
    assert main(["data", "verify", str(copy)]) == 0
    assert "OK " in capsys.readouterr().out
    shard = copy / "train-00000.bin"
    blob = bytearray(shard.read_bytes())
    blob[100] ^= 1
    shard.write_bytes(bytes(blob))
    assert main(["data", "verify", str(copy)]) == 2
    assert "train-00000.bin: sha256 differs" in capsys.readouterr().err
    shard.write_bytes(bytes(blob[:-2]))
    assert main(["data", "verify", str(copy)]) == 2
    assert "bytes, the manifest says" in capsys.readouterr().err
