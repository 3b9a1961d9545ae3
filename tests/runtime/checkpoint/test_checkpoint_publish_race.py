"""Checkpoint publishing never reads a rank manifest that exists but is still empty or partial.

The race (seen once in CI on a loaded host): a rank wrote ``rank-RRRRR.json`` with a plain
write, which creates the file empty and fills it afterwards, while rank 0 polled for the file's
existence and parsed it at once (``json.loads(b"")``). These tests expose each write in steps,
deterministically (a filesystem that pauses inside the write, a manifest created empty first),
instead of hoping a thread is slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime import checkpoint_store
from hettrain.runtime.checkpoint_format import ShardedTensor

SHAPE = (4, 3)


def _rank_state(rank: int, full: torch.Tensor) -> list[ShardedTensor]:
    """Rank ``rank`` of two owns rows ``[2 * rank, 2 * rank + 2)`` of ``w``."""
    return [ShardedTensor.box("w", full[2 * rank:2 * rank + 2].clone(), SHAPE, (2 * rank, 0))]


def _loaded(store: ckpt.CheckpointStore, step: int) -> torch.Tensor:
    target = torch.zeros(SHAPE)
    assert ckpt.load(store, step, [ShardedTensor.whole("w", target)]) == {"w"}
    return target


class SteppedFS(LocalFileSystem):
    """A local filesystem whose ``pipe_file`` exposes the write in steps: the file is created
    (empty), then half written, then complete; ``observe`` runs after each of the first two,
    as another rank reading the directory at that moment would."""

    cachable = False

    def __init__(self, observe, **kwargs) -> None:
        super().__init__(**kwargs)
        self.observe = observe

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        with self.open(path, "wb") as f:
            f.flush()
            self.observe(path)
            f.write(value[:len(value) // 2])
            f.flush()
            self.observe(path)
            f.write(value[len(value) // 2:])


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _visible_objects_are_whole(root: Path) -> int:
    """Every manifest / marker a reader can see under ``root`` is complete; how many."""
    seen = 0
    for p in root.rglob("*"):
        if not p.is_file() or p.name.endswith(checkpoint_store.PARTIAL):
            continue
        if p.suffix == ".json":
            assert _parses(p.read_bytes()), f"{p.name} is visible but empty or partial"
            seen += 1
        elif p.name in (checkpoint_store.COMMITTED, checkpoint_store.LATEST):
            assert p.read_bytes(), f"{p} is visible but empty"
            seen += 1
    return seen


def test_a_manifest_being_written_is_never_visible_half_written(tmp_path):
    full = torch.arange(12, dtype=torch.float32).reshape(SHAPE)
    root = tmp_path / "ckpt"
    observed: list[int] = []
    store = ckpt.CheckpointStore.open(str(root))
    store.fs = SteppedFS(lambda _path: observed.append(_visible_objects_are_whole(root)))
    for rank in (1, 0):  # rank 0 last: it merges and publishes
        ckpt.Checkpointer(store, rank, 2, async_save=False).save(3, _rank_state(rank, full), {})
    # every small object (2 rank manifests, manifest.json, COMMITTED, latest) was observed
    # twice mid-write, and later ones saw the earlier ones whole
    assert len(observed) == 2 * 5 and max(observed) >= 4, observed
    assert store.committed_steps() == [3]
    assert torch.equal(_loaded(store, 3), full)
    assert not [p for p in root.rglob("*") if p.name.endswith(checkpoint_store.PARTIAL)]


def test_the_publisher_waits_for_a_manifest_created_empty_first(tmp_path, monkeypatch):
    """A writer without atomic rename (or a filesystem without it): the publisher sees the
    manifest empty, waits, and publishes once it is complete."""
    full = torch.arange(12, dtype=torch.float32).reshape(SHAPE)
    store = ckpt.CheckpointStore.open(str(tmp_path / "ckpt"))
    ckpt.Checkpointer(store, 1, 2, async_save=False).save(3, _rank_state(1, full), {})
    manifest = Path(store.staging(3)) / "rank-00001.json"
    text = manifest.read_bytes()
    manifest.write_bytes(b"")  # created, not yet written
    polls: list[bytes] = []

    def finish_the_write(_seconds: float) -> None:  # runs between two polls
        polls.append(manifest.read_bytes())
        manifest.write_bytes(text[:len(polls) * len(text) // 3])

    monkeypatch.setattr(checkpoint_store.time, "sleep", finish_the_write)
    rec = ckpt.Checkpointer(store, 0, 2, async_save=False).save(3, _rank_state(0, full), {})
    assert rec.published
    # it saw the empty file, then a third, then two thirds, then the whole manifest
    assert polls == [b"", text[:len(text) // 3], text[:2 * len(text) // 3]]
    assert store.committed_steps() == [3]
    assert torch.equal(_loaded(store, 3), full)


def test_a_manifest_that_never_completes_leaves_the_step_unpublished(tmp_path, monkeypatch):
    full = torch.arange(12, dtype=torch.float32).reshape(SHAPE)
    store = ckpt.CheckpointStore.open(str(tmp_path / "ckpt"))
    Path(store.staging(3)).mkdir(parents=True)
    (Path(store.staging(3)) / "rank-00001.json").write_bytes(b'{"format": "hettr')
    monkeypatch.setattr(checkpoint_store.time, "sleep", lambda _s: None)
    saver = ckpt.Checkpointer(store, 0, 2, async_save=False, commit_timeout_s=0.0)
    with pytest.raises(ckpt.CheckpointStorageError,
                       match=r"did not finish.*rank-00001\.json, present but incomplete"):
        saver.save(3, _rank_state(0, full), {})
    assert store.committed_steps() == []
