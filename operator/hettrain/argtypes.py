"""Bounded argparse types for the numeric flags of ``hettrain simulate`` and ``hettrain demo``.

``type=float`` accepts ``inf`` and ``nan`` and ``type=int`` any size: ``--days inf`` or
``--dcs 1000000000`` made the simulator run forever. Each type here checks the value once, at
the parser, and argparse turns the refusal into ``error: ... argument --days: must be ...``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip()) if len(text) <= 30 else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"must be an integer between {lo} and {hi} (got {text[:30]!r})")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low_ok = value > lo if lo_open else value >= lo
        if not (math.isfinite(value) and low_ok and value <= hi):
            bracket = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {bracket}{lo:g}, {hi:g}] (got {text[:30]!r})")
        return value

    parse.__name__ = "number"
    return parse
