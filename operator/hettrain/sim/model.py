"""Failure and recovery models of the simulator, with defaults taken from the Llama 3 run.

Defaults (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, §3.3.4 and Table 5):
a 54-day snapshot of the 405B pre-training on 16,384 H100 GPUs saw **419 unexpected
interruptions**, about **78 % attributed to hardware** (GPU, HBM3, host components, suspected
hardware such as silent data corruption); network switches and cables were 8.4 %. Racks hold
two 8-GPU servers (§3.3.1). A job can only be interrupted while it runs, and in the
``llama3-16k`` scenario it runs (trains or checkpoints) ≈92 % of the wall time, so the rates are
per *running* hour: 419 / (0.92 × 1,296 h) on 16,384 GPUs, split as

- node hardware (78 % − 8.4 % = 69.6 %): one failure per **66,985 GPU-hours**;
- rack (switch/cable, 8.4 %, takes both nodes of a rack): one per **34,684 rack-hours** on
  1,024 racks;
- software / job-level (22 %): one per **211,922 GPU-hours** of the running job.

That scenario then sees ≈419 interruptions in 54 days (tested); a job that never stopped would
see 419 / 0.92 ≈ 455.

Datacenter outages and stragglers are off by default (the paper gives no rates). Recovery
defaults: detection 300 s (a hang is noticed by a collective timeout, NCCL's default watchdog
is 600 s and Llama 3 shortened it), restart 600 s (reschedule, container start, init, load the
checkpoint), re-plan overhead 10 s, checkpoint storage 2,000 GB/s (Llama 3's Tectonic sustained
2 TB/s), repair/replacement of a failed node lognormal with mean 4 h (σ = 1).

YAML (``kind: FailureModel``, every key optional, camelCase)::

    failures:
      gpuMtbfHours: 66985            # per GPU, any device without its own entry
      devices: {MI300X: {gpuMtbfHours: 50000}}
      softwareGpuMtbfHours: 211922   # job-level interruptions per GPU-hour of the running job
      rack: {nodesPerRack: 2, mtbfHours: 34684}
      datacenter: {mtbfHours: 0, durationHours: 2}       # 0 = off
      stragglers: {gpuMtbfHours: 0, slowdown: 1.5, durationHours: 1}
      repair: {dist: lognormal, meanHours: 4, sigma: 1.0}  # or exponential | fixed
    recovery:
      detectionSeconds: 300
      restartSeconds: 600
      planSeconds: 10
      storageGBps: 2000
      checkpointIntervalSeconds: auto  # Young–Daly sqrt(2·C·MTBF_job), or seconds
      growThreshold: 0.02
      waitThresholdSeconds: 1800
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hettrain.api.yamlsafe import YamlInputError, read_yaml_document

HOUR = 3600.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_RUNNING_FRACTION = 0.92  # of wall time the llama3-16k job trains or checkpoints
DISTRIBUTIONS = ("lognormal", "exponential", "fixed")
MAX_EXPECTED_EVENTS = 1_000_000  # sampled failures/stragglers per seed over the horizon


class SimInputError(ValueError):
    """Bad simulator input: ``field`` names the offending key, the message says the fix."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


@dataclass(frozen=True, slots=True)
class Duration:
    """A random duration (seconds): lognormal (mean, σ of log), exponential (mean) or fixed."""

    dist: str = "lognormal"
    mean_s: float = 4 * HOUR
    sigma: float = 1.0

    def lognormal_mu(self) -> float:
        """μ of the underlying normal so that the lognormal's mean is ``mean_s``."""
        return math.log(self.mean_s) - self.sigma**2 / 2


@dataclass(frozen=True, slots=True)
class FailureModel:
    """Rates of every failure kind (MTBF in hours; 0 switches a kind off)."""

    gpu_mtbf_h: float = 66985.0
    device_mtbf_h: Mapping[str, float] = field(default_factory=dict)
    software_gpu_mtbf_h: float = 211922.0
    nodes_per_rack: int = 2
    rack_mtbf_h: float = 34684.0
    dc_mtbf_h: float = 0.0
    dc_duration: Duration = Duration("fixed", 2 * HOUR, 0.0)
    straggler_gpu_mtbf_h: float = 0.0
    straggler_slowdown: float = 1.5
    straggler_duration: Duration = Duration("fixed", HOUR, 0.0)
    repair: Duration = Duration()
    where: str = field(default="failures", compare=False)  # prefix of its fields in errors

    def node_rate_per_s(self, device: str, gpus_per_node: int) -> float:
        """Hardware failure rate of one node (per second)."""
        mtbf = self.device_mtbf_h.get(device, self.gpu_mtbf_h)
        return 0.0 if mtbf <= 0 else gpus_per_node / (mtbf * HOUR)


