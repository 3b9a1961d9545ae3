"""Cost-model fidelity: the planner's prediction against published, measured training runs.

Each row under ``bench/calibration/<source>/<row>/`` is a hettrain job + cluster YAML with the
published layout pinned (TP, PP, DP, microbatch, schedule, recompute) and the published figure in
the job's annotations (``fidelity/metric``, ``fidelity/published``). The row is planned with
:func:`hettrain.planning.planner.plan_job` and the prediction converted to the published metric:

- ``megatron_tflops``: achieved TFLOP/s per GPU by Narayanan et al.'s formula (SC'21, eq. 3)
  ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` per step, which counts the full-recompute forward.
- ``tokens_per_gpu_s``: training tokens per second per GPU (torchtitan's WPS).
- ``palm_tflops``: TFLOP/s per GPU by the PaLM MFU count ``6·N + 12·L·H·Q·T`` per token (the
  count behind the Llama 3 paper's BF16 MFU).

A row is ``fitted`` when the catalog/time-model constants were fitted to it, ``checked`` when it
is only compared (a row's ``fidelity/role`` annotation, default ``fitted`` for Megatron SC'21
Table 1, the calibration set). A refusal (PlanningError) of a published layout is a failure.

Usage: python bench/fidelity.py [--source megatron-sc21] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from hettrain.api.spec import JobSpec, parse_job_manifest  # noqa: E402
from hettrain.planning.catalog import resolve_device  # noqa: E402
from hettrain.planning.errors import PlanningError  # noqa: E402
from hettrain.planning.inventory import load_cluster  # noqa: E402
from hettrain.planning.planner import plan_job  # noqa: E402

CALIBRATION = ROOT / "bench" / "calibration"
FITTED_SOURCES = ("megatron-sc21",)  # the calibration set the constants were fitted to


@dataclass(frozen=True, slots=True)
class Row:
    """One published run and the model's prediction for it."""

    source: str
    name: str
    role: str  # "fitted" or "checked"
    gpus: int
    metric: str
    published: float
    predicted: float | None  # None: refused
    refusal: str | None
    layout: str
    time_only: float | None = None  # refused rows: the prediction with memory ignored

    @property
    def error(self) -> float | None:
        """Signed relative error (predicted / published − 1); None when refused."""
        return None if self.predicted is None else self.predicted / self.published - 1.0


def megatron_flops_per_step(spec: JobSpec) -> float:
    """Narayanan et al. eq. 3: FLOPs of one step incl. the full-recompute forward."""
    m = spec.model
    b, s, ll, h, v = spec.training.global_batch, m.seq_len, m.layers, m.hidden, m.vocab
    return 96.0 * b * s * ll * h * h * (1 + s / (6 * h) + v / (16 * ll * h))


def palm_flops_per_step(spec: JobSpec) -> float:
    """Chowdhery et al. (PaLM, appendix B) model FLOPs of one step: ``6·N + 12·L·H·Q·T`` per
    token (``N`` all parameters, ``H`` heads, ``Q`` head dim, ``T`` sequence length)."""
    m = spec.model
    per_token = 6.0 * m.parameters() + 12.0 * m.layers * m.heads * m.head_dim * m.seq_len
    return per_token * spec.training.global_batch * m.seq_len


def predicted_metric(metric: str, spec: JobSpec, step_time_s: float, gpus: int) -> float:
    """The published metric computed from a predicted step time."""
    if metric == "megatron_tflops":
        return megatron_flops_per_step(spec) / step_time_s / gpus / 1e12
    if metric == "palm_tflops":
        return palm_flops_per_step(spec) / step_time_s / gpus / 1e12
    if metric == "tokens_per_gpu_s":
        return spec.training.global_batch * spec.model.seq_len / step_time_s / gpus
    raise ValueError(f"unknown fidelity/metric {metric!r}")


