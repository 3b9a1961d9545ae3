"""Tokenized training data: ``hettrain data prepare`` writes a token set, the runtime reads it.

- :mod:`hettrain.data.tokenset`: the on-disk format (manifest, dtype, checksums), shared by the
  writer and the runtime reader; standard library only, so the offline CLI can check a job's
  dataset against its model without numpy or torch.
- :mod:`hettrain.data.prepare`: tokenize text / JSONL / Parquet files into a token set.
- :mod:`hettrain.data.cli`: the ``hettrain data`` subcommand (hooked from ``hettrain.cli``).
"""
