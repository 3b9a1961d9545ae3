"""Device profiles: measured layer costs of one device, used by the time model where they exist.

``hettrain profile`` (``runtime/profile.py``) runs the runtime's own transformer block on the
local device for one model shape and a few microbatch sizes and writes a versioned YAML
document::

    apiVersion: hettrain.dev/v1alpha1
    kind: DeviceProfile
    version: 2
    device: CPU                       # the catalog / cluster device name it measured
    precision: bf16                   # the job's precision the block ran in
    software: {torch: 2.9.1, python: 3.12.3}
    model: {hidden: 64, heads: 4, kvHeads: 4, ffnHidden: 256, seqLen: 64, gatedMlp: false,
            vocab: 256}               # vocab: the stage rows' embedding and head
    layer:                            # one layer, tp 1; medians of repeats
      - {microBatch: 1, forwardS: 0.0011, backwardS: 0.0023, selectiveS: 0.0035, fullS: 0.0046,
         bS: 0.0013, wS: 0.0011}      # optional: the ZB-H1 backward split (B and W passes)
      - {microBatch: 2, forwardS: 0.0019, backwardS: 0.0041, selectiveS: 0.0062, fullS: 0.0080,
         bS: 0.0022, wS: 0.0020}
    stage:                            # optional: the runtime's stage around `layers` layers
      - {microBatch: 1, layers: 1, middleS: 0.0036, firstS: 0.0038, lastS: 0.0045}
      - {microBatch: 2, layers: 1, middleS: 0.0063, firstS: 0.0066, lastS: 0.0075}
    concurrent:                       # optional (CPU): the layer, 2 ranks at once
      ranks: 2
      layer: [{microBatch: 1, forwardS: 0.0012, backwardS: 0.0025}, ...]
    optimizerBytesPerS: 2.1e+09       # optional: the optimizer step's measured bandwidth
    comm:                             # optional: two ranks on one node (runtime/comm_profile.py)
      ranks: 2
      backend: gloo
      p2p: [{bytes: 4096, seconds: 0.00012}, {bytes: 1048576, seconds: 0.00067}]
      allReduce: [{bytes: 4096, seconds: 0.00015}, {bytes: 1048576, seconds: 0.0012}]
      allGather: [{bytes: 4096, seconds: 0.00014}, {bytes: 1048576, seconds: 0.0010}]  # optional

``forwardS``/``backwardS`` are the block without recompute; ``selectiveS`` and ``fullS`` its
forward + backward with the runtime's selective (attention core) and full (whole block)
recompute, as ``LlamaDecoderLayer.set_recompute`` runs them. The planner (``hettrain plan
--profile FILE``) fits ``t(b) = α + β·b`` (least squares over the measured microbatch sizes,
``α ≥ 0``) to each mode's forward+backward seconds and uses it, divided by ``tp``, for every
layer of a device, model shape and precision the profile matches (bf16 and fp16 both count as
2-byte precisions). ``comm`` is fitted the same way against bytes: a p2p transfer's latency and
bandwidth, and a ring all-reduce's per-step latency and bus bandwidth (its ``2(n − 1)`` steps
and ``2(n − 1)/n`` bytes per byte at the measured ``n`` ranks). They do not depend on the
model: the device's collectives inside a node (TP, CP, a DP group within a node) run at the
measured all-reduce, and every pipeline transfer of the device takes at least the measured p2p
latency and at most its bandwidth (the same library on every path). ``allGather`` (optional;
the gathered output's bytes) prices ZeRO-3's per-unit parameter gathers inside a node
(:meth:`CommProfile.all_gather_s`); without it an all-gather is half the all-reduce.

``bS`` and ``wS`` (optional, on every row or none) split the block's backward as the
runtime's ZB-H1 schedule runs it: ``bS`` the backward inside ``defer_weight_grads`` (input
gradients; the linears stash their inputs and output gradients), ``wS`` the W pass that
follows (``WeightGradStore.flush``: every linear's weight gradient). The planner fits a line to
``wS`` and takes ZB-H1's bubble as ``(F + B − W)/(F + B + W)`` of 1F1B's (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR'24: ZB-H1 leaves ``(p − 1)(F + B − W)`` of 1F1B's
``(p − 1)(F + B + W)``), i.e. ``1 − 2·W(b)/t(b)`` with ``t`` the fitted line of the job's
recompute mode (:meth:`LayerProfile.zb_bubble_ratio`; never below ``ZB_MIN_BUBBLE_RATIO``);
without them the catalog rule, a third of 1F1B's (``W`` a third of the layer).

``stage`` times the runtime's own pipeline stage (``runtime.model.StageModel``) around
``layers`` layers (the chain the layer rows were timed in), forward + loss + backward of one
microbatch as ``runtime/pipeline.py`` runs it: a middle stage (the layers only), a first stage
(the embedding too) and a last stage (the final norm, LM head and loss too). Less ``layers``
times the fitted layer they give three lines in the microbatch (least squares, ``α ≥ 0``, never
negative): the stage machinery's own seconds per microbatch on every stage (``overhead``), the
embedding's on the first and the head's on the last. Where the model's shape, vocabulary and
precision match, the planner adds ``overhead`` (and ``embedding`` on the first stage) to every
stage's microbatch and takes ``head`` for the catalog's LM head; the plan notes say so.
Everything else (other devices, shapes and precisions, links between nodes) stays on the
catalog model, and the plan notes say which devices were measured.

``tp`` (optional) times the block sharded over ``tp`` local ranks exactly as the runtime
shards it (``runtime/tp_profile.py``: column/row-parallel projections, replicated norms, the
TP all-reduces of forward and backward over the node's backend), forward + backward per rank.
Its fitted line replaces, for a plan of that TP degree without recompute, both the tp-1 line
divided by ``tp`` and the modelled TP all-reduces (``cost.layer_time_s``); other degrees and
recompute modes stay derived, and the plan notes say which.

``concurrent`` (measured on a CPU, whose "devices" are processes sharing one host's cores,
caches and memory: ``runtime/concurrent_profile.py``) times the same layer with ``ranks``
processes running it at once. Its fitted line over the single-rank one is the slowdown
``s(b) = max(1, t_concurrent(b) / t(b))``; the planner multiplies the compute of every stage
on a device group by it where the plan keeps more busy ranks on that group than it has nodes
(so some node runs two or more at once), and says so in the plan notes.

Version 1 documents (no ``precision``: the block ran in fp32; no recompute modes, ``stage``,
``concurrent`` or ``model.vocab``) still load: fp32, full recompute adds the measured forward
share and selective a modelled attention forward (``cost.layer_compute_s``).

Pure: no torch here (the runtime writes the document, this module reads it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hettrain.api.spec import ModelSpec, short_repr
from hettrain.api.yamlsafe import YamlInputError, read_yaml_document
from hettrain.planning.errors import PlanningInputError

PROFILE_VERSION = 2  # written: precision, recompute modes, model.vocab, stage, concurrent
PROFILE_VERSIONS = (1, 2)  # readable; version 1: fp32 block, layer rows only
PROFILE_KIND = "DeviceProfile"
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE_MODES = ("selective", "full")  # measured besides "none" (version 2; not attention-free)
MODE_FIELDS = {"selective": "selectiveS", "full": "fullS"}
SPLIT_FIELDS = ("bS", "wS")  # optional (version 2): the ZB-H1 backward's B and W passes
# the least share of 1F1B's bubble a measured split may give ZB-H1 (a W pass of half the layer
# would leave no bubble at all; the schedule still waits for each stage's first forward)
ZB_MIN_BUBBLE_RATIO = 0.1

Shape = tuple[int, int, int, int, int, bool]

# bounds on a profile's numbers (a measured document is far inside them; hostile ones are not):
# a fit over them stays finite (weights 1/seconds², bytes², sums of products)
MAX_COUNT = 2**20  # microbatch sizes, layers, ranks, TP degrees, model dimensions
MIN_SECONDS, MAX_SECONDS = 1e-9, 1e6  # a measured time: a nanosecond to 11 days
MAX_BYTES = 2.0**60  # a measured message (the error message says 2**60)


def _is_int(value: Any, lo: int = 1, hi: int = MAX_COUNT) -> bool:
    """True when ``value`` is an integer (not a bool) in ``[lo, hi]``."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _is_number(value: Any, lo: float, hi: float) -> bool:
    """True when ``value`` is a finite real number (not a bool) in ``[lo, hi]``."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and lo <= value <= hi)


def _seconds(row: Mapping, key: str, at: str) -> float:
    """``row[key]`` as measured seconds (a finite number in the bounds), else an error naming
    the row and field."""
    value = row[key]
    if not _is_number(value, MIN_SECONDS, MAX_SECONDS):
        raise PlanningInputError(at, f"{key} must be positive, finite seconds from "
                                 f"{MIN_SECONDS:g} to {MAX_SECONDS:g} (got {short_repr(value)})")
    return float(value)


def _micro_batch(row: Mapping, at: str) -> int:
    """``row["microBatch"]`` as an integer in ``[1, MAX_COUNT]``, else an error naming it."""
    value = row["microBatch"]
    if not _is_int(value):
        raise PlanningInputError(at, f"microBatch must be an integer from 1 to {MAX_COUNT} "
                                 f"(got {short_repr(value)})")
    return value


def model_shape(model: ModelSpec) -> Shape:
    """What a layer's cost depends on: hidden, heads, kv heads, FFN width, sequence, gating."""
    return (model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.seq_len,
            model.gated_mlp)


