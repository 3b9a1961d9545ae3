"""HetTrainingJob spec: frozen dataclasses parsed from the CR's camelCase ``spec`` dict.

``parse_job_spec(spec)`` is the single entry point. It never guesses: bad input raises
:class:`SpecError` naming the field path and the fix, e.g.
``spec.training.globalBatch: must be an integer >= 1 (got 0); set it to the global batch in
sequences``. The CRD's structural schema rejects most of these already at the API server; this
parser is the second line for the offline CLI and for rules a schema cannot express.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hettrain.api.constants import VENDORS
from hettrain.api.limits import SPEC_MAX_LENGTHS, SPEC_MAXIMUMS

PRECISIONS = ("bf16", "fp16", "fp32")
# spec.training.recompute, least recomputed first: selective re-runs the attention core;
# attention-free checkpoints the whole layer but saves the attention kernel's output and
# log-sum-exp (HelixPipe), re-running everything else; full re-runs the whole layer
RECOMPUTE_MODES = ("none", "selective", "attention-free", "full")
RECOMPUTE_SPEC_MODES = (*RECOMPUTE_MODES, "auto")  # spec only: the planner picks a mode
SCHEDULES = ("auto", "1f1b", "interleaved", "zb-h1", "interleaved-zb", "helix")
# schedules whose stages hold several model chunks (virtual stages, Megatron's round-robin
# placement) and schedules that split the backward into B (input gradients) and W (weight
# gradients); interleaved-zb is both (planning/interleaved_zb.py); helix holds one layer per
# chunk and runs attention cores on idle stages (planning/helix.py)
CHUNKED_SCHEDULES = ("interleaved", "interleaved-zb", "helix")
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "interleaved-zb")


def chunked_schedule(schedule: str) -> bool:
    """Whether ``schedule`` runs several model chunks per stage (``virtualStages``)."""
    return schedule in CHUNKED_SCHEDULES


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` defers the linear weight gradients (W) after the input-gradient
    pass (B), as zero-bubble schedules do."""
    return schedule in SPLIT_BACKWARD_SCHEDULES
CROSS_DC_MODES = ("sync", "compress", "diloco")
CROSS_DC_SPEC_MODES = (*CROSS_DC_MODES, "auto")  # spec only: the planner picks sync|compress
COMPRESSIONS = ("none", "bf16", "int8")
# spec.training.attention: the attention kernel. flash = fused (the runtime's torch SDPA: the
# s×s scores never reach memory); eager = unfused, the scores materialised in memory (QKᵀ,
# masked softmax, dropout, ·V as separate kernels: Megatron-LM 2021); the planner prices its
# score traffic, the runtime trains flash only (planning/support.py)
ATTENTION_KERNELS = ("flash", "eager")
# spec.training.sharding: what the data-parallel group shards (runtime/optim.py). optimizer =
# ZeRO-1 (fp32 master + AdamW moments), gradients = ZeRO-2 (+ the fp32 main grads), full =
# ZeRO-3 / FSDP (+ the parameters, gathered unit by unit)
SHARDINGS = ("none", "optimizer", "gradients", "full")
SHARDING_SPEC_MODES = (*SHARDINGS, "auto")  # spec only: the planner picks optimizer|gradients|full
REPAIR_MODES = ("Shrink", "WaitForReplacement")
LR_SCHEDULES = ("constant", "cosine", "wsd")
NO_DECAY_GROUPS = ("norms", "biases", "embeddings")


class SpecError(ValueError):
    """A spec field is invalid: ``field`` is the dotted path, ``message`` says what and the fix."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A Llama-family decoder (RMSNorm, RoPE, GQA, no biases). ``ffn_hidden`` defaults to
    4*hidden, ``kv_heads`` to ``heads``; ``gated_mlp`` selects SwiGLU (Llama), else a GELU MLP.

    RoPE: ``rope_theta`` is the base; ``rope_factor`` > 1 applies Llama 3.1 frequency scaling
    (``rope_low_freq_factor``, ``rope_high_freq_factor``, ``rope_original_max_positions``), as
    Hugging Face's ``rope_type: llama3``; 1.0 means plain RoPE. ``tie_embeddings`` shares the
    token embedding with the output layer. ``pretrained`` (a path in the pods) names Hugging
    Face safetensors weights to start from instead of the seeded init.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int
    kv_heads: int
    name: str = "custom"
    gated_mlp: bool = False  # SwiGLU-style MLP (3 matrices) as in Llama
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0
    rope_factor: float = 1.0  # Llama 3.1 rope scaling; 1.0 = none
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    tie_embeddings: bool = False
    pretrained: str | None = None  # HF safetensors file or directory the runtime starts from

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Total parameter count: bias-free projections, two RMSNorm weights per layer, the
        final norm, the token embedding and (when untied) the output layer."""
        h, f = self.hidden, self.ffn_hidden
        kv = self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o
        mlp = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * h
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab * h
        return self.layers * (attn + mlp + norms) + embeddings + h


# Llama 3.1 RoPE: theta 500000 with frequency scaling (the models' config.json)
_LLAMA31_ROPE: dict[str, Any] = dict(
    rope_theta=500000.0, rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
    rope_original_max_positions=8192, norm_eps=1e-5,
)

