"""spec.checkpoint on the operator side: the PVC mount with a per-job subdirectory, S3
credentials only as Secret references, and field-naming errors for bad storage specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.operator.optest_helpers import hetero_nodes, job_body

from hettrain.api import constants as c
from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.manifests.builders import (
    CHECKPOINT_MOUNT_DIR,
    RUNTIME_GID,
    JobRef,
    build_configmap,
    build_pods,
)
from hettrain.planning.inventory import inventory_from_nodes
from hettrain.planning.planner import plan_job


def _pods(checkpoint: dict, name: str = "job1", ns: str = "ns"):
    spec = parse_job_spec({**job_body()["spec"], "checkpoint": checkpoint})
    plan = plan_job(name, spec, inventory_from_nodes(hetero_nodes(2, 2, 8)))
    job = JobRef(name, ns, "u")
    return build_pods(job, spec, plan, 1, False), build_configmap(job, plan, 1)


def _env(pod):
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_pvc_is_mounted_with_a_per_job_subdirectory_writable_by_the_image_user():
    pods, _ = _pods({"pvc": "shared", "keep": 5, "async": False})
    for pod in pods:
        ps = pod["spec"]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared"}} \
            in ps["volumes"]
        ctr = ps["containers"][0]
        assert {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT_DIR} in ctr["volumeMounts"]
        env = _env(pod)
        assert env[c.ENV_CHECKPOINT_URI]["value"] == f"{CHECKPOINT_MOUNT_DIR}/ns/job1"
        assert env["HETTRAIN_CHECKPOINT_KEEP"]["value"] == "5"
        assert env["HETTRAIN_CHECKPOINT_ASYNC"]["value"] == "0"
        assert ps["securityContext"]["fsGroup"] == RUNTIME_GID
    other, _ = _pods({"pvc": "shared"}, name="job2")
    assert _env(other[0])[c.ENV_CHECKPOINT_URI]["value"] == f"{CHECKPOINT_MOUNT_DIR}/ns/job2"


def test_s3_credentials_come_only_from_the_secret():
    pods, cm = _pods({"uri": "s3://bucket/runs/", "secretRef": "s3-creds",
                      "endpoint": "http://minio.storage:9000"})
    for pod in pods:
        env = _env(pod)
        assert env[c.ENV_CHECKPOINT_URI]["value"] == "s3://bucket/runs/ns/job1"
        assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert "value" not in env[key]
            assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "s3-creds", "key": key}}
        assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
        # no volume for an object store (the pod's fsGroup is the hardened runtime user's)
        assert not any(v["name"] == "checkpoints" for v in pod["spec"].get("volumes", []))
    # nothing secret in the plan ConfigMap, and no plain value names a credential key
    assert "s3-creds" not in json.dumps(cm)
    assert all("AWS_SECRET" not in e["name"] or "valueFrom" in e
               for e in pods[0]["spec"]["containers"][0]["env"])


def test_a_plain_path_is_used_as_given():
    pods, _ = _pods({"uri": "/ckpt"})
    assert _env(pods[0])[c.ENV_CHECKPOINT_URI]["value"] == "/ckpt"


@pytest.mark.parametrize("checkpoint,field,words", [
    ({"uri": "gs://b/x"}, "spec.checkpoint.uri", "scheme 'gs' unsupported"),
    ({"uri": "s3://"}, "spec.checkpoint.uri", "no bucket"),
    ({"uri": "s3://key:secret@bucket/x"}, "spec.checkpoint.uri", "credentials in the URI"),
    ({"pvc": "p", "secretRef": "s"}, "spec.checkpoint.secretRef", "s3:// uri only"),
    ({"uri": "/x", "endpoint": "http://e"}, "spec.checkpoint.endpoint", "s3:// uri only"),
    ({"uri": "s3://b/x", "endpoint": "minio:9000"}, "spec.checkpoint.endpoint", "http(s)://"),
    ({"uri": "s3://b/x", "keep": 0}, "spec.checkpoint.keep", ">= 1"),
    ({"uri": "s3://b/x", "keep": 1001}, "spec.checkpoint.keep", "<= 1000"),
    ({"uri": "s3://b/x", "async": "yes"}, "spec.checkpoint.async", "true or false"),
])
def test_bad_checkpoint_specs_name_the_field(checkpoint, field, words):
    with pytest.raises(SpecError) as err:
        parse_job_spec({**job_body()["spec"], "checkpoint": checkpoint})
    assert err.value.field == field and words in err.value.message


def test_shipped_s3_examples_name_a_secret():
    root = Path(__file__).resolve().parents[2]
    found = 0
    for path in sorted((root / "examples/jobs").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            ck = parse_job_spec(doc["spec"]).checkpoint
            if ck.uri and ck.uri.startswith("s3://"):
                found += 1
                assert ck.secret_ref, path.name
            assert ck.pvc or (ck.uri or "").startswith(("s3://", "/tmp/")), \
                f"{path.name}: checkpoints on the container's own disk"
    assert found >= 2
