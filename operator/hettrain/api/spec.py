"""HetTrainingJob spec: frozen dataclasses parsed from the CR's camelCase ``spec`` dict.

``parse_job_spec(spec)`` is the single entry point. It never guesses: bad input raises
:class:`SpecError` naming the field path and the fix, e.g.
``spec.training.globalBatch: must be an integer >= 1 (got 0); set it to the global batch in
sequences``. The CRD's structural schema rejects most of these already at the API server; this
parser is the second line for the offline CLI and for rules a schema cannot express.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hettrain.api.constants import VENDORS

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("auto", "1f1b", "interleaved", "zb-h1")
CROSS_DC_MODES = ("sync", "compress", "diloco")
COMPRESSIONS = ("none", "bf16", "int8")
REPAIR_MODES = ("Shrink", "WaitForReplacement")


class SpecError(ValueError):
    """A spec field is invalid: ``field`` is the dotted path, ``message`` says what and the fix."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A GPT-style decoder. ``ffn_hidden`` defaults to 4*hidden, ``kv_heads`` to ``heads``."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int
    kv_heads: int
    name: str = "custom"
    gated_mlp: bool = False  # SwiGLU-style MLP (3 matrices) as in Llama

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Total parameter count (embeddings untied from the output layer)."""
        h, f = self.hidden, self.ffn_hidden
        kv = self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o
        mlp = (3 if self.gated_mlp else 2) * h * f
        norms = 2 * h
        return self.layers * (attn + mlp + norms) + 2 * self.vocab * h + h


# Public architectures; numbers from the model cards / papers.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-tiny": dict(layers=4, hidden=64, heads=4, seq_len=64, vocab=256),
    "gpt-small": dict(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257),
    "gpt3-1.3b": dict(layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50257),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257),
    "llama3-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq_len=8192,
        vocab=128256, gated_mlp=True,
    ),
    "llama3-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, seq_len=8192,
        vocab=128256, gated_mlp=True,
    ),
    "llama3-405b": dict(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, seq_len=8192,
        vocab=128256, gated_mlp=True,
    ),
}


@dataclass(frozen=True, slots=True)
class TrainingSpec:
    """Batch sizes are in sequences. ``micro_batch`` None lets the planner choose."""

    global_batch: int
    steps: int
    micro_batch: int | None = None
    precision: str = "bf16"
    optimizer_sharding: bool = True  # distributed optimizer (ZeRO-1)
    recompute: str = "selective"
    learning_rate: float = 3e-4
    seed: int = 1234


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


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """Repair behaviour after node or pod failures."""

    max_repairs: int = 10
    min_gpus: int = 1
    mode: str = "Shrink"
    wait_seconds: int = 300
    debounce_seconds: float = 5.0


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
    image: str = "ghcr.io/hettrain/runtime:0.1.0"
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    suspend: bool = False
    priority_class_name: str | None = None
    scheduler_name: str | None = None

    def with_training(self, **changes: Any) -> JobSpec:
        """A copy with some training fields changed (used by re-planning and the simulator)."""
        return replace(self, training=replace(self.training, **changes))


# ---------------------------------------------------------------- field readers


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
            raise SpecError(where, f"must be an integer (got {value!r}){'; ' + fix if fix else ''}")
        if value < minimum:
            raise SpecError(
                where, f"must be an integer >= {minimum} (got {value}){'; ' + fix if fix else ''}"
            )
        return value

    def float_(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = self._get(key)
        where = f"{self.path}.{key}"
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(where, f"must be a number (got {value!r})")
        if value < minimum:
            raise SpecError(where, f"must be >= {minimum} (got {value})")
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
            raise SpecError(where, f"must be a non-empty string (got {value!r})")
        if choices and value not in choices:
            raise SpecError(where, f"must be one of {', '.join(choices)} (got {value!r})")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(f"{self.path}.{key}", f"must be true or false (got {value!r})")
        return value

    def str_list(self, key: str, choices: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self._get(key)
        where = f"{self.path}.{key}"
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise SpecError(where, f"must be a list of non-empty strings (got {value!r})")
        for i, v in enumerate(value):
            if choices and v not in choices:
                raise SpecError(f"{where}[{i}]", f"must be one of {', '.join(choices)} (got {v!r})")
        return tuple(value)

    def str_map(self, key: str) -> dict[str, str]:
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise SpecError(f"{self.path}.{key}", "must be a mapping of strings to strings")
        return dict(value)

    def sub(self, key: str) -> _Fields:
        return _Fields(self._get(key), f"{self.path}.{key}")

    def reject_unknown(self) -> None:
        """Unknown keys are typos; say which one and what is allowed."""
        unknown = sorted(set(self.data) - self.used)
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
                f"unknown preset {preset_name!r}; use one of {', '.join(MODEL_PRESETS)} "
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
        ffn_hidden=ffn, kv_heads=kv_heads, name=name, gated_mlp=gated,
    )


def _parse_training(f: _Fields) -> TrainingSpec:
    gb = f.int_("globalBatch", required=True, fix="set the global batch in sequences")
    steps = f.int_("steps", required=True, fix="set the number of optimizer steps")
    mb = f.int_("microBatch")
    precision = f.str_("precision", "bf16", PRECISIONS)
    sharding = f.bool_("optimizerSharding", True)
    recompute = f.str_("recompute", "selective", RECOMPUTE_MODES)
    lr = f.float_("learningRate", 3e-4)
    seed = f.int_("seed", 1234, minimum=0)
    f.reject_unknown()
    assert gb is not None and steps is not None and precision and recompute and seed is not None
    if mb is not None and gb % mb:
        raise SpecError(
            f"{f.path}.microBatch",
            f"globalBatch ({gb}) must be divisible by microBatch ({mb}); "
            "pick a divisor or omit microBatch to let the planner choose",
        )
    return TrainingSpec(
        global_batch=gb, steps=steps, micro_batch=mb, precision=precision,
        optimizer_sharding=sharding, recompute=recompute, learning_rate=lr, seed=seed,
    )


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
    )
    f.reject_unknown()
    if p.tp is not None and p.tp & (p.tp - 1):
        raise SpecError(f"{f.path}.tp", f"must be a power of two (got {p.tp})")
    return p


def _parse_cross_dc(f: _Fields) -> CrossDCSpec:
    c = CrossDCSpec(
        mode=f.str_("mode", "sync", CROSS_DC_MODES) or "sync",
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
        raise SpecError(f"{path}.uri", f"scheme {scheme!r} unsupported (got {c.uri!r}); use "
                        "s3://bucket/prefix, file:///path, or pvc: NAME for a volume")
    if scheme == "s3" and not rest.split("/", 1)[0]:
        raise SpecError(f"{path}.uri", f"no bucket in {c.uri!r}; use s3://bucket/prefix")
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
        raise SpecError(f"{path}.endpoint", f"must be an http(s):// URL (got {c.endpoint!r})")


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
    default_image = JobSpec.__dataclass_fields__["image"].default  # slots: no class attr
    image = f.str_("image", default_image) or default_image
    command = f.str_list("command")
    args = f.str_list("args")
    suspend = f.bool_("suspend", False)
    priority = f.str_("priorityClassName")
    scheduler = f.str_("schedulerName")
    f.reject_unknown()
    if training.micro_batch is None and parallelism.dp and training.global_batch % parallelism.dp:
        raise SpecError(
            "spec.parallelism.dp",
            f"globalBatch ({training.global_batch}) must be divisible by dp ({parallelism.dp})",
        )
    if parallelism.pp is not None and parallelism.pp > model.layers:
        raise SpecError(
            "spec.parallelism.pp",
            f"pp ({parallelism.pp}) exceeds the model's layers ({model.layers})",
        )
    return JobSpec(
        model=model, training=training, placement=placement, parallelism=parallelism,
        cross_dc=cross_dc, checkpoint=checkpoint, failure_policy=failure, image=image,
        command=command, args=args, suspend=suspend, priority_class_name=priority,
        scheduler_name=scheduler,
    )


def parse_job_manifest(doc: Mapping[str, Any]) -> tuple[str, JobSpec]:
    """Parse a whole HetTrainingJob manifest (as in ``examples/jobs/*.yaml``) → (name, spec)."""
    from hettrain.api.constants import API_VERSION, KIND

    if doc.get("kind") != KIND:
        raise SpecError("kind", f"must be {KIND} (got {doc.get('kind')!r})")
    if doc.get("apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"must be {API_VERSION} (got {doc.get('apiVersion')!r})")
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", "is required")
    return name, parse_job_spec(doc.get("spec"))
