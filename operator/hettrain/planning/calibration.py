"""Closed-loop calibration: measured stage times → refined device profiles → re-plan or not.

The runtime measures, on the first rank of every pipeline stage, the forward+backward seconds
of one microbatch spent computing (the pipeline's receives and sends excluded) and the
seconds spent communicating per step (``runtime/stage_timing.py``). This module, pure like
the rest of the planning core, turns those numbers into decisions:

1. :func:`compare` — predicted (``time_ms``) vs measured, per stage of every replica group
   (keyed ``(group, stage)``; group 0 alone without ``Plan.groups``);
2. :func:`refine_profiles` — for every device of the plan, the factor ``r`` by which its
   layers really are slower (or faster) than the model said: the measured time of the
   stage's decoder layers (the runtime times them apart from the embedding, head and loss;
   without that, the stage time less the part the model prices outside the layers) over the
   layers' predicted time, summed over the device's stages. The device's profile
   (``planning/profiles.py``; a catalog device gets one fitted to the catalog model first) is
   scaled by ``r``;
3. :func:`evaluate` — with the refined profiles, the current layout's step time
   (:func:`~hettrain.planning.planner.step_time_for_split`; with replica groups
   :func:`~hettrain.planning.replica_groups.grouped_step_s`, the batch split kept) against the
   best new plan's; a
   re-plan pays off when the new plan is faster by more than ``spec.calibration.replanThreshold``.

Profiles are stored by the operator under :func:`store_key` (device, model shape, precision,
image: the image pins the software versions) and reused by every job with the same key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hettrain.api.spec import JobSpec, ModelSpec
from hettrain.planning import context, cost
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.errors import PlanningError
from hettrain.planning.plan import Plan, StagePlan
from hettrain.planning.profiles import (
    PRECISION_BYTES,
    RECOMPUTE_MODES,
    LayerProfile,
    Shape,
    comm_doc,
    fit_line,
    model_shape,
    profile_doc,
)

MIN_SCALE, MAX_SCALE = 0.02, 50.0  # a measured layer factor outside this is a broken report
CATALOG_FIT_MICRO_BATCHES = (1, 2, 4)
CATALOG_FORWARD_SHARE = 1.0 / 3.0  # forward = 1 of the 3 passes (backward = 2)


@dataclass(frozen=True, slots=True)
class StageMeasurement:
    """What the first rank of one stage measured (medians over its recent steps)."""

    stage: int
    compute_s: float  # forward+backward of one microbatch, computing only
    comm_s: float  # pipeline receives/sends and collectives per optimizer step
    steps: int  # steps measured (the first, warm-up step excluded)
    step: int = 0  # last completed optimizer step
    checkpoint_step: int = 0  # last complete checkpoint
    layers_s: float = 0.0  # forward+backward of the stage's decoder layers only (0: unknown)
    group: int = 0  # the replica group whose pipeline ``stage`` indexes (Plan.groups)


@dataclass(frozen=True, slots=True)
class StageComparison:
    """Predicted vs measured seconds of one stage's microbatch (forward + backward)."""

    stage: int
    device: str
    predicted_s: float
    measured_s: float
    comm_s: float
    group: int | None = None  # the replica group (None: the plan has no groups)

    @property
    def ratio(self) -> float:
        """measured / predicted (1.0: the model was right)."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else math.inf

    @property
    def label(self) -> str:
        """``stage N``, or ``group G stage N`` in a plan with replica groups."""
        return f"stage {self.stage}" if self.group is None else \
            f"group {self.group} stage {self.stage}"

    def to_status(self) -> dict[str, Any]:
        """The ``status.calibration.stages[]`` entry (milliseconds, rounded)."""
        group = {} if self.group is None else {"group": self.group}
        return {**group, "stage": self.stage, "device": self.device,
                "predictedMs": round(self.predicted_s * 1e3, 4),
                "measuredMs": round(self.measured_s * 1e3, 4),
                "commMs": round(self.comm_s * 1e3, 4), "ratio": round(self.ratio, 4)}


@dataclass(frozen=True, slots=True)
class Verdict:
    """The corrected model's view: the current layout's step time and the best plan's."""

    current_s: float
    best_s: float
    best: Plan | None
    threshold: float

    @property
    def gain(self) -> float:
        """Fraction of the current step time the best plan saves (negative: slower)."""
        return 1.0 - self.best_s / self.current_s if self.current_s > 0 else 0.0

    @property
    def replan(self) -> bool:
        """True when the best plan is faster by more than the threshold."""
        return self.best is not None and self.gain > self.threshold

    def message(self) -> str:
        """One line for the Event: predicted old vs new step time and the threshold."""
        return (f"measured stage times corrected the device profiles: the current plan's "
                f"step is {self.current_s:.4g} s, a new plan's {self.best_s:.4g} s "
                f"({100 * self.gain:.1f}% faster; threshold {100 * self.threshold:.0f}%)")


