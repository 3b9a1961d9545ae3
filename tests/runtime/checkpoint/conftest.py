"""A real local S3 server for the checkpoint tests: moto's server mode on a free port, with
IAM authentication ON (wrong credentials are refused like on AWS) and one bucket."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

ADMIN_POLICY = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """``{endpoint, bucket, env}``: ``env`` holds valid credentials for the bucket (as the
    operator injects them from the Secret: AWS_* variables)."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    from hettrain.runtime.launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boot = {"endpoint_url": endpoint, "region_name": "us-east-1",
            "aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
    iam = boto3.client("iam", **boot)
    iam.create_user(UserName="trainer")
    arn = iam.create_policy(PolicyName="all", PolicyDocument=ADMIN_POLICY)["Policy"]["Arn"]
    iam.attach_user_policy(UserName="trainer", PolicyArn=arn)
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    boto3.client("s3", **boot).create_bucket(Bucket="ckpt")
    # from now on every request must be signed with a known access key
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                 headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()
    env = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY":
           key["SecretAccessKey"], "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION":
           "us-east-1"}
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
