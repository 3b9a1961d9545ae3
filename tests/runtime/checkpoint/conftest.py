"""A real local S3 server for the checkpoint tests: moto's server mode on a free port, with
IAM authentication ON (wrong credentials are refused like on AWS) and one bucket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """``{endpoint, bucket, env}``: ``env`` holds valid credentials for the bucket (as the
    operator injects them from the Secret: AWS_* variables)."""
    pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    from hettrain.demo.storage import provision_s3
    from hettrain.runtime.launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**provision_s3(endpoint, "ckpt", "us-east-1"), "AWS_ENDPOINT_URL": endpoint}
    try:
        yield {"endpoint": endpoint, "bucket": "ckpt", "env": env}
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch) -> dict[str, str]:
    """The server with its credentials in this process's environment."""
    for k, v in s3_server["env"].items():
        monkeypatch.setenv(k, v)
    return s3_server
