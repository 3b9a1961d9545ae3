"""Checkpoints on a real S3 server (moto server mode, IAM auth on): a multi-process run saves
to s3:// and resumes on a different layout matching the single-process reference; a killed
save stays invisible; retention; wrong credentials / missing bucket / unreachable endpoint
give one clear error naming the field, from the library and from the runtime process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import s3fs
import torch
from tests.runtime.training.plans import tiny_plan

from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.checkpoint_format import ShardedTensor
from hettrain.runtime.launch import SOURCE_ROOT, free_port, launch_local, wait_all
from hettrain.runtime.trainer import reference_losses

META = {"model": {"layers": 1}}


def _uri(s3, prefix=""):
    return f"s3://{s3['bucket']}/{prefix or uuid.uuid4().hex}"


def _fs(s3):
    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3["endpoint"]},
                             use_listings_cache=False, skip_instance_cache=True)


def test_publish_is_atomic_and_retention_keeps_k_on_s3(s3):
    store = ckpt.CheckpointStore.open(_uri(s3))
    x = torch.arange(12.0).reshape(3, 4)
    for step in (1, 2, 3):
        r1 = ckpt.Checkpointer(store, 1, 2, keep=2, async_save=False)
        r0 = ckpt.Checkpointer(store, 0, 2, keep=2, async_save=True)
        r1.save(step, [ShardedTensor.box("x", x[2:] * step, (3, 4), (2, 0))], META)
        r0.save(step, [ShardedTensor.box("x", x[:2] * step, (3, 4), (0, 0))], META)
        r0.wait()
    assert store.committed_steps() == [2, 3]
    # a save killed after rank 1 wrote its shard: no marker, so readers do not see it
    ckpt.Checkpointer(store, 1, 2, async_save=False).save(
        4, [ShardedTensor.box("x", x[2:], (3, 4), (2, 0))], META)
    fs = _fs(s3)
    assert fs.exists(f"{store.final(4)}/rank-00001.safetensors")
    assert store.latest_step() == 3
    out = torch.zeros(3, 4)
    ckpt.load(store, store.latest_step(), [ShardedTensor.whole("x", out)])
    assert torch.equal(out, x * 3)
    ckpt.Checkpointer(store, 0, 2).prepare()  # the next run removes the incomplete one
    assert not fs.exists(store.final(4))
    assert store.committed_steps() == [2, 3]


def test_wrong_credentials_name_the_secret_and_leak_nothing(s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-123")
    store = ckpt.CheckpointStore.open(_uri(s3))
    with pytest.raises(ckpt.CheckpointStorageError) as err:
        store.probe()
    text = str(err.value)
    assert "spec.checkpoint.secretRef" in text and "spec.checkpoint.uri" in text
    assert "not-the-secret-123" not in text and "\n" not in text


def test_missing_bucket_and_unreachable_endpoint_name_the_uri(s3, monkeypatch):
    with pytest.raises(ckpt.CheckpointStorageError, match=r"spec.checkpoint.uri .*"
                                                          r"s3://no-such-bucket/x"):
        ckpt.CheckpointStore.open("s3://no-such-bucket/x").probe()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ckpt.CheckpointStorageError, match="endpoint is reachable"):
        ckpt.CheckpointStore.open(_uri(s3)).probe()


def test_the_runtime_exits_2_with_one_line_and_a_termination_message(s3, tmp_path):
    plan = tiny_plan([(0, 4, "pool-a")], dp=1, steps=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    term = tmp_path / "termination-log"
    env = {**os.environ, **s3["env"], "AWS_SECRET_ACCESS_KEY": "wrong-secret-xyz",
           "HETTRAIN_PLAN_PATH": str(tmp_path / "plan.json"), "WORLD_SIZE": "1",
           "MASTER_PORT": str(free_port()), "HETTRAIN_METRICS_PORT": "0",
           "HETTRAIN_CHECKPOINT_URI": _uri(s3), "HETTRAIN_TERMINATION_LOG": str(term),
           "PYTHONPATH": os.pathsep.join([SOURCE_ROOT, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "hettrain.runtime"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "spec.checkpoint.secretRef" in errors[0], res.stderr[-3000:]
    assert "wrong-secret-xyz" not in res.stderr + res.stdout
    assert term.read_text().startswith("HETTRAIN_CHECKPOINT_ERROR: spec.checkpoint.uri")


def test_a_resume_without_checkpoint_reports_it_and_retention_runs(s3, tmp_path):
    """HETTRAIN_RESUME=1 on an empty prefix: the runtime says so (termination message for the
    operator's Warning event), trains from step 0, and keeps only the newest checkpoint."""
    plan = tiny_plan([(0, 4, "pool-a")], dp=1, steps=3)
    (tmp_path / "plan.json").write_text(plan.to_json())
    term = tmp_path / "termination-log"
    uri = _uri(s3)
    env = {**os.environ, **s3["env"], "HETTRAIN_PLAN_PATH": str(tmp_path / "plan.json"),
           "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "HETTRAIN_METRICS_PORT": "0",
           "HETTRAIN_CHECKPOINT_URI": uri, "HETTRAIN_TERMINATION_LOG": str(term),
           "HETTRAIN_RESUME": "1", "HETTRAIN_CHECKPOINT_INTERVAL": "1",
           "HETTRAIN_CHECKPOINT_KEEP": "1",
           "PYTHONPATH": os.pathsep.join([SOURCE_ROOT, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "hettrain.runtime"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert term.read_text().startswith(f"{ckpt.NO_CHECKPOINT}: resume requested but no "
                                       f"committed checkpoint under {uri}")
    assert ckpt.CheckpointStore.open(uri).committed_steps() == [3]


def _losses(path):
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


def _logs(workdir):
    return "\n".join(p.read_text()[-2000:] for p in sorted(workdir.glob("rank-*.log")))


@pytest.mark.slow
def test_multiprocess_run_saves_to_s3_and_resumes_on_another_layout(s3, tmp_path):
    steps = 4
    first = tiny_plan([(0, 3, "pool-a"), (3, 4, "pool-b")], dp=2, steps=steps)
    uri = _uri(s3)
    env = {**s3["env"], "HETTRAIN_CHECKPOINT_URI": uri, "HETTRAIN_CHECKPOINT_INTERVAL": "2",
           "HETTRAIN_METRICS_PORT": "0", "HETTRAIN_LOSS_LOG": str(tmp_path / "first.jsonl")}
    codes = wait_all(launch_local(first, tmp_path / "run1", env), 240)
    assert codes == [0] * 4, _logs(tmp_path / "run1")
    ref = reference_losses(first, steps)
    got = _losses(tmp_path / "first.jsonl")
    for step in range(steps):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    store = ckpt.CheckpointStore.open(uri)
    assert store.committed_steps() == [2, 4]
    files = sorted(p.rsplit("/", 1)[-1] for p in _fs(s3).ls(store.final(2)))
    # every rank wrote its manifest and tensors: the model from DP replica 0 of each stage,
    # the ZeRO-1 optimizer state from every replica (its own half, nothing gathered)
    assert files == ["COMMITTED", "manifest.json"] + [
        f"rank-{r:05d}.{ext}" for r in range(4) for ext in ("json", "safetensors")]
    # as if the job had died after step 2: resume on one stage with TP 2 and one replica
    _fs(s3).rm(store.final(4), recursive=True)
    second = tiny_plan([(0, 4, "pool-b")], dp=1, steps=steps, tp=2, num_microbatches=8)
    env.update({"HETTRAIN_RESUME": "1", "HETTRAIN_LOSS_LOG": str(tmp_path / "second.jsonl")})
    codes = wait_all(launch_local(second, tmp_path / "run2", env), 240)
    assert codes == [0, 0], _logs(tmp_path / "run2")
    after = _losses(tmp_path / "second.jsonl")
    assert sorted(after) == [2, 3]
    for step in (2, 3):
        assert after[step] == pytest.approx(ref[step], rel=1e-4), step
    assert "resumed from checkpoint step 2" in (tmp_path / "run2" / "rank-0.log").read_text()
    assert store.committed_steps() == [2, 4]


def test_listing_a_prefix_emptied_meanwhile_finds_no_checkpoint(s3, monkeypatch):
    """Rank 0 lists at start-up while the other ranks write and remove their probe objects:
    the prefix can exist for ``exists()`` and be gone for ``ls()`` (s3fs raises
    FileNotFoundError); that is an empty store, not a storage error."""
    store = ckpt.CheckpointStore.open(_uri(s3))
    other = _fs(s3)
    probe = store.path(".probe-other-rank")
    other.pipe_file(probe, b"ok")
    real_exists = store.fs.exists

    def exists_then_removed(path, **kw):
        found = real_exists(path, **kw)
        other.rm_file(probe)  # the other rank removes its probe right after
        store.fs.invalidate_cache()
        return found

    monkeypatch.setattr(store.fs, "exists", exists_then_removed)
    assert store.committed_steps() == []
    assert store.clean_incomplete() == []
