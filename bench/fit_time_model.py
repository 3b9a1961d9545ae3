"""Fit the time model's free constants to the calibration rows marked ``fitted``.

The free constants are the A100's large-GEMM efficiency (``catalog.CATALOG["A100-80GB"]``),
``cost.ATTENTION_EFFICIENCY`` and ``cost.TP_BUS_EFFICIENCY``; everything else in the time model
is counted or estimated (``planning/cost.py``; the Table 1 rows' eager attention, pinned in
their job.yaml as ``spec.training.attention: eager``, adds the materialised scores' counted
memory traffic, ``cost.EAGER_SCORE_ACCESSES_*``: no constant of its own is fitted).
Coordinate descent on a grid, minimising ``max |error| + median |error|`` of
:mod:`bench.fidelity` over the fitted rows (only those: checked rows never enter the fit).
Prints the best constants; copy them into the sources.

Usage: python bench/fit_time_model.py [--sweeps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

import fidelity
from hettrain.planning import catalog, cost

GRIDS = {
    "a100_efficiency": [round(0.50 + 0.01 * i, 2) for i in range(36)],
    "ATTENTION_EFFICIENCY": [round(0.20 + 0.05 * i, 2) for i in range(17)],
    "TP_BUS_EFFICIENCY": [round(0.50 + 0.05 * i, 2) for i in range(11)],
}


def apply(params: dict[str, float]) -> None:
    """Set the constants in the imported modules (this process only)."""
    a100 = catalog.CATALOG["A100-80GB"]
    catalog.CATALOG["A100-80GB"] = dataclasses.replace(a100, efficiency=params["a100_efficiency"])
    cost.ATTENTION_EFFICIENCY = params["ATTENTION_EFFICIENCY"]
    cost.TP_BUS_EFFICIENCY = params["TP_BUS_EFFICIENCY"]


def score(params: dict[str, float]) -> float:
    """max + median |error| over the fitted rows (inf if any is refused)."""
    apply(params)
    rows = [r for r in fidelity.evaluate() if r.role == "fitted"]
    s = fidelity.summary(rows)
    if s["refused"]:
        return float("inf")
    return s["max_abs_error"] + s["median_abs_error"]


def main() -> int:
    """Run the coordinate descent and print the result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=int, default=3)
    args = ap.parse_args()
    params = {"a100_efficiency": catalog.CATALOG["A100-80GB"].efficiency,
              "ATTENTION_EFFICIENCY": cost.ATTENTION_EFFICIENCY,
              "TP_BUS_EFFICIENCY": cost.TP_BUS_EFFICIENCY}
    best = score(params)
    for _ in range(args.sweeps):
        for name, grid in GRIDS.items():
            for value in grid:
                trial = {**params, name: value}
                sc = score(trial)
                if sc < best - 1e-12:
                    best, params = sc, trial
        print(f"sweep: {params} max+median |error| {best:.4f}", flush=True)
    apply(params)
    print(fidelity._table(fidelity.evaluate()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