def _weighted_line(points: Sequence[tuple[float, float]], w: Sequence[float]
                   ) -> tuple[float, float, float] | None:
    """Weighted least squares ``y = α + β·x``: ``(α, β, Σwxy/Σwx²)`` (the last: the slope
    through the origin), or None when the sizes do not determine a line."""
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True))
    den = sw * sxx - sx * sx
    if len(points) < 2 or den <= 0:
        return None
    beta = (sw * sxy - sx * sy) / den
    return (sy - beta * sx) / sw, beta, sxy / sxx


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = α + β·x`` with ``α ≥ 0`` (refit through the origin otherwise)."""
    if not points:
        raise ValueError("no points to fit")
    line = _weighted_line(points, [1.0] * len(points))
    if line is not None and line[0] >= 0 and line[1] > 0:
        return line[0], line[1]
    return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)  # the origin


def fit_line_relative(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``y = α + β·x`` minimising the RELATIVE errors (weights ``1/y²``), ``α ≥ 0``, ``β > 0``:
    message sizes span orders of magnitude, and a plain least-squares intercept would be set
    by the largest message's noise rather than by the small messages' latency."""
    line = _weighted_line(points, [1.0 / (y * y) for _, y in points])
    if line is not None and line[1] > 0:
        alpha, beta, through_origin = line
        # a negative intercept: refit through the origin
        return (alpha, beta) if alpha >= 0 else (0.0, through_origin)
    # no positive slope in the noise: the smallest time as latency, the largest message's rest
    x_top, y_top = max(points)
    alpha = min(y for _, y in points)
    if y_top > alpha:
        return alpha, (y_top - alpha) / x_top
    return 0.0, y_top / x_top