StageKey = tuple[int, int]  # (replica group, stage index in its pipeline)


def plan_stages(plan: Plan) -> list[tuple[StageKey, StagePlan]]:
    """Every stage of every replica group (``plan.stages`` as group 0 without groups), keyed
    by ``(group, stage)``."""
    groups = [g.stages for g in plan.groups] if plan.groups else [plan.stages]
    return [((g, s.index), s) for g, stages in enumerate(groups) for s in stages]


def usable(measurements: Iterable[StageMeasurement], plan: Plan, min_steps: int
           ) -> dict[StageKey, StageMeasurement]:
    """The measurements of the plan's stages (of every replica group) with at least
    ``min_steps`` steps and a positive compute time, by ``(group, stage)``; empty unless every
    stage has one (a partial picture is not acted on)."""
    stages = dict(plan_stages(plan))
    out = {(m.group, m.stage): m for m in measurements
           if (m.group, m.stage) in stages and m.steps >= min_steps and m.compute_s > 0
           and math.isfinite(m.compute_s) and math.isfinite(m.comm_s)}
    return out if len(out) == len(stages) else {}


def compare(plan: Plan, measured: Mapping[StageKey, StageMeasurement]
            ) -> list[StageComparison]:
    """Predicted vs measured per stage of every replica group (only the stages measured)."""
    return [StageComparison(s.index, s.device, s.time_ms / 1e3, measured[key].compute_s,
                            measured[key].comm_s, key[0] if plan.groups else None)
            for key, s in plan_stages(plan) if key in measured]


def catalog_profile(device: DeviceSpec, model: ModelSpec, precision: str) -> LayerProfile:
    """A profile reproducing the catalog model's layer time (tp 1) in ``precision`` on
    ``device``, each recompute mode fitted as ``α + β·b`` over a few microbatch sizes: what
    calibration scales for a device nobody profiled."""
    plain = dataclasses.replace(device, profile=None)
    eb = PRECISION_BYTES[precision]

    def line(mode: str) -> tuple[float, float]:
        return fit_line([(float(b), cost.layer_compute_s(model, b, 1, plain, mode, eb))
                         for b in CATALOG_FIT_MICRO_BATCHES])

    alpha, beta = line("none")
    return LayerProfile(device.name, model_shape(model), alpha, beta, CATALOG_FORWARD_SHARE,
                        source="catalog", precision=precision,
                        recompute=tuple((m, *line(m)) for m in RECOMPUTE_MODES))


