"""Hostile input to the training-data path through the real ``hettrain`` CLI (a subprocess
with a timeout): token set manifests (``data verify``, ``plan``), ``data prepare`` inputs and
path arguments. Every case ends in exit 2 with one line on stderr that names the file or flag,
no traceback, no hang, and no output directory left behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tests.cli.hostile import ROOT, assert_clean_refusal, run_hettrain

TOKENIZER = ROOT / "examples/data/opticks/tokenizer.json"
CLUSTER = ROOT / "examples/clusters/local-cpu.yaml"
LONG = "a" * 300  # over the 255-byte file name limit of common file systems

JOB = """\
apiVersion: hettrain.dev/v1alpha1
kind: HetTrainingJob
metadata: {{name: tiny}}
spec:
  model: {{preset: gpt-tiny}}
  training: {{globalBatch: 8, steps: 10}}
  data: {{uri: {uri}}}
"""

MANIFESTS = {
    "not UTF-8": (b"\xff\xfe\x00garbage", "UTF-8"),
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, "nested"),
    "5000-digit integer": (b'{"format":"hettrain-tokens","version":1,"dtype":"uint16",'
                           b'"tokenizer":{"vocab_size":' + b"9" * 5000 + b"}}", "digits"),
}

JSONL_LINES = {
    "nested 100000 deep": ("[" * 100_000 + "]" * 100_000, "nested"),
    "5000-digit number": ('{"text": ' + "9" * 5000 + "}", "digits"),
    "lone surrogate": ('{"text": "hello \\ud800 world"}', "surrogate"),
}


def _hettrain(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``hettrain ARGV`` as a new process."""
    return run_hettrain(argv, tmp_path)


def _assert_nothing_written(parent: Path, out_name: str) -> None:
    left = [p.name for p in parent.iterdir() if p.name == out_name
            or p.name.startswith(f".{out_name}.")]
    assert not left, left


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_hostile_manifest(case: str, tmp_path: Path) -> None:
    """Defect 1: a manifest that is not UTF-8, nested too deeply or holds a huge integer."""
    data, needle = MANIFESTS[case]
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    manifest = tokens / "manifest.json"
    manifest.write_bytes(data)
    assert_clean_refusal(_hettrain(["data", "verify", str(tokens)], tmp_path),
                          str(manifest), needle)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(uri=tokens))
    assert_clean_refusal(_hettrain(["plan", str(job), "--cluster", str(CLUSTER)], tmp_path),
                          "spec.data.uri", str(manifest), needle)


@pytest.mark.parametrize("case", sorted(JSONL_LINES))
def test_hostile_jsonl_line(case: str, tmp_path: Path) -> None:
    """Defect 2: a JSONL line nested too deeply, with a huge number or a lone surrogate."""
    line, needle = JSONL_LINES[case]
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a fine first document"}\n' + line + "\n")
    proc = _hettrain(["data", "prepare", str(src), "--tokenizer", str(TOKENIZER),
                      "--out", str(tmp_path / "out")], tmp_path)
    assert_clean_refusal(proc, f"{src}:2:", needle)
    _assert_nothing_written(tmp_path, "out")


def test_corrupt_parquet_pages(tmp_path: Path) -> None:
    """Defect 2: a Parquet file with a valid footer but corrupt snappy pages."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"document number {i} " * 20 for i in range(2000)]}),
                   src, compression="snappy")
    data = bytearray(src.read_bytes())
    mid = len(data) // 2
    data[mid - 200:mid + 200] = b"\xff" * 400  # the middle is data pages; the footer is intact
    src.write_bytes(bytes(data))
    proc = _hettrain(["data", "prepare", str(src), "--tokenizer", str(TOKENIZER),
                      "--out", str(tmp_path / "out")], tmp_path)
    assert_clean_refusal(proc, f"{src}:", "corrupt")
    _assert_nothing_written(tmp_path, "out")


@pytest.mark.parametrize("which", ["--out", "INPUT", "--tokenizer"])
def test_path_name_too_long(which: str, tmp_path: Path) -> None:
    """Defect 3: a path argument with a 300-character name."""
    src = tmp_path / "in.txt"
    src.write_text("hello world\n")
    args = {"INPUT": str(src), "--tokenizer": str(TOKENIZER), "--out": str(tmp_path / "out")}
    args[which] = str(tmp_path / LONG)
    proc = _hettrain(["data", "prepare", args["INPUT"], "--tokenizer", args["--tokenizer"],
                      "--out", args["--out"], "--validation-fraction", "0"], tmp_path)
    assert_clean_refusal(proc, which, "too long")
    _assert_nothing_written(tmp_path, "out")
    _assert_nothing_written(tmp_path, LONG)


def test_fifo_input(tmp_path: Path) -> None:
    """Defect 3: a FIFO as INPUT is not a regular file (and is not opened: no hang)."""
    fifo = tmp_path / "in.txt"
    os.mkfifo(fifo)
    proc = _hettrain(["data", "prepare", str(fifo), "--tokenizer", str(TOKENIZER),
                      "--out", str(tmp_path / "out")], tmp_path)
    assert_clean_refusal(proc, f"INPUT {fifo}", "not a regular file")
    _assert_nothing_written(tmp_path, "out")


def test_fifo_tokenizer(tmp_path: Path) -> None:
    """A FIFO as --tokenizer is not a regular file (not "no such file"; not opened: no hang)."""
    (tmp_path / "in.txt").write_text("some text\n")
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    proc = _hettrain(["data", "prepare", str(tmp_path / "in.txt"), "--tokenizer", str(fifo),
                      "--out", str(tmp_path / "out")], tmp_path)
    assert_clean_refusal(proc, f"--tokenizer {fifo}", "not a regular file")
    _assert_nothing_written(tmp_path, "out")
