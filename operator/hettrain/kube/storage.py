"""Is ``spec.checkpoint``'s PVC there? (Looked up before a launch.)

The operator never reads Secrets: a missing ``spec.checkpoint.secretRef`` shows up as the
pods' ``CreateContainerConfigError`` (``hettrain.reconcile.secret_error``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s

from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.kube.apply import request


def checkpoint_storage_problem(api: k8s.ApiClient, ns: str,
                               spec: Mapping[str, Any] | None) -> str | None:
    """A one-line reason naming ``spec.checkpoint.pvc`` when that PVC does not exist; None
    when fine or not checkable (an invalid spec is reported by reconcile; a 403 means this
    operator may not look)."""
    try:
        ck = parse_job_spec(spec).checkpoint
    except SpecError:
        return None
    if not ck.pvc:
        return None
    status, _ = request(api, "GET", f"/api/v1/namespaces/{quote(ns)}/persistentvolumeclaims/"
                        f"{quote(ck.pvc)}", ok=(403, 404))
    if status == 404:
        return (f"spec.checkpoint.pvc: PersistentVolumeClaim {ck.pvc!r} not found in "
                f"namespace {ns!r}; create it or fix the name")
    return None