def layer_scale(spec: JobSpec, plan: Plan, measured: Mapping[StageKey, StageMeasurement],
                devices: Mapping[str, DeviceSpec]) -> dict[str, float]:
    """Per device of the plan: measured / predicted time of its layers (see the module doc).

    Where the runtime measured the layers alone (``layers_s``: compute and the TP
    collectives inside them) that is compared with the layers' predicted time
    (``cost.layer_time_s``: compute plus TP comm, or the profile's measured TP line);
    otherwise the part of a stage's predicted time outside its layers (head, embedding) is
    taken as right and what remains of the measurement is laid on the layers."""
    eb = cost.precision_bytes(spec.training)
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for key, s in plan_stages(plan):
        m = measured.get(key)
        dev = devices.get(s.device)
        if m is None or dev is None:
            continue
        layers = s.layer_end - s.layer_start
        # what the runtime's layer clock measures: the layers' compute AND their TP
        # collectives (inside the layers); a CP stage's rank computes its s/cp tokens
        # (planning/context.py)
        if s.cp == 1:
            part = layers * cost.layer_time_s(spec.model, plan.training, plan.micro_batch, s.tp,
                                              dev)
        else:
            part = layers * (context.cp_layer_compute_s(spec.model, plan.micro_batch, s.tp,
                                                        s.cp, dev, plan.training.recompute, eb)
                             + cost.tp_comm_per_layer_s(spec.model, plan.micro_batch, s.tp,
                                                        dev, eb, plan.training.recompute))
        if part <= 0:
            continue
        if m.layers_s > 0:
            layers_measured = m.layers_s
        else:
            layers_measured = max(0.0, m.compute_s - max(0.0, s.time_ms / 1e3 - part))
        num[s.device] = num.get(s.device, 0.0) + layers_measured
        den[s.device] = den.get(s.device, 0.0) + part
    return {d: min(MAX_SCALE, max(MIN_SCALE, num[d] / den[d])) for d in den}