@dataclass(frozen=True, slots=True)
class CommProfile:
    """Measured transfers between two ranks of one node, fitted as latency + bytes/bandwidth."""

    p2p_latency_s: float
    p2p_bytes_per_s: float
    ring_step_latency_s: float  # α of one ring all-reduce step
    bus_bytes_per_s: float  # ring all-reduce bus bandwidth (2(n − 1)/n bytes per byte)
    ranks: int = 2
    backend: str = ""
    rows: tuple[tuple[str, int, float], ...] = ()  # (kind, bytes, seconds) as measured

    def all_reduce_s(self, nbytes: float, ranks: int | None = None) -> float:
        """Seconds of an all-reduce of ``nbytes`` inside the node: linear between the measured
        sizes (the fitted line is a compromise over sizes that a library may reduce with
        different algorithms: gloo's 1 MB all-reduce took 2.5 ms where the line said 0.9),
        the fitted line outside them. ``ranks`` other than the measured scale it by the ring's
        bytes per rank, ``(n − 1)/n``."""
        t = self._between_rows("allReduce", nbytes)
        if t is None:
            steps = 2 * (self.ranks - 1)
            t = (steps * self.ring_step_latency_s
                 + nbytes * steps / self.ranks / self.bus_bytes_per_s)
        return self._at_ranks(t, ranks)

    @property
    def measures_all_gather(self) -> bool:
        """Whether the profile measured all-gathers (``allGather`` rows)."""
        return sum(k == "allGather" for k, _, _ in self.rows) >= 2

    def all_gather_s(self, nbytes: float, ranks: int | None = None) -> float:
        """Seconds of an all-gather whose gathered output is ``nbytes``, inside the node:
        linear between the measured sizes, the line fitted to them outside; a profile without
        all-gather rows (written before they were measured): half the all-reduce's, a ring's
        share. ``ranks`` other than the measured scale it as :meth:`all_reduce_s`."""
        if not self.measures_all_gather:
            return self.all_reduce_s(nbytes, ranks) / 2
        t = self._between_rows("allGather", nbytes)
        if t is None:
            lat, slope = fit_line_relative([(float(b), sec) for k, b, sec in self.rows
                                            if k == "allGather"])
            t = lat + slope * nbytes
        return self._at_ranks(t, ranks)

    def _between_rows(self, kind: str, nbytes: float) -> float | None:
        """Seconds of ``nbytes`` linear between the measured rows of ``kind`` around it; None
        outside their range."""
        pts = sorted((b, t) for k, b, t in self.rows if k == kind)
        if not pts or not pts[0][0] <= nbytes <= pts[-1][0]:
            return None
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if b0 <= nbytes <= b1:
                return t0 if b1 == b0 else t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        return pts[0][1]  # one row, at exactly its size

    def _at_ranks(self, seconds: float, ranks: int | None) -> float:
        """A ring collective's ``seconds`` at the measured ranks scaled to ``ranks`` by the
        bytes each rank moves, ``(n − 1)/n``."""
        n = ranks or self.ranks
        return seconds * ((n - 1) / n) / ((self.ranks - 1) / self.ranks)


