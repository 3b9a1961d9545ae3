"""Train the byte-level BPE tokenizer shipped next to this script (``tokenizer.json``).

    python examples/data/opticks/train_tokenizer.py [--out FILE] [--vocab 2048]

Byte-level, so any UTF-8 text encodes without unknown tokens; one special token,
``<|endoftext|>`` (id 0), that ``hettrain data prepare`` appends after every document.
Training is deterministic: the same corpus and settings give the same file byte for byte
(tests/data/test_corpus.py retrains it and compares).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
CORPUS = (HERE / "book1-part1.txt", HERE / "book3.txt")
EOS = "<|endoftext|>"


def train(vocab: int = 2048) -> Tokenizer:
    """A byte-level BPE tokenizer of ``vocab`` entries trained on the shipped corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(p) for p in CORPUS], trainer)
    return tok


def main() -> None:
    """Write the tokenizer (default: tokenizer.json next to this script)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "tokenizer.json"))
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    train(args.vocab).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