def scaled(profile: LayerProfile, factor: float, source: str = "calibration") -> LayerProfile:
    """``profile`` with its layer seconds (every measured recompute mode's) multiplied by
    ``factor`` (the line measured with the node's ranks busy too: the slowdown between them is
    kept; and the ZB-H1 B and W passes: the measured split is kept)."""
    conc = profile.concurrent

    def times(line: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if line is None else (line[0] * factor, line[1] * factor)

    return dataclasses.replace(profile, alpha=profile.alpha * factor, beta=profile.beta * factor,
                               recompute=tuple((m, a * factor, b * factor)
                                               for m, a, b in profile.recompute),
                               source=source, concurrent=times(conc),
                               weight_grad=times(profile.weight_grad),
                               input_grad=times(profile.input_grad),
                               tp_layers=tuple((t, a * factor, b * factor)
                                               for t, a, b in profile.tp_layers))


def refine_profiles(spec: JobSpec, plan: Plan, measured: Mapping[StageKey, StageMeasurement],
                    devices: Mapping[str, DeviceSpec]) -> dict[str, LayerProfile]:
    """The refined profile of every measured device of the plan (its current profile, or the
    catalog model's, scaled by :func:`layer_scale`)."""
    out = {}
    for name, r in layer_scale(spec, plan, measured, devices).items():
        dev = devices[name]
        eb = cost.precision_bytes(spec.training)
        base = dev.profile if dev.profile is not None and dev.profile.matches(spec.model, eb) \
            else catalog_profile(dev, spec.model, spec.training.precision)
        if dev.profile is not None and base is not dev.profile:  # what does not depend on the
            base = dataclasses.replace(  # model's shape stays measured
                base, comm=dev.profile.comm,
                optimizer_bytes_per_s=dev.profile.optimizer_bytes_per_s)
        out[name] = scaled(base, r)
    return out


def evaluate(spec: JobSpec, plan: Plan, corrected: Any,
             planner: Callable[[JobSpec, Any, Plan], Plan], threshold: float) -> Verdict:
    """The current layout's and the best plan's step times on the ``corrected`` inventory
    (profiles refined). ``planner(spec, inventory, previous)`` plans; a planning error leaves
    the current plan (``best`` None)."""
    from hettrain.planning.planner import step_time_for_split
    from hettrain.planning.replica_groups import grouped_step_s

    split = [s.layer_end - s.layer_start for s in plan.stages]
    try:
        current = (grouped_step_s(spec, corrected, plan) if plan.groups
                   else step_time_for_split(spec, corrected, plan, split))
    except (KeyError, ValueError):  # the plan's pools left the inventory: nothing to compare
        current = None
    if current is None:
        return Verdict(plan.predicted.step_time_s, plan.predicted.step_time_s, None, threshold)
    try:
        best = planner(spec, corrected, plan)
    except PlanningError:
        return Verdict(current, current, None, threshold)
    return Verdict(current, best.predicted.step_time_s, best, threshold)


def with_profiles(inventory: Any, profiles: Mapping[str, LayerProfile], model: ModelSpec,
                  precision: str) -> Any:
    """The inventory with the profiles of ``model``'s shape in ``precision`` attached to their
    devices (by name); profiles of other shapes or precisions, or of devices the inventory
    lacks, are left out."""
    eb = PRECISION_BYTES[precision]
    mine = {d: p for d, p in profiles.items() if p.matches(model, eb)}
    if not mine:
        return inventory
    pools = tuple(dataclasses.replace(p, device=dataclasses.replace(
        p.device, profile=mine[p.device.name])) if p.device.name in mine else p
        for p in inventory.pools)
    return dataclasses.replace(inventory, pools=pools)


def devices_of(inventory: Any) -> dict[str, DeviceSpec]:
    """{device name: DeviceSpec} of the inventory's pools."""
    return {p.device.name: p.device for p in inventory.pools}


# ---------------------------------------------------------------- the profile store's keys

_KEY_UNSAFE = re.compile(r"[^-._a-zA-Z0-9]")


def store_key(device: str, shape: Shape, image: str, precision: str) -> str:
    """The profile store key (a ConfigMap data key) of a device, model shape, image and
    precision (a precision's 2 or 4 bytes: bf16 and fp16 share profiles, as ``matches``)."""
    ident = (shape, image) if PRECISION_BYTES[precision] == 4 else (shape, image, 2)
    digest = hashlib.sha256(repr(ident).encode()).hexdigest()[:12]
    return f"{_KEY_UNSAFE.sub('_', device)[:200]}.{digest}.yaml"


def profile_to_doc(profile: LayerProfile, model: ModelSpec, software: Mapping[str, str]
                   ) -> dict[str, Any]:
    """A ``DeviceProfile`` document that reads back as ``profile`` (exact rows of its line)."""
    rows: list[tuple[int, float, float]] = []
    for b in CATALOG_FIT_MICRO_BATCHES:
        t = profile.alpha + profile.beta * b
        rows.append((b, t * profile.forward_share, t * (1.0 - profile.forward_share)))
    modes = {m: [a + slope * b for b in CATALOG_FIT_MICRO_BATCHES]
             for m, a, slope in profile.recompute}
    stage = []  # the measured stage parts, around this profile's (maybe refined) layer line
    if profile.stage is not None and profile.stage.vocab == model.vocab:
        for b, *_ in profile.stage.rows:
            mid = (profile.stage.layers * (profile.alpha + profile.beta * b)
                   + profile.stage.part_s("overhead", b))
            stage.append((b, mid, mid + profile.stage.part_s("embedding", b),
                          mid + profile.stage.part_s("head", b)))
    concurrent = None  # the line measured with the node's ranks busy, as exact rows too
    if profile.concurrent is not None:
        ca, cb = profile.concurrent
        concurrent = {"ranks": profile.concurrent_ranks, "layer": [
            (b, (ca + cb * b) * profile.forward_share, (ca + cb * b) * (1 - profile.forward_share))
            for b in CATALOG_FIT_MICRO_BATCHES]}
    split = None  # the ZB-H1 B and W passes' lines, as exact rows
    if profile.weight_grad is not None and profile.input_grad is not None:
        (ba, bb), (wa, wb) = profile.input_grad, profile.weight_grad
        split = [(ba + bb * b, wa + wb * b) for b in CATALOG_FIT_MICRO_BATCHES]
    doc = profile_doc(profile.device, software, model, rows, profile.optimizer_bytes_per_s,
                      comm_doc(profile.comm) if profile.comm is not None else None, stage,
                      concurrent, precision=profile.precision, modes=modes,
                      stage_layers=profile.stage.layers if profile.stage is not None else 1,
                      split=split, tp=[
                          {"tp": t, "layer": [
                              (b, (a + s * b) * profile.forward_share,
                               (a + s * b) * (1 - profile.forward_share))
                              for b in CATALOG_FIT_MICRO_BATCHES]}
                          for t, a, s in profile.tp_layers] or None)
    doc["source"] = profile.source.split(":")[0] or "calibration"
    return doc