@dataclass(frozen=True, slots=True)
class StageProfile:
    """Measured seconds per microbatch of the runtime's stage besides its layers, each part
    ``α + β·microbatch`` (never below 0), and the rows they were fitted to."""

    vocab: int
    overhead: tuple[float, float]  # every stage: the stage machinery around its layers
    embedding: tuple[float, float]  # the first stage's token embedding
    head: tuple[float, float]  # the last stage's final norm, LM head and loss
    rows: tuple[tuple[int, float, float, float], ...] = ()  # (b, middleS, firstS, lastS)
    layers: int = 1  # layers the measured stages held

    def part_s(self, part: str, micro_batch: int) -> float:
        """Seconds of ``part`` (overhead, embedding, head) for one microbatch."""
        alpha, beta = getattr(self, part)
        return max(0.0, alpha + beta * micro_batch)


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """Measured seconds of one layer (forward + backward, tp 1) as ``α + β·microbatch``, in
    one precision; ``recompute`` holds the measured lines of the recompute modes."""

    device: str
    shape: Shape
    alpha: float
    beta: float
    forward_share: float  # forward / (forward + backward), for full recompute
    software: tuple[tuple[str, str], ...] = ()
    source: str = ""
    # measured optimizer-step bandwidth (cost.optimizer_step_bytes / measured seconds);
    # 0: not measured, the catalog's HBM bandwidth is used
    optimizer_bytes_per_s: float = 0.0
    comm: CommProfile | None = None  # measured transfers inside a node (None: catalog links)
    precision: str = "fp32"  # the precision the block ran in (PRECISION_BYTES)
    recompute: tuple[tuple[str, float, float], ...] = ()  # (mode, α, β) measured
    # the runtime's stage around one layer (version 2 ``stage`` rows), each ``(α, β)`` of
    # seconds per microbatch: the stage machinery on every stage, the embedding on the first,
    # the final norm + LM head + loss on the last; None: not measured
    stage: StageProfile | None = None
    # the layer's (α, β) measured with ``concurrent_ranks`` ranks of one node running it at
    # once (version 2 ``concurrent``; CPU nodes); None: not measured
    concurrent: tuple[float, float] | None = None
    concurrent_ranks: int = 0
    # the ZB-H1 W pass (weight gradients) fitted as (α, β) over the rows' ``wS``; the B pass's
    # over ``bS`` (the backward with deferral on); None: not measured (the catalog rule)
    weight_grad: tuple[float, float] | None = None
    input_grad: tuple[float, float] | None = None
    # the layer measured sharded as the runtime shards it, ``(tp, α, β)`` of its forward +
    # backward per rank, the TP all-reduces included (version 2 ``tp``); empty: tp 1 only
    tp_layers: tuple[tuple[int, float, float], ...] = ()

    def measured_tp(self, tp: int) -> tuple[float, float] | None:
        """The measured ``(α, β)`` of the layer at ``tp`` (TP comm included), or None."""
        return next(((a, b) for t, a, b in self.tp_layers if t == tp), None)

    def slowdown(self, micro_batch: int) -> float:
        """Factor on a layer's seconds when several ranks of one node compute at once
        (``concurrent`` over the single-rank line, at least 1; 1 when not measured)."""
        if self.concurrent is None:
            return 1.0
        solo = self.alpha + self.beta * micro_batch
        busy = self.concurrent[0] + self.concurrent[1] * micro_batch
        return max(1.0, busy / solo) if solo > 0 else 1.0

    def matches(self, model: ModelSpec, elem_bytes: int) -> bool:
        """True when the profile measured this model's layer shape in a precision of
        ``elem_bytes`` bytes per element."""
        return (self.shape == model_shape(model)
                and PRECISION_BYTES.get(self.precision) == elem_bytes)

    def measured_mode(self, recompute: str) -> tuple[float, float] | None:
        """The measured ``(α, β)`` of a recompute mode (``none``: the plain line), or None."""
        if recompute == "none":
            return self.alpha, self.beta
        return next(((a, b) for m, a, b in self.recompute if m == recompute), None)

    def stage_matches(self, model: ModelSpec, elem_bytes: int) -> bool:
        """True when the profile measured this model's stage (layer shape, vocabulary and
        element size)."""
        return (self.stage is not None and self.matches(model, elem_bytes)
                and self.stage.vocab == model.vocab)

    def zb_bubble_ratio(self, micro_batch: int, recompute: str) -> float | None:
        """ZB-H1's bubble as a share of 1F1B's from the measured W pass: ``(F + B − W)/(F + B
        + W) = 1 − 2·W(b)/t(b)``, ``t`` the layer's fitted seconds in ``recompute`` (a
        recompute's forward runs in the B pass), clamped to ``[ZB_MIN_BUBBLE_RATIO, 1]``;
        None without a measured split."""
        if self.weight_grad is None:
            return None
        w = max(0.0, self.weight_grad[0] + self.weight_grad[1] * micro_batch)
        t = self.layer_s(micro_batch, 1, recompute)
        return min(1.0, max(ZB_MIN_BUBBLE_RATIO, 1.0 - 2.0 * w / t)) if t > 0 else None

    def layer_s(self, micro_batch: int, tp: int, recompute: str) -> float:
        """Seconds of one layer and microbatch on one of ``tp`` ranks (compute only); an
        unmeasured full recompute adds the measured forward share, an unmeasured selective
        one nothing here (``cost.layer_compute_s`` adds a modelled attention forward);
        attention-free, never measured, the full line, its upper bound
        (``cost.profiled_layer_s`` scales it by the model's attention-free / full ratio)."""
        mode = "full" if recompute == "attention-free" else recompute
        line = self.measured_mode(mode)
        if line is not None:
            return (line[0] + line[1] * micro_batch) / tp
        t = (self.alpha + self.beta * micro_batch) / tp
        return t * (1 + self.forward_share) if mode == "full" else t


