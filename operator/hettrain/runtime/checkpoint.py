"""Resharding checkpoints with ``torch.distributed.checkpoint`` (DCP).

State is keyed by GLOBAL names (``layers.7.attn.q.weight`` and
``optim.layers.7.attn.q.weight.exp_avg``), so a checkpoint written by one pipeline layout loads
into any other: every rank just asks for the keys its stage owns. Replicas of a key (DP) are
written once (DCP's default planner de-duplicates).

Tensor parallelism: a TP-sharded tensor is all-gathered in its TP group and stored FULL (so
TP replicas de-duplicate too); loading reads the full tensor and keeps this rank's slice, so a
checkpoint loads into any TP degree. This costs one full copy per sharded tensor while saving
or loading (fine for the sizes this runtime trains; a DTensor-based layout would avoid it).

Atomicity: all ranks write into ``step-N.tmp/``; after DCP has committed its metadata, rank 0
renames it to ``step-N/`` and replaces the ``latest`` pointer file with ``os.replace``. A crash
at any moment leaves ``latest`` naming a complete checkpoint (or none).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hettrain.runtime.tensor_parallel import TPShards

LATEST = "latest"
DEFAULT_INTERVAL = 100


def checkpoint_root(uri: str) -> Path:
    """A local directory from a path or ``file://`` URI."""
    if not uri:
        raise ValueError("HETTRAIN_CHECKPOINT_URI is empty: set a directory or file:// URI")
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    raise ValueError(f"HETTRAIN_CHECKPOINT_URI scheme {parsed.scheme!r} unsupported: "
                     "use a local path or file:// URI")


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer,
           *, materialise: bool) -> dict[str, torch.Tensor]:
    """Flat DCP state: model tensors + AdamW moments keyed by global parameter names."""
    state: dict[str, torch.Tensor] = dict(model.state_dict())
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if not st and materialise:
            st = opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        for k in ("step", "exp_avg", "exp_avg_sq"):
            if st and k in st:
                state[f"optim.{name}.{k}"] = st[k]
    return state


def save(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
         extra: dict[str, torch.Tensor] | None = None, tp: TPShards | None = None) -> Path:
    """Collective: write step ``step`` atomically; returns the final directory.

    ``extra``: more tensors keyed by global names (e.g. DiLoCo's ``outer.<param>.momentum``).
    """
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state = {**_state(model, opt, materialise=False), **(extra or {})}
    if tp is not None and tp.shards:
        state = {k: tp.gather(name, v) if (name := tp.param_of(k)) else v
                 for k, v in state.items()}
    dcp.save(state, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / f"{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
    dist.barrier()
    return final


def latest_step(root: Path) -> int | None:
    """Step of the newest complete checkpoint under ``root``, or None."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not (root / name / ".metadata").exists():
        return None
    return int(name.removeprefix("step-"))


def load(root: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
         extra: dict[str, torch.Tensor] | None = None, tp: TPShards | None = None) -> None:
    """Collective: load step ``step`` into this rank's slice (any layout).

    Model tensors must all be present. Optimizer moments and ``extra`` tensors are loaded in
    place when the checkpoint holds them (it may come from another optimizer or cross-DC
    mode); otherwise they keep their fresh values.
    """
    path = root / f"step-{step}"
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    adam = isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
    state = _state(model, opt, materialise=adam)
    missing = [k for k in state if not k.startswith("optim.") and k not in meta]
    if missing:
        raise ValueError(f"checkpoint {path} lacks model tensors {missing[:3]}: it was written "
                         "for another model; point HETTRAIN_CHECKPOINT_URI elsewhere")
    wanted = {k: v for k, v in {**state, **(extra or {})}.items() if k in meta}
    full: dict[str, torch.Tensor] = {}
    if tp is not None and tp.shards:
        for k, v in wanted.items():
            if name := tp.param_of(k):
                full[k] = torch.empty(tp.full_shape(name, v), dtype=v.dtype)
    dcp.load({**wanted, **full}, checkpoint_id=str(path))
    with torch.no_grad():
        for k, f in full.items():
            wanted[k].copy_(tp.local(tp.param_of(k), f))
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("optim.")})
