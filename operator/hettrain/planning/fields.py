"""Checked readers for the cluster YAML: every malformed value becomes a one-line
:class:`PlanningInputError` naming the field path and the fix, never a ``TypeError``, a
division by zero later in the cost model, or a silently accepted NaN.

Bounds (:data:`CLUSTER_LIMITS`) keep the inventory and the planner's work finite: a pool of
10^9 nodes or a NaN bandwidth is refused here, once, for every caller of ``load_cluster``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from hettrain.api.spec import short_repr
from hettrain.planning.errors import PlanningInputError

MAX_POOLS = 64
MAX_DATACENTERS = 32
MAX_DEVICES = 64
MAX_POOL_NODES = 100_000
MAX_CLUSTER_NODES = 200_000
MAX_GPUS_PER_NODE = 64
MAX_NAME = 56  # pool names become node names "<pool>-<index>" and label values (<= 63)

# field -> (exclusive lower bound 0 or inclusive 0, upper bound): physical quantities
NIC_GBPS = (1e-3, 1e6)
LINK_GBPS = (1e-3, 1e7)
LATENCY_MS = (0.0, 1e5)
TFLOPS = (1e-6, 1e6)
HBM_GIB = (1e-3, 1e5)
HBM_TBPS = (1e-6, 1e4)
INTRA_NODE_GBPS = (1e-3, 1e5)
PCIE_GBPS = (1e-3, 1e5)
EFFICIENCY = (1e-3, 1.0)

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DNS_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")


def mapping(value: Any, where: str, *, optional: bool = False) -> Mapping[str, Any]:
    """``value`` as a mapping (None → {} when ``optional``)."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise PlanningInputError(where, f"must be a mapping (got {type(value).__name__})")
    return value


def known_keys(value: Mapping[str, Any], where: str, allowed: set[str] | frozenset[str]
               ) -> None:
    """Refuse a key of ``value`` outside ``allowed``: a typo (``nicGpbs``) would otherwise
    fall back to a default without a word."""
    unknown = sorted(str(k)[:60] for k in value if k not in allowed)
    if unknown:
        raise PlanningInputError(f"{where}.{unknown[0]}",
                                 f"unknown field; allowed: {', '.join(sorted(allowed))}")


def sequence(value: Any, where: str, limit: int) -> list[Any]:
    """``value`` as a list of at most ``limit`` items (None → [])."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise PlanningInputError(where, f"must be a list (got {type(value).__name__})")
    if len(value) > limit:
        raise PlanningInputError(where, f"has {len(value)} entries; at most {limit} are allowed")
    return value


def name(value: Any, where: str, *, dns: bool = False) -> str:
    """A non-empty name usable as a Kubernetes label value (``dns``: also as a node name)."""
    if not isinstance(value, str) or not value:
        raise PlanningInputError(where, f"must be a non-empty string (got {short_repr(value)})")
    pattern, kind = (_DNS_NAME, "lower-case letters, digits, '-' and '.'") if dns else (
        _LABEL_VALUE, "letters, digits, '-', '_' and '.'")
    if len(value) > MAX_NAME or not pattern.match(value):
        raise PlanningInputError(
            where, f"{short_repr(value)} is not a valid name: use at most {MAX_NAME} {kind}, "
                   "starting and ending with a letter or digit")
    return value


def choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``."""
    if value not in choices:
        raise PlanningInputError(where, f"must be one of {', '.join(choices)} "
                                        f"(got {short_repr(value)})")
    return str(value)


def integer(value: Any, where: str, minimum: int, maximum: int) -> int:
    """An integer in ``[minimum, maximum]`` (booleans are not integers)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanningInputError(where, f"must be an integer (got {short_repr(value)})")
    if not minimum <= value <= maximum:
        raise PlanningInputError(where, f"must be between {minimum} and {maximum} "
                                        f"(got {short_repr(value)})")
    return value


def number(value: Any, where: str, bounds: tuple[float, float], unit: str = "") -> float:
    """A finite real number in ``[bounds[0], bounds[1]]`` (a lower bound > 0 means positive)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanningInputError(where, f"must be a number{' of ' + unit if unit else ''} "
                                        f"(got {short_repr(value)})")
    lo, hi = bounds
    x = float(value) if abs(value) < 1e308 else math.inf
    if not math.isfinite(x) or not lo <= x <= hi:
        need = "a positive" if lo > 0 else "a non-negative"
        raise PlanningInputError(where, f"must be {need} finite number <= {hi:g}"
                                        f"{' ' + unit if unit else ''} (got {short_repr(value)})")
    return x