def profile_from_doc(doc: Any, where: str) -> LayerProfile:
    """Parse a ``DeviceProfile`` document; errors name the field (``where.field``)."""
    if not isinstance(doc, Mapping):
        raise PlanningInputError(where, "must be a DeviceProfile mapping (hettrain profile)")
    if doc.get("kind") != PROFILE_KIND:
        raise PlanningInputError(f"{where}.kind", f"must be {PROFILE_KIND} (got "
                                 f"{doc.get('kind')!r}); write one with hettrain profile")
    version = doc.get("version")
    if isinstance(version, bool) or version not in PROFILE_VERSIONS:
        raise PlanningInputError(f"{where}.version", f"must be one of {list(PROFILE_VERSIONS)} "
                                 f"(got {version!r}); re-run hettrain profile")
    precision = doc.get("precision", "fp32") if version >= 2 else "fp32"
    if not isinstance(precision, str) or precision not in PRECISION_BYTES:
        raise PlanningInputError(f"{where}.precision", f"must be one of "
                                 f"{', '.join(PRECISION_BYTES)} (got {short_repr(precision)})")
    device = doc.get("device")
    if not isinstance(device, str) or not device:
        raise PlanningInputError(f"{where}.device", "is required (the device name it measured)")
    m = doc.get("model")
    keys = ("hidden", "heads", "kvHeads", "ffnHidden", "seqLen")
    if not isinstance(m, Mapping) or any(not _is_int(m.get(k)) for k in keys) or (
            not isinstance(m.get("gatedMlp", False), bool)):
        raise PlanningInputError(f"{where}.model", f"needs positive integers {', '.join(keys)}"
                                 f" (at most {MAX_COUNT}) and gatedMlp (true or false)")
    shape: Shape = (m["hidden"], m["heads"], m["kvHeads"], m["ffnHidden"], m["seqLen"],
                    bool(m.get("gatedMlp", False)))
    points, fwd, total, modes = _layer_points(doc.get("layer"), f"{where}.layer", version)
    alpha, beta = fit_line(points)
    recompute = tuple((m, *fit_line(pts)) for m, pts in modes.items() if pts)
    split = _split_points(doc.get("layer"), f"{where}.layer") if version >= 2 else None
    input_grad, weight_grad = (fit_line(split[0]), fit_line(split[1])) if split else (None, None)
    sw = doc.get("software") or {}
    software = tuple(sorted((str(k), str(v)) for k, v in sw.items())) if isinstance(
        sw, Mapping) else ()
    opt = doc.get("optimizerBytesPerS", 0.0)
    if "optimizerBytesPerS" in doc and not _is_number(opt, 1.0, MAX_BYTES):
        raise PlanningInputError(f"{where}.optimizerBytesPerS",
                                 "must be a number of bytes per second from 1 to 2**60 (or left "
                                 f"out; got {short_repr(opt)})")
    comm = comm_from_doc(doc["comm"], f"{where}.comm") if "comm" in doc else None
    stage = None
    if "stage" in doc:
        vocab = m.get("vocab")
        if version < 2 or not _is_int(vocab, 1, 2**31):
            raise PlanningInputError(f"{where}.model.vocab", "a positive integer is required "
                                     "with stage rows (version 2)")
        stage = stage_from_rows(doc["stage"], vocab, (alpha, beta), f"{where}.stage")
    conc, conc_ranks = None, 0
    if "concurrent" in doc:
        conc, conc_ranks = _concurrent_from_doc(doc["concurrent"], version,
                                                f"{where}.concurrent")
    tp_layers = _tp_from_doc(doc["tp"], version, f"{where}.tp") if "tp" in doc else ()
    return LayerProfile(device, shape, alpha, beta, fwd / total, software, where, float(opt),
                        comm, precision, recompute, stage, conc, conc_ranks, weight_grad,
                        input_grad, tp_layers)


