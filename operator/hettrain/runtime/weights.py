"""Hugging Face safetensors weights in and out of the runtime's Llama (``spec.model.pretrained``).

Import (:func:`load_pretrained`): a single ``*.safetensors`` file, or a directory holding
``model.safetensors`` or a sharded ``model.safetensors.index.json`` (``weight_map``: tensor name
→ shard file), as ``transformers``' ``save_pretrained`` writes them. Each rank reads only the
tensors its stage holds, and of a TP-sharded tensor only its own rows/columns
(``safe_open(...).get_slice``), so no rank ever materialises the whole model. The names are
the model's own (Hugging Face's, see :mod:`hettrain.runtime.model`); a missing tensor or a
shape that disagrees with ``plan.model`` is an error naming ``spec.model.pretrained``.

Export (:func:`save_safetensors`, :func:`checkpoint_state`): the runtime's DCP checkpoints
store FULL tensors under the same names, so a checkpoint step directory becomes a Hugging Face
``model.safetensors`` (model tensors only; optimizer and DiLoCo state are dropped) that
``LlamaForCausalLM.from_pretrained`` reads; :func:`stage_state` assembles the same from
in-process stage models. Import followed by export gives back byte-identical tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from hettrain.runtime.tensor_parallel import TPShards

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FIELD = "spec.model.pretrained"
MODEL_PREFIXES = ("model.", "lm_head.")


def weight_files(path: str | Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` of a single file or a (sharded) HF directory."""
    from safetensors import safe_open  # runtime extra; imported only when weights are used

    p = Path(path)
    if p.is_file():
        with safe_open(str(p), framework="pt") as f:
            return {k: p for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    if (p / INDEX_FILE).is_file():
        index = json.loads((p / INDEX_FILE).read_text())
        return {k: p / v for k, v in index["weight_map"].items()}
    if (p / SINGLE_FILE).is_file():
        return weight_files(p / SINGLE_FILE)
    raise ValueError(f"{FIELD}={str(path)!r}: no safetensors file, {SINGLE_FILE} or "
                     f"{INDEX_FILE} there; point it at a Hugging Face model directory or file")


def _contiguous(idx: torch.Tensor) -> slice:
    a, b = int(idx[0]), int(idx[-1]) + 1
    if b - a != len(idx) or not torch.equal(idx, torch.arange(a, b)):
        raise ValueError("TP shard indices must be one contiguous range")
    return slice(a, b)


def load_pretrained(model: nn.Module, path: str | Path, tp: TPShards | None = None) -> int:
    """Copy every parameter this (possibly TP-sharded) stage holds from the HF weights at
    ``path``, reading only this rank's slice of sharded tensors. Returns the elements read.

    Tied embeddings: a stage's ``lm_head.weight`` without its own tensor in the file is read
    from ``model.embed_tokens.weight`` (HF omits the tied copy).
    """
    from safetensors import safe_open

    files = weight_files(path)
    by_file: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        src = name
        if src not in files and name == "lm_head.weight":
            src = "model.embed_tokens.weight"
        if src not in files:
            raise ValueError(f"{FIELD}={str(path)!r} lacks tensor {name!r}: the weights are "
                             "for another model; check spec.model (layers, names)")
        by_file.setdefault(files[src], []).append((name, src, p))
    read = 0
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name, src, p in items:
                    sl = f.get_slice(src)
                    full = tuple(sl.get_shape())
                    if tp is not None and name in tp.shards:
                        dim, idx = tp.shards[name]
                        want = tp.full_shape(name, p)
                        rng = _contiguous(idx[tp.index])
                        t = sl[rng] if dim == 0 else sl[:, rng]
                    else:
                        want, t = tuple(p.shape), None
                    if full != tuple(want):
                        raise ValueError(f"{FIELD}={str(path)!r}: tensor {src!r} has shape "
                                         f"{list(full)}, the planned model needs {list(want)}; "
                                         "spec.model must match the pretrained config")
                    if t is None:
                        t = sl[:]
                    p.copy_(t)
                    read += t.numel()
    return read


def stage_state(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Full model tensors by HF name from in-process (unsharded) stage models; a tied model
    held whole keeps one ``model.embed_tokens.weight`` (HF omits ``lm_head.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for st in stages:
        for name, p in st.named_parameters():
            out.setdefault(name, p.detach())
    return out


def checkpoint_state(step_dir: str | Path) -> dict[str, torch.Tensor]:
    """Model tensors (full, by HF name) of one runtime DCP checkpoint step directory."""
    reader = dcp.FileSystemReader(str(step_dir))
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(MODEL_PREFIXES) and hasattr(m, "size")}
    if not state:
        raise ValueError(f"checkpoint {step_dir} holds no model tensors")
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def save_safetensors(state: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write ``state`` as a Hugging Face ``model.safetensors`` (a file path, or a directory
    that gets ``model.safetensors``)."""
    from safetensors.torch import save_file

    p = Path(out)
    if p.suffix != ".safetensors":
        p.mkdir(parents=True, exist_ok=True)
        p = p / SINGLE_FILE
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(p), metadata={"format": "pt"})
    return p