# Public architectures; numbers from the model cards / papers (Llama: Hugging Face config.json).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-tiny": dict(layers=4, hidden=64, heads=4, seq_len=64, vocab=256),
    "gpt-small": dict(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257),
    "gpt3-1.3b": dict(layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50257),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257),
    "llama3-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq_len=8192,
        vocab=128256, gated_mlp=True, **_LLAMA31_ROPE,
    ),
    "llama3-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, seq_len=8192,
        vocab=128256, gated_mlp=True, **_LLAMA31_ROPE,
    ),
    "llama3-405b": dict(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, seq_len=8192,
        vocab=128256, gated_mlp=True, **_LLAMA31_ROPE,
    ),
    # a Llama-3-shaped model small enough for CPU tests and demos (GQA, SwiGLU, rope scaling)
    "llama-tiny": dict(
        layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=192, seq_len=64, vocab=256,
        gated_mlp=True, **_LLAMA31_ROPE,
    ),
}


# TrainingSpec fields the planner sets in a plan and no spec (nor the CRD) has
PLANNER_TRAINING_FIELDS = ("loss_chunk_tokens", "mlp_chunk_tokens")


@dataclass(frozen=True, slots=True)
class TrainingSpec:
    """Batch sizes are in sequences. ``micro_batch`` None lets the planner choose."""

    global_batch: int
    steps: int
    micro_batch: int | None = None
    precision: str = "bf16"
    optimizer_sharding: bool = True  # sharding != "none" (kept for readers of the flag)
    recompute: str = "selective"
    learning_rate: float = 3e-4
    seed: int = 1234
    # the training loop (runtime/schedule.py, runtime/optim.py); all additive with defaults, so
    # plans written before them still load
    lr_schedule: str = "cosine"  # constant | cosine | wsd (warmup, stable, decay)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # final lr / learning_rate (cosine, wsd)
    wsd_decay_fraction: float = 0.2  # wsd: share of the steps spent decaying
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    weight_decay: float = 0.1  # decoupled (AdamW)
    decay_norms: bool = False  # weightDecayExclude: norms (default excluded)
    decay_biases: bool = False  # weightDecayExclude: biases (default excluded)
    decay_embeddings: bool = True  # weightDecayExclude: embeddings (default decayed)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    validation_interval: int = 0  # validation loss every N steps; 0 = never
    validation_batches: int = 1  # global batches per validation
    # DP gradient sync overlapped with the last microbatch's backward, in buckets (runtime/
    # grad_sync.py); false: one sync after the backward (the cost model follows either way)
    overlap_grad_reduce: bool = True
    # none | optimizer (ZeRO-1) | gradients (ZeRO-2) | full (ZeRO-3/FSDP); "auto" only in a
    # spec (a plan's is always resolved). "" (unset): follows ``optimizer_sharding``.
    sharding: str = ""
    # flash | eager (ATTENTION_KERNELS): eager prices the materialised s×s scores (cost.py)
    attention: str = "flash"
    # set by the planner, never by a spec (PLANNER_TRAINING_FIELDS; planning/cost.py
    # loss_chunk_tokens): > 0, the runtime computes the LM head and loss that many tokens at
    # a time (runtime/model.py)
    loss_chunk_tokens: int = 0
    # set by the planner (planning/cost.py mlp_chunk_tokens): > 0, a layer re-run in the
    # backward (full or attention-free recompute) computes its MLP that many tokens at a time
    # and keeps none of its ffn-wide tensors for the whole sequence (runtime/model.py)
    mlp_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        # one truth for both fields: unset follows the flag; otherwise "off" wins, so
        # ``replace(t, optimizer_sharding=False)`` and ``replace(t, sharding="none")`` both
        # turn sharding off, and the flag is true exactly when sharding != "none"
        sharding = self.sharding or ("optimizer" if self.optimizer_sharding else "none")
        if not self.optimizer_sharding:
            sharding = "none"
        object.__setattr__(self, "sharding", sharding)
        object.__setattr__(self, "optimizer_sharding", sharding != "none")


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """Which nodes may be used. Empty tuples mean no restriction."""

    vendors: tuple[str, ...] = ()
    datacenters: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    max_gpus: int | None = None