Points = list[tuple[float, float]]


def _layer_points(rows: Any, where: str, version: int = 1
                  ) -> tuple[Points, float, float, dict[str, Points]]:
    """``(b, forward + backward)`` points of measured layer rows, the forward and total
    seconds summed, and (version 2) each recompute mode's ``(b, seconds)`` points (errors
    name the row)."""
    if not isinstance(rows, list) or not rows:
        raise PlanningInputError(where, "needs at least one measured microbatch")
    points, fwd, total = [], 0.0, 0.0
    modes: dict[str, Points] = {m: [] for m in RECOMPUTE_MODES}
    for i, r in enumerate(rows):
        at = f"{where}[{i}]"
        if not isinstance(r, Mapping) or any(k not in r for k in ("microBatch", "forwardS",
                                                                    "backwardS")):
            raise PlanningInputError(at, "needs microBatch, forwardS, backwardS (and numbers "
                                     f"for {', '.join(MODE_FIELDS.values())})")
        b, f, bw = _micro_batch(r, at), _seconds(r, "forwardS", at), _seconds(r, "backwardS", at)
        extra = {m: _seconds(r, k, at) for m, k in MODE_FIELDS.items()
                 if k in r and version >= 2}
        points.append((float(b), f + bw))
        fwd, total = fwd + f, total + f + bw
        for m, t in extra.items():
            modes[m].append((float(b), t))
    for m, pts in modes.items():
        if pts and len(pts) != len(points):
            raise PlanningInputError(where, f"{MODE_FIELDS[m]} must be given on every row or "
                                     "on none")
    return points, fwd, total, modes


def _split_points(rows: list, where: str) -> tuple[Points, Points] | None:
    """The ``(b, bS)`` and ``(b, wS)`` points of layer rows (already checked by
    :func:`_layer_points`), or None when no row has them; on some rows only, or not
    positive: an error naming the row."""
    have = [any(k in r for k in SPLIT_FIELDS) for r in rows]
    if not any(have):
        return None
    b_pts, w_pts = [], []
    for i, r in enumerate(rows):
        if "bS" not in r or "wS" not in r:
            raise PlanningInputError(f"{where}[{i}]", "bS and wS must be numbers on every row "
                                     "or on none")
        bs, ws = _seconds(r, "bS", f"{where}[{i}]"), _seconds(r, "wS", f"{where}[{i}]")
        b_pts.append((float(r["microBatch"]), bs))
        w_pts.append((float(r["microBatch"]), ws))
    return b_pts, w_pts


def _tp_from_doc(doc: Any, version: int, where: str) -> tuple[tuple[int, float, float], ...]:
    """The ``tp`` section: per measured TP degree its fitted forward + backward line."""
    if version < 2 or not isinstance(doc, list):
        raise PlanningInputError(where, "must be a list of {tp, layer} entries (version 2)")
    out: dict[int, tuple[float, float]] = {}
    for i, e in enumerate(doc):
        tp = e.get("tp") if isinstance(e, Mapping) else None
        if not _is_int(tp, 2) or tp in out:
            raise PlanningInputError(f"{where}[{i}].tp", "must be an integer >= 2, each "
                                     "degree once (the TP degree measured)")
        points, _, _, _ = _layer_points(e.get("layer"), f"{where}[{i}].layer")
        out[tp] = fit_line(points)
    return tuple((tp, a, b) for tp, (a, b) in sorted(out.items()))


def _concurrent_from_doc(doc: Any, version: int, where: str) -> tuple[tuple[float, float], int]:
    """The ``concurrent`` section: its fitted line and ranks."""
    if version < 2 or not isinstance(doc, Mapping):
        raise PlanningInputError(where, "must be a mapping with ranks and layer rows "
                                 "(version 2)")
    ranks = doc.get("ranks")
    if not _is_int(ranks, 2):
        raise PlanningInputError(f"{where}.ranks", f"must be an integer from 2 to {MAX_COUNT} "
                                 "(the ranks measured)")
    points, _, _, _ = _layer_points(doc.get("layer"), f"{where}.layer")
    return fit_line(points), ranks