def evaluate_row(directory: Path) -> Row:
    """Plan one calibration row with its published layout pinned."""
    doc = yaml.safe_load((directory / "job.yaml").read_text())
    ann = doc["metadata"]["annotations"]
    name, spec = parse_job_manifest(doc)
    inventory = load_cluster(directory / ann.get("fidelity/cluster", "cluster.yaml"))
    gpus = int(ann["fidelity/gpus"])
    source = directory.parent.name
    role = ann.get("fidelity/role", "fitted" if source in FITTED_SOURCES else "checked")
    metric, published = ann["fidelity/metric"], float(ann["fidelity/published"])
    try:
        plan = plan_job(name, spec, inventory)
    except PlanningError as exc:
        return Row(source, directory.name, role, gpus, metric, published, None, exc.message, "",
                   _time_only(name, spec, directory / ann.get("fidelity/cluster",
                                                              "cluster.yaml"), metric, gpus))
    used = plan.dp * sum(s.tp for s in plan.stages)
    layout = (f"tp={plan.stages[0].tp} pp={plan.pp} dp={plan.dp} mb={plan.micro_batch} "
              f"{plan.schedule}" + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""))
    if used != gpus:
        layout += f" (uses {used} GPUs)"
    pred = predicted_metric(metric, spec, plan.predicted.step_time_s, gpus)
    return Row(source, directory.name, role, gpus, metric, published, pred, None, layout)


def _time_only(name: str, spec: JobSpec, cluster: Path, metric: str, gpus: int) -> float | None:
    """The metric predicted with 100x device memory: checks the time model on a layout the
    memory model refuses (a refusal still counts as one)."""
    doc = yaml.safe_load(cluster.read_text())
    devices: dict = {}  # the calibration clusters use catalog devices only
    big = []
    for pool in doc["pools"]:
        dev = resolve_device(pool["device"], devices, "pools")
        big.append({"name": dev.name, "vendor": dev.vendor, "bf16Tflops": dev.bf16_tflops,
                    "hbmGiB": dev.hbm_gib * 100, "hbmTBps": dev.hbm_tbps,
                    "intraNodeGBps": dev.intra_node_gbps, "backend": dev.backend,
                    "efficiency": dev.efficiency, "pcieGBps": dev.pcie_gbps})
    doc = {**doc, "devices": list({d["name"]: d for d in big}.values())}
    try:
        plan = plan_job(name, spec, load_cluster(doc))
    except PlanningError:
        return None
    return predicted_metric(metric, spec, plan.predicted.step_time_s, gpus)


def evaluate(sources: list[str] | None = None) -> list[Row]:
    """Every row of the given calibration sources (default: all), sorted by source and GPUs."""
    rows = []
    for src in sorted(CALIBRATION.iterdir()):
        if not src.is_dir() or (sources and src.name not in sources):
            continue
        for d in sorted(src.iterdir()):
            if (d / "job.yaml").exists():
                rows.append(evaluate_row(d))
    return sorted(rows, key=lambda r: (r.source, r.gpus, r.name))


def summary(rows: list[Row]) -> dict[str, float | int]:
    """Median and max |error| over the answered rows, and the refusal count."""
    errs = [abs(r.error) for r in rows if r.error is not None]
    return {
        "rows": len(rows),
        "refused": sum(r.predicted is None for r in rows),
        "median_abs_error": statistics.median(errs) if errs else float("nan"),
        "max_abs_error": max(errs) if errs else float("nan"),
    }


def _table(rows: list[Row]) -> str:
    lines = [f"{'source':>14} {'row':>8} {'role':>7} {'GPUs':>5} {'published':>9} "
             f"{'predicted':>9} {'error':>7}  layout"]
    for r in rows:
        if r.predicted is None:
            what = "" if r.time_only is None else (
                f"[memory ignored: {r.time_only:.1f}, {r.time_only / r.published - 1:+.1%}] ")
            lines.append(f"{r.source:>14} {r.name:>8} {r.role:>7} {r.gpus:>5} "
                         f"{r.published:9.1f} {'REFUSED':>9} {'':>7}  {what}{r.refusal}")
        else:
            lines.append(f"{r.source:>14} {r.name:>8} {r.role:>7} {r.gpus:>5} "
                         f"{r.published:9.1f} {r.predicted:9.1f} {r.error:+7.1%}  {r.layout}")
    for role in ("fitted", "checked"):
        sel = [r for r in rows if r.role == role]
        if sel:
            s = summary(sel)
            answered = s["rows"] - s["refused"]
            errs = (f"median |error| {s['median_abs_error']:.1%}, max |error| "
                    f"{s['max_abs_error']:.1%}" if answered else "no row answered")
            lines.append(f"{role}: {s['rows']} rows, {errs}, refused {s['refused']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the fidelity table (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="append", help="calibration source (default: all)")
    ap.add_argument("--json", action="store_true", help="print rows as JSON")
    args = ap.parse_args(argv)
    rows = evaluate(args.source)
    if args.json:
        print(json.dumps([{**{k: getattr(r, k) for k in Row.__slots__}, "error": r.error}
                          for r in rows], indent=1))
    else:
        print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