@dataclass(frozen=True, slots=True)
class ParallelismSpec:
    """Optional pins for the planner; None means search."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    schedule: str = "auto"
    virtual_stages: int | None = None  # interleaved: model chunks per stage (None: searched)
    cp: int | None = None  # context-parallel degree, a power of two (None: searched)
    replica_groups: bool = False  # may add a replica group on idle nodes of another pool


@dataclass(frozen=True, slots=True)
class CrossDCSpec:
    """How gradients cross a datacenter link: plain sync, compressed, or DiLoCo outer steps."""

    mode: str = "sync"
    compression: str = "bf16"
    outer_steps: int = 50  # DiLoCo H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """Where and how often to checkpoint. Exactly one of ``uri`` / ``pvc`` (or neither)."""

    uri: str | None = None
    pvc: str | None = None
    interval_steps: int = 100
    keep: int = 3  # committed checkpoints kept (retention)
    async_save: bool = True  # write in a background thread (training stalls for the copy only)
    secret_ref: str | None = None  # Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    endpoint: str | None = None  # S3-compatible endpoint URL (MinIO, Ceph); not a secret


DATA_MOUNT_DIR = "/data"  # where the pods mount spec.data.pvc (read-only)


@dataclass(frozen=True, slots=True)
class DataSpec:
    """Training data: a token set written by ``hettrain data prepare`` at ``uri`` (a path or an
    fsspec URI such as ``s3://bucket/set``) or at ``path`` inside the PVC ``pvc``; or the
    synthetic pool when ``synthetic``. All unset: the spec has no data section."""

    uri: str | None = None
    pvc: str | None = None
    path: str = ""
    synthetic: bool = False

    def to_plan(self) -> dict[str, Any]:
        """The plan's ``data`` section: what the runtime opens (``{}`` when unset)."""
        if self.synthetic:
            return {"synthetic": True}
        if self.pvc:
            return {"uri": f"{DATA_MOUNT_DIR}/{self.path}".rstrip("/"), "pvc": self.pvc}
        return {"uri": self.uri} if self.uri else {}


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """Repair behaviour after node or pod failures."""

    max_repairs: int = 10
    min_gpus: int = 1
    mode: str = "Shrink"
    wait_seconds: int = 300
    debounce_seconds: float = 5.0


@dataclass(frozen=True, slots=True)
class CalibrationSpec:
    """Closed-loop calibration (``spec.calibration``): compare the runtime's measured stage
    times with the plan, refine the device profiles, re-plan when it pays off."""

    enabled: bool = False
    replan_threshold: float = 0.10  # re-plan when the corrected model's best plan is this faster
    max_replans: int = 3  # calibration re-plans per job (a cap on oscillation)
    min_steps: int = 3  # measured steps (after the first) before the stage times are trusted
    profile: bool = False  # run one profiling pod per pool before the first plan


@dataclass(frozen=True, slots=True)
class JobSpec:
    """The whole parsed HetTrainingJob spec."""

    model: ModelSpec
    training: TrainingSpec
    placement: PlacementSpec = PlacementSpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    cross_dc: CrossDCSpec = CrossDCSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    failure_policy: FailurePolicy = FailurePolicy()
    data: DataSpec = DataSpec()
    image: str = "ghcr.io/hettrain/runtime:0.1.0"
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    suspend: bool = False
    priority_class_name: str | None = None
    scheduler_name: str | None = None
    calibration: CalibrationSpec = CalibrationSpec()

    def with_training(self, **changes: Any) -> JobSpec:
        """A copy with some training fields changed (used by re-planning and the simulator)."""
        return replace(self, training=replace(self.training, **changes))


# ---------------------------------------------------------------- field readers


def short_repr(value: Any) -> str:
    """``repr`` of a value, cut to one short line (hostile input can be huge): what every
    error message about a bad input value shows of it."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _check_maximum(where: str, value: float) -> None:
    """Refuse a value above :data:`hettrain.api.limits.SPEC_MAXIMUMS` for ``where``."""
    limit = SPEC_MAXIMUMS.get(where)
    if limit is not None and value > limit:
        raise SpecError(where, f"must be <= {limit} (got {short_repr(value)}); this bound keeps "
                               "planning and training arithmetic finite")


def _check_length(key: str, value: str, where: str | None = None) -> None:
    """Refuse a string longer than :data:`hettrain.api.limits.SPEC_MAX_LENGTHS` for ``key``."""
    limit = SPEC_MAX_LENGTHS.get(key)
    if limit is not None and len(value) > limit:
        raise SpecError(where or key, f"must be at most {limit} characters (got {len(value)})")


class _Fields:
    """Reads one mapping, remembering its path so every error names the exact field."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SpecError(path, f"must be a mapping (got {type(data).__name__})")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def _get(self, key: str) -> Any:
        self.used.add(key)
        return self.data.get(key)

    def int_(self, key: str, default: int | None = None, minimum: int = 1,
             required: bool = False, fix: str = "") -> int | None:
        value = self._get(key)
        where = f"{self.path}.{key}"
        if value is None:
            if required:
                raise SpecError(where, f"is required{'; ' + fix if fix else ''}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(where, f"must be an integer (got {short_repr(value)})"
                                   f"{'; ' + fix if fix else ''}")
        if value < minimum:
            raise SpecError(
                where,
                f"must be an integer >= {minimum} (got {short_repr(value)})"
                f"{'; ' + fix if fix else ''}"
            )
        _check_maximum(where, value)
        return value

    def float_(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = self._get(key)
        where = f"{self.path}.{key}"
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(where, f"must be a number (got {short_repr(value)})")
        finite = math.isfinite(value) if isinstance(value, float) else abs(value) <= 1e300
        if not finite:
            raise SpecError(where, f"must be a finite number (got {short_repr(value)})")
        if value < minimum:
            raise SpecError(where, f"must be >= {minimum} (got {short_repr(value)})")
        _check_maximum(where, value)
        return float(value)

    def str_(self, key: str, default: str | None = None, choices: tuple[str, ...] = (),
             required: bool = False) -> str | None:
        value = self._get(key)
        where = f"{self.path}.{key}"
        if value is None:
            if required:
                raise SpecError(where, "is required")
            return default
        if not isinstance(value, str) or not value:
            raise SpecError(where, f"must be a non-empty string (got {short_repr(value)})")
        if choices and value not in choices:
            raise SpecError(where, f"must be one of {', '.join(choices)} (got {short_repr(value)})")
        _check_length(where, value)
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(f"{self.path}.{key}",
                            f"must be true or false (got {short_repr(value)})")
        return value

    def str_list(self, key: str, choices: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self._get(key)
        where = f"{self.path}.{key}"
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise SpecError(where, f"must be a list of non-empty strings (got {short_repr(value)})")
        for i, v in enumerate(value):
            if choices and v not in choices:
                raise SpecError(f"{where}[{i}]",
                                f"must be one of {', '.join(choices)} (got {short_repr(v)})")
            _check_length(f"{where}[]", v, f"{where}[{i}]")
        return tuple(value)

    def str_map(self, key: str) -> dict[str, str]:
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise SpecError(f"{self.path}.{key}", "must be a mapping of strings to strings")
        for k, v in value.items():
            _check_length(f"{self.path}.{key}{{}}", v, f"{self.path}.{key}.{k}")
        return dict(value)

    def sub(self, key: str) -> _Fields:
        return _Fields(self._get(key), f"{self.path}.{key}")

    def reject_unknown(self) -> None:
        """Unknown keys are typos; say which one and what is allowed."""
        unknown = sorted(str(k)[:60] for k in self.data if k not in self.used)
        if unknown:
            allowed = ", ".join(sorted(self.used))
            raise SpecError(f"{self.path}.{unknown[0]}", f"unknown field; allowed: {allowed}")


# ---------------------------------------------------------------- section parsers


def _parse_model(f: _Fields) -> ModelSpec:
    preset_name = f.str_("preset")
    base: dict[str, Any] = {}
    if preset_name is not None:
        if preset_name not in MODEL_PRESETS:
            raise SpecError(
                f"{f.path}.preset",
                f"unknown preset {short_repr(preset_name)}; use one of {', '.join(MODEL_PRESETS)} "
                "or give layers/hidden/heads/seqLen/vocab",
            )
        base = dict(MODEL_PRESETS[preset_name])
    need = preset_name is None
    fix = "give it, or set spec.model.preset"
    layers = f.int_("layers", base.get("layers"), required=need, fix=fix)
    hidden = f.int_("hidden", base.get("hidden"), required=need, fix=fix)
    heads = f.int_("heads", base.get("heads"), required=need, fix=fix)
    seq_len = f.int_("seqLen", base.get("seq_len"), required=need, fix=fix)
    vocab = f.int_("vocab", base.get("vocab"), required=need, fix=fix)
    assert layers and hidden and heads and seq_len and vocab
    ffn = f.int_("ffnHidden", base.get("ffn_hidden", 4 * hidden))
    kv_heads = f.int_("kvHeads", base.get("kv_heads", heads))
    gated = f.bool_("gatedMlp", bool(base.get("gated_mlp", False)))
    name = f.str_("name", preset_name or "custom")
    llama = _parse_llama_fields(f, base)
    f.reject_unknown()
    if hidden % heads:
        raise SpecError(
            f"{f.path}.heads", f"hidden ({hidden}) must be divisible by heads ({heads})"
        )
    assert kv_heads is not None and ffn is not None and name is not None
    if heads % kv_heads:
        raise SpecError(
            f"{f.path}.kvHeads", f"heads ({heads}) must be divisible by kvHeads ({kv_heads})"
        )
    return ModelSpec(
        layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab,
        ffn_hidden=ffn, kv_heads=kv_heads, name=name, gated_mlp=gated, **llama,
    )


def _parse_llama_fields(f: _Fields, base: dict[str, Any]) -> dict[str, Any]:
    """``normEps``, ``ropeTheta``, ``ropeScaling``, ``tieEmbeddings`` (preset values as
    defaults) and ``pretrained`` as ModelSpec keyword arguments."""
    d = ModelSpec.__dataclass_fields__
    out: dict[str, Any] = {}
    out["norm_eps"] = f.float_("normEps", base.get("norm_eps", d["norm_eps"].default))
    if not 0 < out["norm_eps"] < 1:
        raise SpecError(f"{f.path}.normEps", f"must be > 0 and < 1 (got {out['norm_eps']}); "
                        "Llama uses 1e-5")
    out["rope_theta"] = f.float_("ropeTheta", base.get("rope_theta", d["rope_theta"].default))
    if out["rope_theta"] <= 1:
        raise SpecError(f"{f.path}.ropeTheta", f"must be > 1 (got {out['rope_theta']}); "
                        "Llama 3 uses 500000")
    r = f.sub("ropeScaling")
    out["rope_factor"] = r.float_("factor", base.get("rope_factor", d["rope_factor"].default),
                                  minimum=1.0)
    out["rope_low_freq_factor"] = r.float_(
        "lowFreqFactor", base.get("rope_low_freq_factor", d["rope_low_freq_factor"].default))
    out["rope_high_freq_factor"] = r.float_(
        "highFreqFactor", base.get("rope_high_freq_factor", d["rope_high_freq_factor"].default))
    out["rope_original_max_positions"] = r.int_(
        "originalMaxPositionEmbeddings",
        base.get("rope_original_max_positions", d["rope_original_max_positions"].default))
    r.reject_unknown()
    if out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
        raise SpecError(f"{r.path}.highFreqFactor",
                        f"must be > lowFreqFactor ({out['rope_low_freq_factor']}) "
                        f"(got {out['rope_high_freq_factor']}); Llama 3.1 uses 4 and 1")
    out["tie_embeddings"] = f.bool_("tieEmbeddings",
                                    bool(base.get("tie_embeddings", False)))
    out["pretrained"] = f.str_("pretrained")
    return out


def _parse_training(f: _Fields) -> TrainingSpec:
    gb = f.int_("globalBatch", required=True, fix="set the global batch in sequences")
    steps = f.int_("steps", required=True, fix="set the number of optimizer steps")
    mb = f.int_("microBatch")
    precision = f.str_("precision", "bf16", PRECISIONS)
    sharding = _parse_sharding(f)
    overlap = f.bool_("overlapGradReduce", True)
    attention = f.str_("attention", "flash", ATTENTION_KERNELS)
    recompute = f.str_("recompute", "selective", RECOMPUTE_SPEC_MODES)
    lr = f.float_("learningRate", 3e-4)
    seed = f.int_("seed", 1234, minimum=0)
    loop = _parse_training_loop(f)
    f.reject_unknown()
    assert (gb is not None and steps is not None and precision and recompute and attention
            and seed is not None)
    if mb is not None and gb % mb:
        raise SpecError(
            f"{f.path}.microBatch",
            f"globalBatch ({gb}) must be divisible by microBatch ({mb}); "
            "pick a divisor or omit microBatch to let the planner choose",
        )
    if recompute not in (*recompute_options("auto", attention), "auto"):
        raise SpecError(f"{f.path}.recompute",
                        "attention-free keeps the fused attention kernel's output and "
                        "log-sum-exp, which eager attention does not produce; use attention: "
                        "flash or another recompute mode")
    return TrainingSpec(
        global_batch=gb, steps=steps, micro_batch=mb, precision=precision,
        optimizer_sharding=sharding != "none", sharding=sharding, recompute=recompute,
        learning_rate=lr, seed=seed, **loop, overlap_grad_reduce=overlap, attention=attention,
    )


def _parse_sharding(f: _Fields) -> str:
    """``spec.training.sharding``, or (absent) what the older ``optimizerSharding`` says
    (true: optimizer, false: none); both given must agree."""
    flag_given = f.data.get("optimizerSharding") is not None
    flag = f.bool_("optimizerSharding", True)
    sharding = f.str_("sharding", None, SHARDING_SPEC_MODES)
    if sharding is None:
        return "optimizer" if flag else "none"
    if flag_given and flag != (sharding != "none"):
        want = "false" if sharding == "none" else "true"
        raise SpecError(
            f"{f.path}.sharding",
            f"sharding: {sharding} contradicts optimizerSharding: {str(flag).lower()}; "
            f"remove optimizerSharding (sharding replaces it) or set it to {want}")
    return sharding


def _parse_training_loop(f: _Fields) -> dict[str, Any]:
    """The loop fields of ``spec.training``: lr schedule, clipping, weight decay, Adam,
    validation (TrainingSpec keyword arguments)."""
    out: dict[str, Any] = {
        "lr_schedule": f.str_("lrSchedule", "cosine", LR_SCHEDULES),
        "warmup_steps": f.int_("warmupSteps", 0, minimum=0),
        "min_lr_ratio": f.float_("minLrRatio", 0.1),
        "wsd_decay_fraction": f.float_("wsdDecayFraction", 0.2),
        "grad_clip": f.float_("gradClip", 1.0),
        "weight_decay": f.float_("weightDecay", 0.1),
        "adam_eps": f.float_("adamEps", 1e-8),
    }
    if out["min_lr_ratio"] > 1.0:
        raise SpecError(f"{f.path}.minLrRatio", f"must be in [0, 1] (got {out['min_lr_ratio']}); "
                        "it is the final learning rate as a fraction of learningRate")
    if not 0.0 < out["wsd_decay_fraction"] <= 1.0:
        raise SpecError(f"{f.path}.wsdDecayFraction",
                        f"must be in (0, 1] (got {out['wsd_decay_fraction']})")
    if out["adam_eps"] <= 0.0:
        raise SpecError(f"{f.path}.adamEps", f"must be > 0 (got {out['adam_eps']})")
    betas = f._get("adamBetas")
    if betas is None:
        betas = [0.9, 0.95]
    if (not isinstance(betas, list) or len(betas) != 2
            or not all(isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1
                       for b in betas)):
        raise SpecError(f"{f.path}.adamBetas",
                        f"must be two numbers in [0, 1) (got {short_repr(betas)}), e.g. "
                        "[0.9, 0.95]")
    out["adam_beta1"], out["adam_beta2"] = float(betas[0]), float(betas[1])
    exclude = f.str_list("weightDecayExclude", NO_DECAY_GROUPS)
    if f.data.get("weightDecayExclude") is None:
        exclude = ("norms", "biases")
    out["decay_norms"] = "norms" not in exclude
    out["decay_biases"] = "biases" not in exclude
    out["decay_embeddings"] = "embeddings" not in exclude
    v = f.sub("validation")
    out["validation_interval"] = v.int_("intervalSteps", 0, minimum=0)
    out["validation_batches"] = v.int_("batches", 1)
    v.reject_unknown()
    return out


def _parse_placement(f: _Fields) -> PlacementSpec:
    p = PlacementSpec(
        vendors=f.str_list("vendors", VENDORS),
        datacenters=f.str_list("datacenters"),
        pools=f.str_list("pools"),
        node_selector=f.str_map("nodeSelector"),
        max_gpus=f.int_("maxGPUs"),
    )
    f.reject_unknown()
    return p


def _parse_parallelism(f: _Fields) -> ParallelismSpec:
    p = ParallelismSpec(
        tp=f.int_("tp"), pp=f.int_("pp"), dp=f.int_("dp"),
        schedule=f.str_("schedule", "auto", SCHEDULES) or "auto",
        virtual_stages=f.int_("virtualStages"), cp=f.int_("cp"),
        replica_groups=f.bool_("replicaGroups", False),
    )
    f.reject_unknown()
    if p.cp is not None and p.cp & (p.cp - 1):
        raise SpecError(f"{f.path}.cp", f"must be a power of two (got {p.cp}): the runtime "
                        "cuts each sequence into 2·cp chunks; use 1, 2, 4, 8, ... or omit cp "
                        "to let the planner choose")
    if p.schedule == "helix" and p.virtual_stages is not None:
        raise SpecError(f"{f.path}.virtualStages", "the helix schedule holds one layer per "
                        "model chunk (layers / pp chunks per stage): omit virtualStages")
    if p.schedule == "helix" and p.pp == 1:
        raise SpecError(f"{f.path}.pp", "the helix schedule pipelines layers over stages: pin "
                        "pp >= 2 (or omit it), or pick another schedule for one stage")
    if p.schedule == "helix" and p.replica_groups:
        raise SpecError(f"{f.path}.replicaGroups", "the helix schedule runs one pipeline "
                        "shape for every replica: set replicaGroups: false or another schedule")
    if p.schedule == "helix" and ((p.tp or 1) > 1 or (p.cp or 1) > 1):
        raise SpecError(f"{f.path}.schedule", f"helix runs stages without tensor or context "
                        f"parallelism (tp={p.tp}, cp={p.cp}): omit tp/cp or set them to 1, or "
                        "pick another schedule")
    if p.virtual_stages is not None and not chunked_schedule(p.schedule):
        raise SpecError(f"{f.path}.virtualStages", "only the interleaved schedules have model "
                        "chunks: set schedule: interleaved or interleaved-zb, or omit "
                        "virtualStages")
    if p.virtual_stages is not None and p.virtual_stages > 64:
        raise SpecError(f"{f.path}.virtualStages", f"must be <= 64 model chunks per stage (got "
                        f"{p.virtual_stages})")
    if p.virtual_stages is not None and p.virtual_stages < 2:
        raise SpecError(f"{f.path}.virtualStages", f"must be >= 2 model chunks per stage (got "
                        f"{p.virtual_stages}); for one chunk use schedule: 1f1b")
    if p.tp is not None and p.tp & (p.tp - 1):
        raise SpecError(f"{f.path}.tp", f"must be a power of two (got {p.tp})")
    return p


def _parse_cross_dc(f: _Fields) -> CrossDCSpec:
    c = CrossDCSpec(
        mode=f.str_("mode", "sync", CROSS_DC_SPEC_MODES) or "sync",
        compression=f.str_("compression", "bf16", COMPRESSIONS) or "bf16",
        outer_steps=f.int_("outerSteps", 50) or 50,
        outer_lr=f.float_("outerLearningRate", 0.7),
        outer_momentum=f.float_("outerMomentum", 0.9),
    )
    f.reject_unknown()
    if c.mode == "compress" and c.compression == "none":
        raise SpecError(f"{f.path}.compression", "none compresses nothing: use mode sync, or "
                        "compression bf16|int8 with mode compress")
    if not 0.0 <= c.outer_momentum < 1.0:
        raise SpecError(f"{f.path}.outerMomentum", f"must be in [0, 1) (got {c.outer_momentum})")
    return c


CHECKPOINT_SCHEMES = ("", "file", "s3")


def _parse_checkpoint(f: _Fields) -> CheckpointSpec:
    c = CheckpointSpec(
        uri=f.str_("uri"), pvc=f.str_("pvc"), interval_steps=f.int_("intervalSteps", 100) or 100,
        keep=f.int_("keep", 3) or 3, async_save=f.bool_("async", True),
        secret_ref=f.str_("secretRef"), endpoint=f.str_("endpoint"),
    )
    f.reject_unknown()
    if c.uri and c.pvc:
        raise SpecError(f"{f.path}.pvc", "set either uri or pvc, not both")
    _check_checkpoint_storage(c, f.path)
    return c


def _check_checkpoint_storage(c: CheckpointSpec, path: str) -> None:
    """URI scheme, credentials only by Secret, S3-only fields only with s3:// (field errors)."""
    scheme, sep, rest = (c.uri or "").partition("://")
    scheme = scheme.lower() if sep else ""
    if c.uri and scheme not in CHECKPOINT_SCHEMES:
        raise SpecError(f"{path}.uri", f"scheme {short_repr(scheme)} unsupported (got "
                        f"{short_repr(c.uri)}); use s3://bucket/prefix, file:///path, or pvc: NAME "
                        "for a volume")
    if scheme == "s3" and not rest.split("/", 1)[0]:
        raise SpecError(f"{path}.uri", f"no bucket in {short_repr(c.uri)}; use s3://bucket/prefix")
    if "@" in rest.split("/", 1)[0]:
        raise SpecError(f"{path}.uri", "credentials in the URI are refused; put them in a "
                        "Secret and name it in spec.checkpoint.secretRef")
    if scheme != "s3":
        for key, value in (("secretRef", c.secret_ref), ("endpoint", c.endpoint)):
            if value:
                raise SpecError(f"{path}.{key}", "applies to an s3:// uri only; set "
                                "spec.checkpoint.uri to s3://bucket/prefix or remove it")
    if c.keep > 1000:
        raise SpecError(f"{path}.keep", f"must be <= 1000 (got {c.keep}); retention keeps the "
                        "newest K checkpoints")
    if c.endpoint and not c.endpoint.startswith(("http://", "https://")):
        raise SpecError(f"{path}.endpoint",
                        f"must be an http(s):// URL (got {short_repr(c.endpoint)})")


def _parse_failure_policy(f: _Fields) -> FailurePolicy:
    p = FailurePolicy(
        max_repairs=f.int_("maxRepairs", 10, minimum=0) or 0,
        min_gpus=f.int_("minGPUs", 1) or 1,
        mode=f.str_("mode", "Shrink", REPAIR_MODES) or "Shrink",
        wait_seconds=f.int_("waitSeconds", 300, minimum=0) or 0,
        debounce_seconds=f.float_("debounceSeconds", 5.0),
    )
    f.reject_unknown()
    return p


def _parse_calibration(f: _Fields) -> CalibrationSpec:
    cal = CalibrationSpec(
        enabled=f.bool_("enabled", False),
        replan_threshold=f.float_("replanThreshold", 0.10),
        max_replans=f.int_("maxReplans", 3, minimum=0) or 0,
        min_steps=f.int_("minSteps", 3) or 3,
        profile=f.bool_("profile", False),
    )
    f.reject_unknown()
    if cal.replan_threshold >= 1.0:
        raise SpecError(f"{f.path}.replanThreshold", f"must be below 1 (got "
                        f"{cal.replan_threshold}); it is the fraction of step time a new plan "
                        "must save, e.g. 0.1")
    return cal


def _parse_data(f: _Fields, present: bool) -> DataSpec:
    d = DataSpec(uri=f.str_("uri"), pvc=f.str_("pvc"), path=f.str_("path", "") or "",
                 synthetic=f.bool_("synthetic", False))
    f.reject_unknown()
    if not present:
        return d
    if d.synthetic and (d.uri or d.pvc):
        raise SpecError(f"{f.path}.synthetic", "true trains on generated tokens: remove uri/pvc, "
                        "or set synthetic: false to read the token set")
    if d.uri and d.pvc:
        raise SpecError(f"{f.path}.uri", "set either uri or pvc (with path inside the claim), "
                        "not both")
    if d.path and not d.pvc:
        raise SpecError(f"{f.path}.path", "is a directory inside spec.data.pvc; set pvc, or "
                        "give the full location as uri")
    if not (d.synthetic or d.uri or d.pvc):
        raise SpecError(f.path, "names no data: set uri (a token set from 'hettrain data "
                        "prepare': a path or s3://...), pvc + path, or synthetic: true")
    for key, value, limit in (("uri", d.uri, 2048), ("path", d.path, 1024), ("pvc", d.pvc, 253)):
        if value and len(value) > limit:
            raise SpecError(f"{f.path}.{key}", f"must be at most {limit} characters (got "
                            f"{len(value)})")
    if d.uri and "://" not in d.uri and not d.uri.startswith("/"):
        raise SpecError(f"{f.path}.uri", f"must be an absolute path or a URI such as "
                        f"s3://bucket/dir (got {short_repr(d.uri)})")
    if d.path.startswith("/") or ".." in d.path.split("/"):
        raise SpecError(f"{f.path}.path", f"must be relative inside the claim, without .. "
                        f"(got {short_repr(d.path)})")
    return d


DATA_REQUIRED = ("is required: name the training tokens with uri (a token set from 'hettrain "
                 "data prepare': a path or s3://...), pvc + path, or synthetic: true for "
                 "generated tokens (tests, demos)")


def require_data(spec: JobSpec) -> None:
    """A job that trains must name its data: generated tokens only when ``spec.data.synthetic``
    says so. The operator and ``hettrain validate`` / ``plan`` call this after parsing (the CRD
    requires ``spec.data`` too); the runtime refuses a plan without ``data``
    (``planning.support``). Pure planning (the simulator's built-in scenarios, the benchmarks)
    does not need data."""
    d = spec.data
    if not (d.synthetic or d.uri or d.pvc):
        raise SpecError("spec.data", DATA_REQUIRED)


_IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")


def _check_image(image: str) -> None:
    """spec.image must look like an image reference (no blanks, no control characters):
    a job with ``image: ' '`` would otherwise stay Launching forever."""
    if len(image) > 1024 or not _IMAGE_RE.fullmatch(image):
        raise SpecError("spec.image", f"must be a container image reference such as "
                        f"ghcr.io/hettrain/runtime:0.1.0 (got {image[:80]!r})")


def parse_job_spec(spec: Mapping[str, Any] | None) -> JobSpec:
    """Parse a HetTrainingJob ``spec`` (camelCase dict) into a :class:`JobSpec`.

    Raises :class:`SpecError` with the field path (``spec.model.layers``) and the fix.
    """
    f = _Fields(spec, "spec")
    model = _parse_model(f.sub("model"))
    training = _parse_training(f.sub("training"))
    placement = _parse_placement(f.sub("placement"))
    parallelism = _parse_parallelism(f.sub("parallelism"))
    cross_dc = _parse_cross_dc(f.sub("crossDC"))
    checkpoint = _parse_checkpoint(f.sub("checkpoint"))
    failure = _parse_failure_policy(f.sub("failurePolicy"))
    data = _parse_data(f.sub("data"), f.data.get("data") is not None)
    default_image = JobSpec.__dataclass_fields__["image"].default  # slots: no class attr
    image = f.str_("image", default_image) or default_image
    _check_image(image)
    command = f.str_list("command")
    args = f.str_list("args")
    suspend = f.bool_("suspend", False)
    priority = f.str_("priorityClassName")
    scheduler = f.str_("schedulerName")
    calibration = _parse_calibration(f.sub("calibration"))
    f.reject_unknown()
    if training.micro_batch is None and parallelism.dp and training.global_batch % parallelism.dp:
        raise SpecError(
            "spec.parallelism.dp",
            f"globalBatch ({training.global_batch}) must be divisible by dp ({parallelism.dp})",
        )
    if cross_dc.mode == "diloco" and training.optimizer_sharding:
        raise SpecError(
            "spec.training.sharding" if "sharding" in (f.data.get("training") or {})
            else "spec.training.optimizerSharding",
            f"sharding {training.sharding} (ZeRO) cannot combine with crossDC.mode diloco "
            "(the replicas of each datacenter drift apart between outer steps); set "
            "spec.training.sharding: none (or optimizerSharding: false)",
        )
    for why in sharding_conflicts(training.sharding, model, parallelism):
        raise SpecError("spec.training.sharding", why)
    if parallelism.pp is not None and parallelism.pp > model.layers:
        raise SpecError(
            "spec.parallelism.pp",
            f"pp ({parallelism.pp}) exceeds the model's layers ({model.layers})",
        )
    if parallelism.cp is not None and model.seq_len % (2 * parallelism.cp):
        raise SpecError(
            "spec.parallelism.cp",
            f"seqLen ({model.seq_len}) must be a multiple of 2·cp ({2 * parallelism.cp}): "
            "context parallelism gives each rank two equal chunks of every sequence; lower cp "
            "or omit it to let the planner choose",
        )
    if model.tie_embeddings and parallelism.pp is not None and parallelism.pp > 1:
        raise SpecError(
            "spec.parallelism.pp",
            f"pp ({parallelism.pp}) > 1 with spec.model.tieEmbeddings: the runtime trains tied "
            "embeddings only in one pipeline stage; set pp: 1 or tieEmbeddings: false",
        )
    return JobSpec(
        model=model, training=training, placement=placement, parallelism=parallelism,
        cross_dc=cross_dc, checkpoint=checkpoint, failure_policy=failure, data=data, image=image,
        command=command, args=args, suspend=suspend, priority_class_name=priority,
        scheduler_name=scheduler, calibration=calibration,
    )


def recompute_options(recompute: str, attention: str) -> tuple[str, ...]:
    """The concrete recompute modes a spec's ``recompute`` lets the planner use: itself, or
    for ``auto`` every mode the ``attention`` kernel allows, least recomputed first (eager
    attention produces no log-sum-exp for ``attention-free`` to keep)."""
    if recompute != "auto":
        return (recompute,)
    return tuple(m for m in RECOMPUTE_MODES if not (attention == "eager"
                                                   and m == "attention-free"))


def sharding_options(sharding: str, model: ModelSpec, parallelism: ParallelismSpec,
                     ) -> tuple[str, ...]:
    """The concrete shardings a spec's ``sharding`` lets the planner use: itself, or for
    ``auto`` those of optimizer | gradients | full the rules allow (:func:`sharding_conflicts`;
    least sharded first)."""
    if sharding != "auto":
        return (sharding,)
    return tuple(s for s in ("optimizer", "gradients", "full")
                 if not sharding_conflicts(s, model, parallelism))


def sharding_conflicts(sharding: str, model: ModelSpec, parallelism: ParallelismSpec,
                       ) -> list[str]:
    """Why the runtime cannot run ``sharding`` (gradients/full) with these spec options
    (empty: it can). ``auto`` conflicts with nothing: it skips the options these forbid.
    The plan-side twin is ``planning.support.unsupported``; DiLoCo is checked by the
    caller (every sharding but none conflicts with it)."""
    if sharding not in ("gradients", "full"):
        return []
    out = []
    if splits_backward(parallelism.schedule):
        out.append(f"sharding: {sharding} cannot combine with spec.parallelism.schedule: "
                   f"{parallelism.schedule} "
                   "(its deferred weight gradients would need every unit's sharded gradient "
                   "sync twice); set sharding: optimizer or another schedule")
    if parallelism.schedule == "helix":
        out.append(f"sharding: {sharding} cannot combine with spec.parallelism.schedule: helix "
                   "(its layer parts run outside the layer's forward, where ZeRO-2/3 hook each "
                   "unit); set sharding: optimizer or another schedule")
    if parallelism.replica_groups:
        out.append(f"sharding: {sharding} cannot combine with spec.parallelism.replicaGroups "
                   "(the groups sum whole gradients after the step's backward); set sharding: "
                   "optimizer or replicaGroups: false")
    if sharding == "full" and model.tie_embeddings:
        out.append("sharding: full cannot combine with spec.model.tieEmbeddings: true (the "
                   "embedding and the output layer share one parameter that FSDP would shard "
                   "in two units); set sharding: gradients or tieEmbeddings: false")
    return out


def parse_job_manifest(doc: Mapping[str, Any]) -> tuple[str, JobSpec]:
    """Parse a whole HetTrainingJob manifest (as in ``examples/jobs/*.yaml``) → (name, spec)."""
    from hettrain.api.constants import API_VERSION, KIND

    if not isinstance(doc, Mapping):
        raise SpecError("(document)", f"must be a mapping with kind: {KIND} "
                                      f"(got {type(doc).__name__})")
    if doc.get("kind") != KIND:
        raise SpecError("kind", f"must be {KIND} (got {short_repr(doc.get('kind'))})")
    if doc.get("apiVersion") != API_VERSION:
        raise SpecError("apiVersion",
                        f"must be {API_VERSION} (got {short_repr(doc.get('apiVersion'))})")
    metadata = doc.get("metadata")
    if not isinstance(metadata, Mapping):
        raise SpecError("metadata", f"must be a mapping with a name (got {short_repr(metadata)})")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", f"must be a non-empty string (got {short_repr(name)})")
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise SpecError("metadata.name", f"must be a Kubernetes object name, at most 253 "
                        f"lowercase letters, digits, '-' and '.', starting and ending with a "
                        f"letter or digit (got {short_repr(name)}), e.g. llama3-8b")
    return name, parse_job_spec(doc.get("spec"))


# what the API server accepts as a custom resource's name (DNS-1123 subdomain)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