def _fit_part(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``α + β·x`` of a part's seconds, each clamped at 0 (a part below the
    noise of the subtraction costs nothing), with ``α, β ≥ 0``: a falling line is taken as
    its mean (a part that does not grow with the microbatch), a negative intercept is refit
    through the origin."""
    pts = [(x, max(0.0, y)) for x, y in points]
    line = _weighted_line(pts, [1.0] * len(pts))
    if line is None or line[1] <= 0:
        return sum(y for _, y in pts) / len(pts), 0.0
    alpha, beta, through_origin = line
    return (alpha, beta) if alpha >= 0 else (0.0, through_origin)


def stage_from_rows(rows: Any, vocab: int, layer: tuple[float, float],
                    where: str) -> StageProfile:
    """Parse ``stage`` rows and fit the three parts against the fitted ``layer`` line
    ``(α, β)``: overhead = middle − layers·layer, embedding = first − middle, head = last −
    middle (``layers``: the rows' stage layer count, 1 when absent, equal on every row)."""
    if not isinstance(rows, list) or not rows:
        raise PlanningInputError(where, "needs at least one measured microbatch")
    counts = [r.get("layers", 1) if isinstance(r, Mapping) else None for r in rows]
    layers = counts[0]
    if not _is_int(layers) or any(not _is_int(c) or c != layers for c in counts):
        raise PlanningInputError(f"{where}[].layers", "must be one positive integer on every "
                                 "row (the layers the measured stage held)")
    parsed = []
    for i, r in enumerate(rows):
        at = f"{where}[{i}]"
        if any(k not in r for k in ("microBatch", "middleS", "firstS", "lastS")):
            raise PlanningInputError(at, "needs microBatch, middleS, firstS, lastS")
        b = _micro_batch(r, at)
        mid, first, last = (_seconds(r, k, at) for k in ("middleS", "firstS", "lastS"))
        parsed.append((b, mid, first, last))
    a, beta = layer
    overhead = _fit_part([(b, mid - layers * (a + beta * b)) for b, mid, _, _ in parsed])
    embedding = _fit_part([(b, first - mid) for b, mid, first, _ in parsed])
    head = _fit_part([(b, last - mid) for b, mid, _, last in parsed])
    return StageProfile(vocab, overhead, embedding, head, tuple(parsed), layers)


def _comm_rows(doc: Mapping, kind: str, where: str) -> list[tuple[float, float]]:
    rows = doc.get(kind)
    if not isinstance(rows, list) or len(rows) < 2:
        raise PlanningInputError(f"{where}.{kind}", "needs at least two measured sizes "
                                 "(re-run hettrain profile)")
    points = []
    for i, r in enumerate(rows):
        at = f"{where}.{kind}[{i}]"
        if not isinstance(r, Mapping) or "bytes" not in r or "seconds" not in r:
            raise PlanningInputError(at, "needs bytes and seconds")
        if not _is_number(r["bytes"], 1, MAX_BYTES):
            raise PlanningInputError(at, "bytes must be a number from 1 to 2**60 "
                                     f"(got {short_repr(r['bytes'])})")
        points.append((float(r["bytes"]), _seconds(r, "seconds", at)))
    if len({b for b, _ in points}) < 2:
        raise PlanningInputError(f"{where}.{kind}", "needs at least two different sizes")
    return points


def comm_from_doc(doc: Any, where: str) -> CommProfile:
    """Parse a profile's ``comm`` section (module docstring); errors name the field."""
    if not isinstance(doc, Mapping):
        raise PlanningInputError(where, "must be a mapping with ranks, p2p and allReduce")
    ranks = doc.get("ranks")
    if not _is_int(ranks, 2):
        raise PlanningInputError(f"{where}.ranks", f"must be an integer from 2 to {MAX_COUNT} "
                                 "(the ranks measured)")
    backend = doc.get("backend", "")
    if not isinstance(backend, str):
        raise PlanningInputError(f"{where}.backend", "must be a string (the library measured, "
                                 f"e.g. gloo; got {short_repr(backend)})")
    p2p = _comm_rows(doc, "p2p", where)
    ring = _comm_rows(doc, "allReduce", where)
    # all-gather rows are optional: profiles written before they were measured lack them
    gather = _comm_rows(doc, "allGather", where) if doc.get("allGather") is not None else []
    p2p_lat, p2p_slope = fit_line_relative(p2p)
    ar_lat, ar_slope = fit_line_relative(ring)
    steps = 2 * (ranks - 1)
    rows = tuple((kind, int(b), t) for kind, pts in (("p2p", p2p), ("allReduce", ring),
                                                     ("allGather", gather))
                 for b, t in pts)
    return CommProfile(p2p_lat, 1.0 / p2p_slope, ar_lat / steps,
                       steps / ranks / ar_slope, ranks, backend, rows)


def comm_doc(comm: CommProfile) -> dict[str, Any]:
    """The ``comm`` section that reads back as ``comm`` (its measured rows)."""
    kinds = ("p2p", "allReduce") + (("allGather",) if comm.measures_all_gather else ())
    return {"ranks": comm.ranks, "backend": comm.backend,
            **{kind: [{"bytes": b, "seconds": t} for k, b, t in comm.rows if k == kind]
               for kind in kinds}}


def load_profile(path: str | Path) -> LayerProfile:
    """Read a profile YAML file through the bounded loader (:mod:`hettrain.api.yamlsafe`:
    size, nesting, alias expansion and number literals are bounded); errors name the file."""
    try:
        doc = read_yaml_document(path)
    except YamlInputError as exc:
        raise PlanningInputError(exc.where, " ".join(exc.message.split())) from None
    return profile_from_doc(doc, str(path))


def apply_profiles(inventory: Any, profiles: Iterable[LayerProfile]) -> Any:
    """The inventory with each profile attached to its device (by name) in every pool."""
    by_device = {p.device: p for p in profiles}
    if not by_device:
        return inventory
    known = {p.device.name for p in inventory.pools}
    unknown = sorted(set(by_device) - known)
    if unknown:
        raise PlanningInputError(by_device[unknown[0]].source + ".device", (
            f"{unknown[0]!r} is not a device of this cluster ({', '.join(sorted(known))})"))
    pools = tuple(dataclasses.replace(p, device=dataclasses.replace(
        p.device, profile=by_device[p.device.name])) if p.device.name in by_device else p
        for p in inventory.pools)
    return dataclasses.replace(inventory, pools=pools)


def profile_doc(device: str, software: Mapping[str, str], model: ModelSpec,
                rows: Sequence[tuple[int, float, float]],
                optimizer_bytes_per_s: float = 0.0,
                comm: Mapping[str, Any] | None = None,
                stage: Sequence[tuple[int, float, float, float]] = (),
                concurrent: Mapping[str, Any] | None = None, *, precision: str = "fp32",
                modes: Mapping[str, Sequence[float]] | None = None,
                stage_layers: int = 1,
                split: Sequence[tuple[float, float]] | None = None,
                tp: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The YAML document for measured ``(microBatch, forwardS, backwardS)`` rows in
    ``precision`` (and the measured optimizer bandwidth, ``comm`` section, ``(microBatch,
    middleS, firstS, lastS)`` stage rows, ``concurrent`` section ``{ranks, layer:
    [(microBatch, forwardS, backwardS)]}`` and recompute modes' forward+backward seconds per
    row, ``{"selective": [...], "full": [...]}``, the ZB-H1 backward split ``(bS, wS)`` per
    row and the layer measured sharded, ``[{tp, backend, layer: [(microBatch, forwardS,
    backwardS)]}]``, when given; the stage rows' stages held ``stage_layers`` layers)."""
    modes = modes or {}
    if split is not None and len(split) != len(rows):
        raise ValueError("split: one (bS, wS) per row")
    for m, ts in modes.items():
        if m not in MODE_FIELDS or len(ts) != len(rows):
            raise ValueError(f"modes[{m!r}]: one of {list(MODE_FIELDS)}, a time per row")
    extra: dict[str, Any] = {}
    if optimizer_bytes_per_s:
        extra["optimizerBytesPerS"] = optimizer_bytes_per_s
    if comm:
        extra["comm"] = dict(comm)
    if stage:
        extra["stage"] = [{"microBatch": b, "layers": stage_layers, "middleS": mid,
                           "firstS": first, "lastS": last} for b, mid, first, last in stage]
    if tp:
        extra["tp"] = [{"tp": e["tp"], "backend": e.get("backend", ""), "layer": [
            {"microBatch": b, "forwardS": f, "backwardS": bw} for b, f, bw in e["layer"]]}
            for e in tp]
    if concurrent:
        extra["concurrent"] = {"ranks": concurrent["ranks"], "layer": [
            {"microBatch": b, "forwardS": f, "backwardS": bw} for b, f, bw in concurrent["layer"]]}
    return {
        "apiVersion": "hettrain.dev/v1alpha1", "kind": PROFILE_KIND, "version": PROFILE_VERSION,
        "device": device, "precision": precision, "software": dict(software),
        "model": {"hidden": model.hidden, "heads": model.heads, "kvHeads": model.kv_heads,
                  "ffnHidden": model.ffn_hidden, "seqLen": model.seq_len,
                  "gatedMlp": model.gated_mlp, "vocab": model.vocab},
        "layer": [{"microBatch": b, "forwardS": f, "backwardS": bw,
                   **{MODE_FIELDS[m]: ts[i] for m, ts in modes.items()},
                   **(dict(zip(SPLIT_FIELDS, split[i], strict=True)) if split else {})}
                  for i, (b, f, bw) in enumerate(rows)],
        **extra,
    }
