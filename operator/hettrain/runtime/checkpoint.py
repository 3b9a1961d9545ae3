"""Resharding, asynchronous, atomically published checkpoints on any fsspec storage.

State is a list of named global tensors (``checkpoint_format.ShardedTensor``):
model tensors (``layers.7.attn.q.weight``), AdamW state (``optim.<param>.exp_avg`` /
``exp_avg_sq`` / ``step``), DiLoCo's outer state (``outer.<param>.momentum``) and the RNG
(``rng.torch``). Each rank presents its own pieces -- a TP shard as the index runs it owns, a
replicated tensor whole -- and writes only what it owns: data-parallel replica 0 writes, and
of a replicated tensor only TP index 0 (so every element is stored exactly once). An optimizer
whose state is sharded over DP (ZeRO-1) presents views of its own slice of the flat buffers,
placed as boxes in the unsharded global tensors (``StageOptimizer.checkpoint_state``), and
every replica writes its part: ``1/dp`` of the optimizer state per rank. Nothing is gathered.

Saving (:class:`Checkpointer`): the training thread only copies the pieces to host memory
(the stall); a background thread writes this rank's safetensors file and manifest, and on
rank 0 waits for every rank's manifest, merges them, publishes (commit marker last) and
applies retention. The next save, and :meth:`Checkpointer.wait` at exit, wait for it.

Loading (:func:`load`): validate the manifest against the job (format, model shape, every
global shape), then fill this rank's pieces from the overlapping stored pieces (any layout).
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hettrain.runtime.checkpoint_format import (
    DTYPES,
    FORMAT,
    CheckpointFormatError,
    Piece,
    SafetensorsFile,
    ShardedTensor,
    fill_piece,
    merge_manifests,
    piece_entries,
    write_safetensors,
)
from hettrain.runtime.checkpoint_store import (
    MANIFEST,
    CheckpointStorageError,
    CheckpointStore,
    redact,
)
from hettrain.runtime.tensor_parallel import TPShards

log = logging.getLogger("hettrain.runtime.checkpoint")
DEFAULT_INTERVAL = 100
DEFAULT_KEEP = 3
COMMIT_TIMEOUT_S = 600.0
RNG = "rng.torch"
NO_CHECKPOINT = "HETTRAIN_NO_CHECKPOINT"  # the line a resume without a checkpoint reports
MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "gated_mlp")

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_KEEP",
    "CheckpointFormatError",
    "CheckpointStorageError",
    "CheckpointStore",
    "Checkpointer",
    "job_state",
    "load",
    "meta_for",
    "model_meta",
    "report_no_checkpoint",
    "restore_rng",
    "write_termination_message",
]


def _flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer,
                *, materialise: bool) -> dict[str, torch.Tensor]:
    """Model tensors + AdamW state keyed by global parameter names."""
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


def job_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None, *,
              extra: Mapping[str, torch.Tensor] | None = None, tp: TPShards | None = None,
              dp_index: int = 0, for_save: bool = True, params: bool = True,
              sharded: Sequence[ShardedTensor] = ()) -> list[ShardedTensor]:
    """This rank's state as sharded tensors.

    ``for_save``: only what this rank writes (DP replica 0; replicated tensors from TP index
    0) plus the RNG on rank (dp 0, tp 0); otherwise every local tensor, as load targets, with
    AdamW state created (zeros) so that it can be filled in place.

    ``opt=None`` leaves the optimizer state out; an optimizer that shards its state over DP
    (ZeRO-1) passes it as ``sharded`` instead -- e.g. ``ShardedTensor.flat(
    f"optim.{name}.exp_avg", local_range, param_global_shape, flat_start)`` -- which every
    replica writes (and loads into) as given, so it reshards onto any DP degree.
    ``params=False`` leaves the parameters out too (ZeRO-3: the optimizer's pieces carry them).
    """
    adam = isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
    flat = dict(model.state_dict()) if opt is None else \
        _flat_state(model, opt, materialise=adam and not for_save)
    if not params:
        for name, _ in model.named_parameters():
            flat.pop(name, None)
    flat.update(extra or {})
    tp_index = tp.index if tp is not None else 0
    out = []
    for key, t in flat.items():
        name = tp.param_of(key) if tp is not None and tp.shards else None
        if name is not None:
            dim, idx = tp.shards[name]
            if not for_save or dp_index == 0:
                out.append(ShardedTensor.from_index(key, t, dim, idx[tp.index],
                                                    sum(len(i) for i in idx)))
        elif not for_save or (dp_index == 0 and tp_index == 0):
            out.append(ShardedTensor.whole(key, t))
    if not for_save or (dp_index == 0 and tp_index == 0 and _owns_rng(model)):
        out.append(ShardedTensor.whole(RNG, torch.get_rng_state()))
    return out + list(sharded)


def restore_rng(targets: list[ShardedTensor], loaded: set[str]) -> bool:
    """Set the torch RNG from a loaded ``rng.torch`` target; True when it was loaded."""
    for st in targets:
        if st.name == RNG and RNG in loaded:
            torch.set_rng_state(st.pieces[0].tensor)
            return True
    return False


def _owns_rng(model: torch.nn.Module) -> bool:
    """The first pipeline stage (the one with the embedding) writes the RNG state."""
    return any(n.startswith("embed") for n, _ in model.named_parameters())


def model_meta(spec: Any) -> dict[str, Any]:
    """The model-shape fields a checkpoint is validated against."""
    d = asdict(spec) if hasattr(spec, "__dataclass_fields__") else dict(spec)
    return {k: d.get(k) for k in MODEL_FIELDS}


def _snapshot(state: list[ShardedTensor], *, copy: bool = True,
              buffers: dict[tuple[str, int], torch.Tensor] | None = None
              ) -> list[ShardedTensor]:
    """Host copies of every piece (the only part of an async save the training thread waits
    for); ``copy=False`` (a synchronous save) copies only what is not on the host already.
    ``buffers`` keeps the host tensors between saves (reused when shape and dtype match: no
    fresh allocation, and no page faults, per save)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of memory-bound copies: an OpenMP team per copy only
    try:                      # adds fork/join overhead (seconds on a busy host)
        return _copy_pieces(state, copy, buffers)
    finally:
        torch.set_num_threads(threads)


def _copy_pieces(state: list[ShardedTensor], copy: bool,
                 buffers: dict[tuple[str, int], torch.Tensor] | None) -> list[ShardedTensor]:
    out = []
    for st in state:
        pieces = []
        for i, p in enumerate(st.pieces):
            host = p.tensor.detach()
            if copy or host.device.type != "cpu":
                key = (st.name, i)
                buf = buffers.get(key) if buffers is not None else None
                if buf is None or buf.shape != host.shape or buf.dtype != host.dtype:
                    buf = torch.empty(host.shape, dtype=host.dtype, device="cpu",
                                      pin_memory=host.device.type == "cuda")
                    if buffers is not None:
                        buffers[key] = buf
                buf.copy_(host, non_blocking=host.device.type == "cuda")
                host = buf
            pieces.append(Piece(host, offsets=p.offsets, flat_start=p.flat_start))
        out.append(ShardedTensor(st.name, st.global_shape, pieces))
    if torch.cuda.is_available() and any(p.tensor.is_cuda for st in state for p in st.pieces):
        torch.cuda.synchronize()  # the non-blocking device->host copies have landed
    return out


@dataclass
class SaveRecord:
    """What one save cost on this rank."""

    step: int
    stall_s: float
    write_s: float = 0.0
    bytes: int = 0
    published: bool = False


@dataclass
class Checkpointer:
    """Per-rank saver: snapshot on the training thread, write (and on rank 0 publish) on a
    background thread (``async_save``) or inline."""

    store: CheckpointStore
    rank: int
    world_size: int
    keep: int = DEFAULT_KEEP
    async_save: bool = True
    commit_timeout_s: float = COMMIT_TIMEOUT_S
    history: list[SaveRecord] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None
    _buffers: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def prepare(self) -> None:
        """At start, before any save: probe the storage (every rank); rank 0 also removes
        incomplete checkpoints left by a killed run. The caller then barriers."""
        self.store.probe()
        if self.rank == 0:
            for p in self.store.clean_incomplete():
                log.info("removed incomplete checkpoint %s", p.rsplit("/", 1)[-1])

    def save(self, step: int, state: list[ShardedTensor], meta: dict[str, Any]) -> SaveRecord:
        """Snapshot ``state`` and write it (in the background when ``async_save``)."""
        self.wait()
        t0 = time.perf_counter()
        snap = _snapshot(state, copy=self.async_save, buffers=self._buffers)
        rec = SaveRecord(step=step, stall_s=time.perf_counter() - t0)
        self.history.append(rec)
        if not self.async_save:
            self._write(step, snap, meta, rec)
            rec.stall_s = time.perf_counter() - t0
            return rec
        self._thread = threading.Thread(target=self._run, args=(step, snap, meta, rec),
                                        name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        return rec

    def wait(self) -> None:
        """Block until the pending save is written (published on rank 0); re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _run(self, step: int, snap: list[ShardedTensor], meta: dict, rec: SaveRecord) -> None:
        try:
            self._write(step, snap, meta, rec)
        except BaseException as e:
            self._error = e

    def _write(self, step: int, snap: list[ShardedTensor], meta: dict, rec: SaveRecord) -> None:
        t0 = time.perf_counter()
        store, staging = self.store, self.store.staging(step)
        fname = f"rank-{self.rank:05d}.safetensors"
        tensors: dict[str, Any] = {}
        blobs: list[tuple[str, torch.Tensor]] = []
        for st in _by_name(snap):
            entries = piece_entries(st, "")
            tensors[st.name] = {"global_shape": list(st.global_shape),
                                "dtype": _dtype_name(st), "pieces": [r for _, _, r in entries]}
            blobs.extend((k, p.tensor) for k, p, _ in entries)
        try:
            if store.local:
                store.fs.makedirs(staging, exist_ok=True)
            if blobs:
                with store.fs.open(f"{staging}/{fname}", "wb") as f:
                    rec.bytes = write_safetensors(f, blobs, {"format": FORMAT})
        except Exception as e:
            raise store.error(f"write {fname} of step {step}", e) from None
        manifest = {"format": FORMAT, "rank": self.rank, "world_size": self.world_size,
                    "step": step, "file": fname if blobs else None, "tensors": tensors}
        store.write_bytes(f"{staging}/rank-{self.rank:05d}.json", json.dumps(manifest).encode())
        if self.rank == 0:
            self._publish(step, meta)
            rec.published = True
        rec.write_s = time.perf_counter() - t0

    def _publish(self, step: int, meta: dict) -> None:
        store, staging = self.store, self.store.staging(step)
        paths = [f"{staging}/rank-{r:05d}.json" for r in range(self.world_size)]
        ranks = store.wait_for_json(paths, self.commit_timeout_s, f"checkpoint step {step}")
        for p, m in zip(paths, ranks, strict=True):
            if m.get("step") != step or m.get("world_size") != self.world_size:
                raise CheckpointFormatError(f"{p}: written by another run (step "
                                            f"{m.get('step')}, world {m.get('world_size')})")
        merged = merge_manifests(ranks, {**meta, "step": step, "world_size": self.world_size})
        final = store.publish(step, json.dumps(merged).encode())
        # retention after the wait: every writing rank has written this step's manifest, so it
        # has finished loading (a resume) the older checkpoint that retention may now delete
        dropped = store.retain(self.keep)
        log.info("checkpoint step %d published at %s%s", step, final.rsplit("/", 1)[-1],
                 f" (retention removed steps {dropped})" if dropped else "")


def _by_name(state: list[ShardedTensor]) -> list[ShardedTensor]:
    """One entry per global name (pieces of repeated names concatenated, shapes checked)."""
    out: dict[str, ShardedTensor] = {}
    for st in state:
        cur = out.get(st.name)
        if cur is None:
            out[st.name] = ShardedTensor(st.name, st.global_shape, list(st.pieces))
        elif cur.global_shape != st.global_shape:
            raise CheckpointFormatError(f"tensor {st.name}: two global shapes on one rank "
                                        f"({cur.global_shape} and {st.global_shape})")
        else:
            cur.pieces.extend(st.pieces)
    return list(out.values())


def _dtype_name(st: ShardedTensor) -> str:
    return DTYPES[st.pieces[0].tensor.dtype] if st.pieces else "F32"


def read_manifest(store: CheckpointStore, step: int) -> dict[str, Any]:
    """The merged manifest of committed step ``step`` (JSON; validated format)."""
    path = f"{store.final(step)}/{MANIFEST}"
    try:
        m = json.loads(store.fs.cat_file(path))
    except FileNotFoundError:
        raise CheckpointFormatError(f"checkpoint step {step}: {MANIFEST} missing") from None
    except Exception as e:
        raise store.error(f"read {MANIFEST} of step {step}", e) from None
    if m.get("format") != FORMAT:
        raise CheckpointFormatError(f"checkpoint step {step}: format {m.get('format')!r}, "
                                    f"this runtime reads {FORMAT!r}")
    return m


def load(store: CheckpointStore, step: int, targets: list[ShardedTensor], *,
         model: dict[str, Any] | None = None) -> set[str]:
    """Fill ``targets`` (this rank's tensors, any layout) from committed step ``step``.

    Model tensors (names not starting with ``optim.`` / ``outer.`` / ``rng.``) must all be
    present; the others are loaded when the checkpoint has them (it may come from another
    optimizer or cross-DC mode). ``model``: :func:`model_meta` of the job, checked first.
    Returns the names loaded.
    """
    m = read_manifest(store, step)
    where = f"checkpoint step {step} at {store.uri}"
    saved_model = m.get("meta", {}).get("model")
    if model is not None and saved_model is not None:
        diff = {k: (saved_model.get(k), v) for k, v in model.items() if saved_model.get(k) != v}
        if diff:
            k, (old, new) = next(iter(diff.items()))
            raise CheckpointFormatError(
                f"{where} was written for another model (model.{k}={old}, the job has {new}); "
                "point spec.checkpoint.uri elsewhere or restore spec.model")
    files: dict[str, SafetensorsFile] = {}

    def open_file(name: str) -> SafetensorsFile:
        if name not in files:
            path = f"{store.final(step)}/{name}"
            files[name] = SafetensorsFile(
                name, lambda a, b, p=path: store.fs.cat_file(p, start=a, end=b))
        return files[name]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small memory-bound copies (see _snapshot)
    try:
        return _fill(store, m, targets, where, open_file, step)
    finally:
        torch.set_num_threads(threads)


def _fill(store: CheckpointStore, m: dict[str, Any], targets: list[ShardedTensor], where: str,
          open_file: Any, step: int) -> set[str]:
    loaded = set()
    for st in targets:
        entry = m["tensors"].get(st.name)
        if entry is None:
            if not st.name.startswith(("optim.", "outer.", "rng.")):
                raise CheckpointFormatError(f"{where} lacks tensor {st.name}: it was written "
                                            "for another model; point spec.checkpoint.uri "
                                            "elsewhere")
            continue
        if list(entry["global_shape"]) != list(st.global_shape):
            raise CheckpointFormatError(f"{where}: tensor {st.name} has shape "
                                        f"{entry['global_shape']}, the job expects "
                                        f"{list(st.global_shape)}")
        for p in st.pieces:
            try:
                got = fill_piece(p, st.name, entry, open_file)
            except CheckpointFormatError:
                raise
            except Exception as e:
                raise store.error(f"read tensor {st.name} of step {step}", e) from None
            if got != p.tensor.numel():
                raise CheckpointFormatError(f"{where}: tensor {st.name}: stored pieces cover "
                                            f"{got} of the {p.tensor.numel()} elements needed")
        loaded.add(st.name)
    return loaded


def meta_for(plan: Any) -> dict[str, Any]:
    """Checkpoint metadata of a plan: model shape, job, layout, data position base."""
    return {"job": plan.job, "model": model_meta(plan.model),
            "layout": {"dp": plan.dp, "pp": plan.pp, "tp": [s.tp for s in plan.stages]},
            "data": {"seed": plan.training.seed, "global_batch": plan.global_batch}}


def bytes_of(state: list[ShardedTensor]) -> int:
    """Bytes of every piece in ``state``."""
    return sum(p.tensor.numel() * p.tensor.element_size() for st in state for p in st.pieces)


def to_buffer(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """safetensors bytes of ``tensors`` (small helper for tests and tools)."""
    buf = io.BytesIO()
    write_safetensors(buf, tensors)
    return buf.getvalue()


def write_termination_message(path: str, message: str) -> None:
    """Best effort: ``message`` into the kubelet's termination-message file (the operator
    reads it from the pod status); skipped when ``path`` is empty or cannot be written."""
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(message[:4000])
    except OSError:
        pass


def report_no_checkpoint(store: CheckpointStore, termination_log: str) -> str:
    """A resume found no committed checkpoint: log it loudly and leave it in the termination
    message (``HETTRAIN_NO_CHECKPOINT: ...``) for the operator's Warning event."""
    msg = (f"{NO_CHECKPOINT}: resume requested but no committed checkpoint under "
           f"{redact(store.uri)}; training starts from step 0")
    log.warning(msg)
    write_termination_message(termination_log, msg)
    return msg
