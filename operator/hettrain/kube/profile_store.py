"""Read and write the namespace's profile store ConfigMap (``manifests/profiles.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote

from kubernetes import client as k8s

from hettrain.kube.apply import request
from hettrain.manifests.profiles import PROFILE_STORE, build_profile_store

_MERGE_PATCH = "application/merge-patch+json"


def _path(ns: str) -> str:
    return f"/api/v1/namespaces/{quote(ns)}/configmaps"


def read_profiles(api: k8s.ApiClient, ns: str) -> dict[str, str]:
    """{key: profile YAML} of the namespace's store (empty when there is none)."""
    status, cm = request(api, "GET", f"{_path(ns)}/{PROFILE_STORE}", ok=(404,))
    if status == 404:
        return {}
    return {str(k): str(v) for k, v in (cm.get("data") or {}).items()}


def store_profiles(api: k8s.ApiClient, ns: str, entries: Mapping[str, str]) -> None:
    """Add or replace ``entries`` in the store (created on first use; other keys kept)."""
    if not entries:
        return
    status, _ = request(api, "POST", _path(ns), build_profile_store(ns, entries), ok=(409,))
    if status == 409:
        request(api, "PATCH", f"{_path(ns)}/{PROFILE_STORE}", {"data": dict(entries)},
                _MERGE_PATCH)