@dataclass(frozen=True, slots=True)
class RecoveryModel:
    """Costs of noticing and repairing an interruption, and of checkpointing."""

    detection_s: float = 300.0
    restart_s: float = 600.0
    plan_s: float = 10.0  # charged to simulated time per re-plan (the measured time is reported)
    storage_gbps: float = 2000.0  # GB/s aggregate checkpoint write bandwidth
    checkpoint_interval_s: float | None = None  # None: Young–Daly optimum
    grow_threshold: float = 0.02  # grow back when the full plan is this much faster
    wait_threshold_s: float = 1800.0  # wait-shrink: wait when the replacement ETA is sooner
    interval_field: str = field(default="recovery.checkpointIntervalSeconds", compare=False)


def check_checkpoint_interval(recovery: RecoveryModel, interval_s: float, horizon_s: float
                              ) -> None:
    """Refuse a configured checkpoint interval that gives more than
    :data:`MAX_EXPECTED_EVENTS` checkpoints over ``horizon_s`` (a tiny one runs without end);
    the error names ``recovery.interval_field`` (the YAML field or ``--ckpt-interval-s``)."""
    if horizon_s / interval_s > MAX_EXPECTED_EVENTS:
        raise SimInputError(recovery.interval_field,
                            f"{interval_s:g} s gives {horizon_s / interval_s:.3g} checkpoints "
                            f"over {horizon_s / 86400:g} days (at most {MAX_EXPECTED_EVENTS:,}"
                            f"); use at least {horizon_s / MAX_EXPECTED_EVENTS:.3g} s or leave "
                            "it unset (Young-Daly)")


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young–Daly first-order optimum checkpoint interval ``sqrt(2·C·M)`` (seconds).

    No failures (``mtbf_s`` infinite) means never checkpoint; the result is at least 1 s.
    """
    if not math.isfinite(mtbf_s):
        return math.inf
    return max(1.0, math.sqrt(2.0 * max(checkpoint_s, 0.0) * mtbf_s))


# ---------------------------------------------------------------- YAML


class _Fields:
    """Typed reads from a mapping, errors name ``where.key``."""

    def __init__(self, doc: Any, where: str) -> None:
        if doc is None:
            doc = {}
        if not isinstance(doc, Mapping):
            raise SimInputError(where, f"must be a mapping (got {type(doc).__name__})")
        self.doc, self.where = doc, where

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        v = self.doc.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise SimInputError(f"{self.where}.{key}", f"must be a number >= 0 (got {v!r})")
        if positive and v <= 0:
            raise SimInputError(f"{self.where}.{key}", f"must be > 0 (got {v!r})")
        return float(v)

    def sub(self, key: str) -> _Fields:
        return _Fields(self.doc.get(key), f"{self.where}.{key}")

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for k in self.doc:
            if k not in allowed:
                raise SimInputError(f"{self.where}.{k}",
                                    f"unknown key; allowed: {', '.join(allowed)}")


def _duration(f: _Fields, default: Duration) -> Duration:
    f.check_keys(("dist", "meanHours", "sigma", "durationHours"))
    dist = f.doc.get("dist", default.dist)
    if dist not in DISTRIBUTIONS:
        raise SimInputError(f"{f.where}.dist", f"must be one of {', '.join(DISTRIBUTIONS)} "
                                                f"(got {dist!r})")
    key = "durationHours" if "durationHours" in f.doc else "meanHours"
    mean_h = f.number(key, default.mean_s / HOUR, positive=True)
    return Duration(dist, mean_h * HOUR, f.number("sigma", default.sigma))


def failure_model_from_dict(doc: Mapping[str, Any] | None, where: str = "failures"
                            ) -> FailureModel:
    """Parse the ``failures:`` section (camelCase); missing keys keep the documented defaults."""
    d = FailureModel()
    f = _Fields(doc, where)
    f.check_keys(("gpuMtbfHours", "devices", "softwareGpuMtbfHours", "rack", "datacenter",
                  "stragglers", "repair"))
    devices: dict[str, float] = {}
    dev = f.sub("devices")
    for name in dev.doc:
        entry = dev.sub(str(name))
        entry.check_keys(("gpuMtbfHours",))
        devices[str(name)] = entry.number("gpuMtbfHours", d.gpu_mtbf_h)
    rack, dc, st = f.sub("rack"), f.sub("datacenter"), f.sub("stragglers")
    rack.check_keys(("nodesPerRack", "mtbfHours"))
    dc.check_keys(("mtbfHours", "durationHours"))
    st.check_keys(("gpuMtbfHours", "slowdown", "durationHours"))
    npr = rack.doc.get("nodesPerRack", d.nodes_per_rack)
    if isinstance(npr, bool) or not isinstance(npr, int) or npr < 1:
        raise SimInputError(f"{rack.where}.nodesPerRack", f"must be an integer >= 1 (got {npr!r})")
    slowdown = st.number("slowdown", d.straggler_slowdown)
    if slowdown < 1:
        raise SimInputError(f"{st.where}.slowdown", f"must be >= 1, a step-time factor "
                                                     f"(got {slowdown})")
    return FailureModel(
        gpu_mtbf_h=f.number("gpuMtbfHours", d.gpu_mtbf_h),
        device_mtbf_h=devices,
        software_gpu_mtbf_h=f.number("softwareGpuMtbfHours", d.software_gpu_mtbf_h),
        nodes_per_rack=npr,
        rack_mtbf_h=rack.number("mtbfHours", d.rack_mtbf_h),
        dc_mtbf_h=dc.number("mtbfHours", d.dc_mtbf_h),
        dc_duration=_duration(_Fields({k: v for k, v in dc.doc.items() if k != "mtbfHours"},
                                      dc.where), d.dc_duration),
        straggler_gpu_mtbf_h=st.number("gpuMtbfHours", d.straggler_gpu_mtbf_h),
        straggler_slowdown=slowdown,
        straggler_duration=_duration(
            _Fields({k: v for k, v in st.doc.items() if k == "durationHours"}, st.where),
            d.straggler_duration),
        repair=_duration(f.sub("repair"), d.repair),
        where=where,
    )


def recovery_model_from_dict(doc: Mapping[str, Any] | None, where: str = "recovery"
                             ) -> RecoveryModel:
    """Parse the ``recovery:`` section (camelCase); missing keys keep the defaults."""
    d = RecoveryModel()
    f = _Fields(doc, where)
    f.check_keys(("detectionSeconds", "restartSeconds", "planSeconds", "storageGBps",
                  "checkpointIntervalSeconds", "growThreshold", "waitThresholdSeconds"))
    interval = f.doc.get("checkpointIntervalSeconds", "auto")
    return RecoveryModel(
        detection_s=f.number("detectionSeconds", d.detection_s),
        restart_s=f.number("restartSeconds", d.restart_s),
        plan_s=f.number("planSeconds", d.plan_s),
        storage_gbps=f.number("storageGBps", d.storage_gbps, positive=True),
        checkpoint_interval_s=None if interval == "auto" else
        f.number("checkpointIntervalSeconds", 0, positive=True),
        grow_threshold=f.number("growThreshold", d.grow_threshold),
        wait_threshold_s=f.number("waitThresholdSeconds", d.wait_threshold_s),
        interval_field=f"{where}.checkpointIntervalSeconds",
    )


def load_models(path: str | Path) -> tuple[FailureModel, RecoveryModel]:
    """Read a ``kind: FailureModel`` YAML file into (failure model, recovery model)."""
    p = Path(path)
    try:
        doc = read_yaml_document(p)
    except YamlInputError as exc:  # unreadable, not UTF-8, malformed, alias bomb, too deep
        raise SimInputError(exc.where, exc.message) from None
    if not isinstance(doc, Mapping) or doc.get("kind") != "FailureModel":
        raise SimInputError(f"{p}: kind", "a failure model file must have kind: FailureModel")
    f = _Fields(doc, str(p))
    f.check_keys(("kind", "apiVersion", "metadata", "failures", "recovery"))
    return (failure_model_from_dict(doc.get("failures"), f"{p}: failures"),
            recovery_model_from_dict(doc.get("recovery"), f"{p}: recovery"))


def with_overrides(model: RecoveryModel, **changes: Any) -> RecoveryModel:
    """``model`` with the non-None keyword overrides applied (CLI flags)."""
    return replace(model, **{k: v for k, v in changes.items() if v is not None})
