"""The demo's storage: a local S3 server (moto's server mode, a child process) holding the
checkpoints, the Secret that carries its credentials, and the token set of the shipped corpus.

Credentials travel as for a real job: the demo creates an access key on the server, puts it in
a Secret that ``spec.checkpoint.secretRef`` names, and the ranks get it only as the pods'
``secretKeyRef`` env, resolved the way the kubelet does (:func:`resolve_pod_env`). The key is
never printed, written to a file of the work dir, or put in a command line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from hettrain.api import constants as c
from hettrain.demo.cluster import DemoError, free_port, http_get, wait_for

BUCKET = "hettrain-demo"
REGION = "us-east-1"
CORPUS = "examples/data/opticks"
TOKENIZER = f"{CORPUS}/tokenizer.json"
# Pod env the local ranks do not take over: launch_local sets the rendezvous and rank layout
# for local processes, the backend follows the CPU fallback, and there is no termination log.
POD_ONLY_ENV = frozenset({
    c.ENV_PLAN_PATH, c.ENV_MASTER_ADDR, c.ENV_MASTER_PORT, c.ENV_WORLD_SIZE,
    c.ENV_NODE_RANK_START, c.ENV_LOCAL_WORLD_SIZE, c.ENV_BACKEND, "HETTRAIN_TERMINATION_LOG"})
_ADMIN_POLICY = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})


@dataclass
class S3Server:
    """moto's S3 server on ``endpoint`` with IAM authentication on and one bucket; ``creds``
    (kept in memory only) is the access key the job's Secret carries."""

    proc: subprocess.Popen
    endpoint: str
    bucket: str = BUCKET
    creds: dict[str, str] = field(default_factory=dict, repr=False)

    def client(self) -> Any:
        """A boto3 S3 client signed with the job's key (the server refuses unsigned calls)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.creds["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.creds["AWS_SECRET_ACCESS_KEY"])

    def committed_steps(self, prefix: str) -> list[int]:
        """Steps of the published checkpoints under ``prefix`` (their COMMITTED markers)."""
        steps = []
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix.strip("/") + "/")
        for page in pages:
            for obj in page.get("Contents") or ():
                parts = obj["Key"].split("/")
                if parts[-1] == "COMMITTED" and parts[-2].startswith("step-"):
                    steps.append(int(parts[-2].removeprefix("step-")))
        return sorted(steps)


def provision_s3(endpoint: str, bucket: str, region: str = REGION) -> dict[str, str]:
    """On a fresh moto server at ``endpoint``: a user with an access key, the bucket, then
    authentication on (only requests signed with that key succeed from then on). Returns the
    key as the AWS_* variables the operator injects from the Secret."""
    import boto3

    boot = {"endpoint_url": endpoint, "region_name": region,
            "aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
    iam = boto3.client("iam", **boot)
    iam.create_user(UserName="trainer")
    arn = iam.create_policy(PolicyName="all", PolicyDocument=_ADMIN_POLICY)["Policy"]["Arn"]
    iam.attach_user_policy(UserName="trainer", PolicyArn=arn)
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    boto3.client("s3", **boot).create_bucket(Bucket=bucket)
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                 headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_DEFAULT_REGION": region}


def start_s3(log: Path, add_child: Callable[[str, subprocess.Popen], Any]) -> S3Server:
    """Start ``python -m moto.server`` (own process group, tracked by ``add_child`` before
    anything can fail), create a user with an access key and the bucket, then turn
    authentication on: from then on only requests signed with that key succeed."""
    try:
        import boto3  # noqa: F401  (provision_s3 needs it; fail early with one line)
        import moto.server  # noqa: F401  (moto[server]: the S3 server)
    except ImportError as exc:
        raise DemoError(f"the demo's S3 server needs moto[server] and boto3 ({exc.name} is "
                        "missing); pip install 'hettrain[test]'") from None
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    add_child("s3 server", proc)

    def alive() -> None:
        if proc.poll() is not None:
            raise DemoError(f"the S3 server exited with {proc.returncode}; log: {log}")

    wait_for(lambda: http_get(f"{endpoint}/moto-api/"), 60, "the S3 server", alive=alive)
    creds = provision_s3(endpoint, BUCKET)
    return S3Server(proc, endpoint, BUCKET, creds)


def create_secret(api: k8s.ApiClient, ns: str, name: str, creds: Mapping[str, str]) -> None:
    """The Secret ``spec.checkpoint.secretRef`` names (replaced if it exists)."""
    core = k8s.CoreV1Api(api)
    body = k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=name), type="Opaque",
                        string_data=dict(creds))
    try:
        core.create_namespaced_secret(ns, body)
    except k8s.ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_secret(name, ns, body)


def resolve_pod_env(api: k8s.ApiClient, ns: str, pod: Any) -> dict[str, str]:
    """The trainer container's env as the kubelet would give it: plain values, and
    ``secretKeyRef`` values read from their Secret (an optional missing key is left out)."""
    core = k8s.CoreV1Api(api)
    secrets: dict[str, dict[str, str]] = {}
    out: dict[str, str] = {}
    for var in pod.spec.containers[0].env or ():
        ref = var.value_from.secret_key_ref if var.value_from else None
        if ref is None:
            out[var.name] = var.value or ""
            continue
        if ref.name not in secrets:
            data = core.read_namespaced_secret(ref.name, ns).data or {}
            secrets[ref.name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
        if ref.key in secrets[ref.name]:
            out[var.name] = secrets[ref.name][ref.key]
        elif not ref.optional:
            raise DemoError(f"pod {pod.metadata.name}: Secret {ns}/{ref.name} has no key "
                            f"{ref.key}")
    return out


def rank_env(pod_env: Mapping[str, str]) -> dict[str, str]:
    """The part of a pod's env that the local rank processes take over."""
    return {k: v for k, v in pod_env.items() if k not in POD_ONLY_ENV}


def corpus_key(repo: Path) -> str:
    """A digest of the corpus and tokenizer files (the cache key of the prepared set)."""
    h = hashlib.sha256()
    for p in sorted((repo / CORPUS).iterdir()):
        if p.is_file() and p.suffix in (".txt", ".json"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def prepared_corpus(repo: Path, cache: Path, log: Callable[[str], None]) -> Path:
    """The shipped corpus as a token set (``hettrain data prepare``), prepared once into
    ``cache`` and reused while the corpus and tokenizer are unchanged."""
    from hettrain.data import tokenset
    from hettrain.data.prepare import PrepareError, PrepareOptions, prepare

    out = cache / f"opticks-{corpus_key(repo)}"
    cmd = (f"hettrain data prepare {CORPUS} --tokenizer {TOKENIZER} --text-unit paragraph "
           f"--out {out}")
    if (out / tokenset.MANIFEST).is_file():
        log(f"token set (cached): {out}")
        return out
    cache.mkdir(parents=True, exist_ok=True)
    log(cmd)
    try:
        prepare(PrepareOptions(inputs=(str(repo / CORPUS),), out=str(out),
                               tokenizer=str(repo / TOKENIZER), text_unit="paragraph"), log=log)
    except (PrepareError, OSError) as exc:
        raise DemoError(f"{cmd}: {exc}") from None
    return out
