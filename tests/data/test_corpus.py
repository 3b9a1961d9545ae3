"""The shipped corpus is what its README says, and its tokenizer is reproducible from it."""

from __future__ import annotations

import hashlib
import importlib.util

from tests.data.conftest import CORPUS, TOKENIZER


def test_the_tokenizer_is_retrained_byte_for_byte_from_the_corpus(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tokenizer",
                                                  CORPUS / "train_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "tokenizer.json"
    mod.train().save(str(out))
    assert out.read_bytes() == TOKENIZER.read_bytes()


def test_the_corpus_is_small_utf8_and_listed_with_its_checksums():
    readme = (CORPUS / "README.md").read_text()
    total = 0
    for path in sorted(CORPUS.glob("*.txt")):
        blob = path.read_bytes()
        blob.decode("utf-8")
        total += len(blob)
        assert f"{hashlib.sha256(blob).hexdigest()}  {path.name}" in readme, path.name
    assert 200_000 < total < 400_000
