"""Is ``spec.checkpoint``'s storage there? (PVC and Secret looked up before a launch.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s

from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.kube.apply import request

REQUIRED_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _get(api: k8s.ApiClient, ns: str, plural: str, name: str) -> tuple[int, dict[str, Any]]:
    return request(api, "GET", f"/api/v1/namespaces/{quote(ns)}/{plural}/{quote(name)}",
                   ok=(403, 404))


def checkpoint_storage_problem(api: k8s.ApiClient, ns: str,
                               spec: Mapping[str, Any] | None) -> str | None:
    """A one-line reason naming the field when the PVC or Secret of ``spec.checkpoint`` is
    missing (or the Secret lacks a credential key); None when fine or not checkable (an
    invalid spec is reported by reconcile; a 403 means this operator may not look)."""
    try:
        ck = parse_job_spec(spec).checkpoint
    except SpecError:
        return None
    if ck.pvc:
        status, _ = _get(api, ns, "persistentvolumeclaims", ck.pvc)
        if status == 404:
            return (f"spec.checkpoint.pvc: PersistentVolumeClaim {ck.pvc!r} not found in "
                    f"namespace {ns!r}; create it or fix the name")
    if ck.secret_ref:
        status, secret = _get(api, ns, "secrets", ck.secret_ref)
        if status == 404:
            return (f"spec.checkpoint.secretRef: Secret {ck.secret_ref!r} not found in "
                    f"namespace {ns!r}; create it with keys {', '.join(REQUIRED_SECRET_KEYS)}")
        if status < 300:
            keys = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
            missing = [k for k in REQUIRED_SECRET_KEYS if k not in keys]
            if missing:
                return (f"spec.checkpoint.secretRef: Secret {ck.secret_ref!r} lacks key "
                        f"{missing[0]}; add it (the S3 credentials)")
    return None
