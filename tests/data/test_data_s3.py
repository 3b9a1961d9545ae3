"""A token set in a real (local) S3 server: moto's server mode, reached by s3fs with the
standard AWS environment. The runtime downloads it once, verified, and reads the same tokens."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from hettrain.data.tokenset import TokenSetError
from hettrain.runtime.dataset import open_data

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")
SEQ, VOCAB = 32, 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None, "moto server exited"
            time.sleep(0.2)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def aws_env(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    yield fs
    s3fs.S3FileSystem.clear_instance_cache()


def test_s3_token_set_reads_the_same_batches_as_the_local_one(aws_env, opticks_set, tmp_path):
    fs = aws_env
    fs.mkdir("corpora")
    fs.put(str(opticks_set) + "/", "corpora/opticks/", recursive=True)
    cache = tmp_path / "cache"
    remote = open_data({"uri": "s3://corpora/opticks"}, seed=2, seq_len=SEQ, vocab=VOCAB,
                       cache_dir=cache)
    local = open_data({"uri": str(opticks_set)}, seed=2, seq_len=SEQ, vocab=VOCAB)
    for step in (0, 3):
        a = remote.global_batch(2, step, 8)
        b = local.global_batch(2, step, 8)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(remote.validation_batch(0, 4)[0], local.validation_batch(0, 4)[0])
    with pytest.raises(TokenSetError, match=r"spec.model.vocab: 100 is smaller"):
        open_data({"uri": "s3://corpora/opticks"}, seed=2, seq_len=SEQ, vocab=100,
                  cache_dir=cache)


def test_a_missing_bucket_or_prefix_is_one_clear_error(aws_env, tmp_path):
    for uri in ("s3://no-such-bucket/opticks", "s3://corpora/missing"):
        with pytest.raises(TokenSetError, match=rf"spec.data.uri: {uri}: "):
            open_data({"uri": uri}, seed=2, seq_len=SEQ, vocab=VOCAB, cache_dir=tmp_path)


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, r"invalid JSON \(nested too deeply"),
    (b'{"format":"hettrain-tokens","version":1,"dtype":"uint16","tokenizer":{"vocab_size":'
     + b"9" * 5000 + b"}}", "invalid JSON value"),
])
def test_a_hostile_manifest_in_the_bucket_is_one_clear_error(aws_env, tmp_path, raw, reason):
    """The runtime reads an object store's manifest.json as the CLI reads a local one."""
    fs = aws_env
    fs.makedirs("hostile", exist_ok=True)
    fs.pipe("hostile/set/manifest.json", raw)
    with pytest.raises(TokenSetError, match=rf"s3://hostile/set/manifest.json: {reason}"):
        open_data({"uri": "s3://hostile/set"}, seed=2, seq_len=SEQ, vocab=VOCAB,
                  cache_dir=tmp_path)
