"""The shipped corpus (examples/data/opticks) and helpers shared by the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from hettrain.data.prepare import PrepareOptions, prepare

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "data" / "opticks"
TOKENIZER = CORPUS / "tokenizer.json"


@pytest.fixture(scope="session")
def opticks_set(tmp_path_factory) -> Path:
    """The shipped corpus prepared once per session, one document per paragraph."""
    out = tmp_path_factory.mktemp("opticks") / "tokens"
    prepare(PrepareOptions(inputs=(str(CORPUS),), out=str(out), tokenizer=str(TOKENIZER),
                           text_unit="paragraph"))
    return out
