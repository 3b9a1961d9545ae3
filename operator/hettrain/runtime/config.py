"""Runtime settings from the pod env contract (docs/contracts.md §4)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from hettrain.api import constants as C
from hettrain.planning.cost import DP_BUCKET_BYTES
from hettrain.planning.plan import Plan
from hettrain.runtime.checkpoint import DEFAULT_INTERVAL, DEFAULT_KEEP
from hettrain.runtime.devices import ENV_DEVICE, check_choice
from hettrain.runtime.metrics import DEFAULT_PORT

ENV_CHECKPOINT_INTERVAL = "HETTRAIN_CHECKPOINT_INTERVAL"
ENV_CHECKPOINT_KEEP = "HETTRAIN_CHECKPOINT_KEEP"  # committed checkpoints kept (default 3)
ENV_CHECKPOINT_ASYNC = "HETTRAIN_CHECKPOINT_ASYNC"  # 1 (default): write in a background thread
ENV_TERMINATION_LOG = "HETTRAIN_TERMINATION_LOG"  # the kubelet's file (the operator sets it)
ENV_METRICS_PORT = "HETTRAIN_METRICS_PORT"
ENV_LOSS_LOG = "HETTRAIN_LOSS_LOG"  # optional JSON lines {"step", "loss", "seconds"} (rank 0)
ENV_STEP_SLEEP = "HETTRAIN_STEP_SLEEP"  # optional seconds to sleep per step (tests, demos)
ENV_OPTIMIZER = "HETTRAIN_OPTIMIZER"  # inner optimizer: adamw (default) | sgd (exactness checks)
ENV_SUMMARY_DIR = "HETTRAIN_SUMMARY_DIR"  # optional: each rank writes rank-R.json at the end
ENV_RECV_AHEAD = "HETTRAIN_RECV_AHEAD"  # pipeline receives posted ahead per peer (default 1)
ENV_DATA_VERIFY = "HETTRAIN_DATA_VERIFY"  # token set check at start-up: full (sha256) | size
ENV_DATA_CACHE = "HETTRAIN_DATA_CACHE"  # download dir for object-store token sets
# bucket size of the overlapped DP gradient sync in MiB (default 25, planning.cost.DP_BUCKET_BYTES;
# tests and benchmarks: the planner assumes the default)
ENV_DP_BUCKET_MB = "HETTRAIN_DP_BUCKET_MB"
# ZeRO-2/3's overlapped per-unit gradient reduction: auto (default: a reduce-scatter where the DP
# group's backend is NCCL/HCCL, an all-reduce on gloo, whose reduce-scatter measured slower than
# its all-reduce) | reduce_scatter | all_reduce (tests run the reduce-scatter on gloo with it)
ENV_DP_REDUCTION = "HETTRAIN_DP_REDUCTION"
DP_REDUCTIONS = ("auto", "reduce_scatter", "all_reduce")
OPTIMIZERS = ("adamw", "sgd")


def _int(env: dict[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"env {name} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"env {name}={raw!r} must be an integer") from None


def _bucket_bytes(env: dict[str, str]) -> int:
    raw = env.get(ENV_DP_BUCKET_MB, "")
    if raw == "":
        return DP_BUCKET_BYTES
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"env {ENV_DP_BUCKET_MB}={raw!r} must be a number of MiB") from None
    if not (math.isfinite(mib) and mib > 0):
        raise ValueError(f"env {ENV_DP_BUCKET_MB}={raw!r} must be a positive number of MiB "
                         "(default 25)")
    return max(1, int(mib * 2**20))


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything one pod's runtime reads from its environment."""

    plan: Plan
    master_addr: str
    master_port: int
    world_size: int
    rank_start: int
    local_world_size: int
    resume: bool
    checkpoint_uri: str
    checkpoint_interval: int
    metrics_port: int
    loss_log: str
    step_sleep: float
    optimizer: str = "adamw"
    summary_dir: str = ""
    recv_ahead: int = 1
    device: str = "auto"
    data_verify: str = "full"
    data_cache: str = ""
    checkpoint_keep: int = DEFAULT_KEEP
    checkpoint_async: bool = True
    termination_log: str = ""
    dp_bucket_bytes: int = DP_BUCKET_BYTES
    dp_reduction: str = "auto"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RuntimeConfig:
        """Parse and validate; every error names the variable."""
        env = dict(os.environ if env is None else env)
        path = env.get(C.ENV_PLAN_PATH)
        if not path:
            raise ValueError(f"env {C.ENV_PLAN_PATH} is required (path of plan.json)")
        plan = Plan.from_json(Path(path).read_text())
        world = _int(env, C.ENV_WORLD_SIZE, plan.world_size)
        if world != plan.world_size:
            raise ValueError(f"env {C.ENV_WORLD_SIZE}={world} but the plan has "
                             f"{plan.world_size} ranks")
        cfg = cls(
            plan=plan,
            master_addr=env.get(C.ENV_MASTER_ADDR, "127.0.0.1"),
            master_port=_int(env, C.ENV_MASTER_PORT, 29500),
            world_size=world,
            rank_start=_int(env, C.ENV_NODE_RANK_START, _int(env, C.ENV_RANK, 0)),
            local_world_size=_int(env, C.ENV_LOCAL_WORLD_SIZE, 1),
            resume=env.get(C.ENV_RESUME, "0") not in ("", "0", "false", "False"),
            checkpoint_uri=env.get(C.ENV_CHECKPOINT_URI, ""),
            checkpoint_interval=_int(env, ENV_CHECKPOINT_INTERVAL, DEFAULT_INTERVAL),
            metrics_port=_int(env, ENV_METRICS_PORT, DEFAULT_PORT),
            loss_log=env.get(ENV_LOSS_LOG, ""),
            step_sleep=float(env.get(ENV_STEP_SLEEP, "0") or 0),
            optimizer=env.get(ENV_OPTIMIZER, "") or "adamw",
            summary_dir=env.get(ENV_SUMMARY_DIR, ""),
            recv_ahead=_int(env, ENV_RECV_AHEAD, 1),
            device=check_choice(env.get(ENV_DEVICE, "") or "auto"),
            checkpoint_keep=_int(env, ENV_CHECKPOINT_KEEP, DEFAULT_KEEP),
            checkpoint_async=env.get(ENV_CHECKPOINT_ASYNC, "1") not in ("0", "false", "False"),
            termination_log=env.get(ENV_TERMINATION_LOG, ""),
            data_verify=env.get(ENV_DATA_VERIFY, "") or "full",
            data_cache=env.get(ENV_DATA_CACHE, ""),
            dp_bucket_bytes=_bucket_bytes(env),
            dp_reduction=env.get(ENV_DP_REDUCTION, "") or "auto",
        )
        if cfg.dp_reduction not in DP_REDUCTIONS:
            raise ValueError(f"env {ENV_DP_REDUCTION}={cfg.dp_reduction!r}: must be one of "
                             f"{', '.join(DP_REDUCTIONS)}")
        if cfg.checkpoint_keep < 1:
            raise ValueError(f"env {ENV_CHECKPOINT_KEEP}={cfg.checkpoint_keep} must be >= 1 "
                             "(spec.checkpoint.keep)")
        if cfg.data_verify not in ("full", "size"):
            raise ValueError(f"env {ENV_DATA_VERIFY}={cfg.data_verify!r}: must be full or size")
        if cfg.recv_ahead < 0:
            raise ValueError(f"env {ENV_RECV_AHEAD}={cfg.recv_ahead} must be >= 0 "
                             "(0 = receive only when needed)")
        if cfg.optimizer not in OPTIMIZERS:
            raise ValueError(f"env {ENV_OPTIMIZER}={cfg.optimizer!r}: must be one of "
                             f"{OPTIMIZERS}")
        if not 0 <= cfg.rank_start < world:
            raise ValueError(f"env {C.ENV_NODE_RANK_START}={cfg.rank_start} outside [0, {world})")
        if cfg.checkpoint_interval < 1:
            raise ValueError(f"env {ENV_CHECKPOINT_INTERVAL} must be >= 1")
        return cfg
