"""``hettrain data``: ``prepare`` a token set from text / JSONL / Parquet, ``verify`` one.

Protocol of :data:`hettrain.cli.EXTERNAL_COMMANDS`: :func:`add_arguments` fills the subparser,
:func:`run` returns the exit code (0 ok, 2 bad input with one line on stderr naming the option
or file and the fix). numpy, tokenizers and pyarrow are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands and flags of ``hettrain data``."""
    from hettrain.data.prepare import DEFAULT_SHARD_TOKENS, FORMATS, TEXT_UNITS

    parser.description = ("Tokenized training data: 'prepare' writes a token set that a job "
                          "names in spec.data (uri, or pvc + path); 'verify' checks one.")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "prepare", help="tokenize text / JSONL / Parquet files into a token set",
        description="Tokenize the INPUT files (or directories, read recursively in name order) "
                    "with a Hugging Face tokenizer into a memory-mapped token set: documents "
                    "packed with EOS, uint16 ids when the vocabulary has at most 65536 entries "
                    "else uint32, sharded, with a document index and a manifest (tokenizer "
                    "sha256, vocab size, token counts, sha256 of every file, train/validation "
                    "split). The output is written under a temporary name and renamed when "
                    "complete. The format of each file comes from its extension (.txt/.text "
                    "text, .jsonl/.ndjson JSON lines, .parquet) unless --format is given.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text, JSONL or Parquet files, "
                                                              "or directories of them")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="tokenizer.json, or a pretrained directory containing one")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (must not exist unless --force)")
    p.add_argument("--eos", metavar="TOKEN",
                   help="end-of-document token (default: the first of <|endoftext|>, "
                        "<|end_of_text|>, </s>, <eos>, [SEP] the tokenizer has)")
    p.add_argument("--format", dest="input_format", choices=FORMATS,
                   help="read every input as this format instead of by extension")
    p.add_argument("--text-unit", choices=TEXT_UNITS, default="file",
                   help="text files: one document per file (default) or per blank-line-"
                        "separated paragraph")
    p.add_argument("--jsonl-field", default="text", metavar="NAME",
                   help="JSONL: the string field holding the document (default: text)")
    p.add_argument("--parquet-column", default="text", metavar="NAME",
                   help="Parquet: the string column holding the document (default: text)")
    p.add_argument("--validation-fraction", type=float, default=0.05, metavar="F",
                   help="share of documents in the validation split, every 1/F-th document "
                        "(default 0.05; 0 = none)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--force", action="store_true",
                   help="replace an existing token set at --out (atomically)")
    v = sub.add_parser("verify", help="check a token set's manifest, sizes and sha256 sums",
                       description="Check a token set's manifest, every file's size and "
                                   "sha256, and print its summary.")
    v.add_argument("dataset", metavar="DIR", help="token set directory")


def run(args: argparse.Namespace) -> int:
    """Run ``hettrain data ACTION``; bad input is one line on stderr and exit 2."""
    from hettrain.data import tokenset as ts
    from hettrain.data.prepare import PrepareError, PrepareOptions, prepare

    try:
        if args.data_command == "prepare":
            prepare(PrepareOptions(
                inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer, eos=args.eos,
                input_format=args.input_format, text_unit=args.text_unit,
                jsonl_field=args.jsonl_field, parquet_column=args.parquet_column,
                validation_fraction=args.validation_fraction, shard_tokens=args.shard_tokens,
                force=args.force), log=print)
        else:
            m = ts.read_manifest(args.dataset)
            ts.verify_files(args.dataset, m)
            for s in m.splits.values():
                print(f"{s.name}: {s.tokens} tokens, {s.documents} documents, "
                      f"{len(s.shards)} shard(s)")
            print(f"OK {args.dataset}: {m.dtype}, vocab {m.vocab_size}, EOS id {m.eos_id}, "
                  f"tokenizer sha256 {m.tokenizer_sha256[:12]}")
    except (PrepareError, ts.TokenSetError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
