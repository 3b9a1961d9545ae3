"""Apply a reconcile Decision to the API server: deletes, then a gang create (all or none)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from hettrain.api import constants as c

_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hettrain-kube")


class GangCreateError(RuntimeError):
    """Some pods of a gang could not be created; the ones created were deleted again."""


def load_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An API client from in-cluster config, else ``kubeconfig``/$KUBECONFIG."""
    try:
        k8s_config.load_incluster_config()
        cfg = k8s.Configuration.get_default_copy()
    except k8s_config.ConfigException:
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = 32
    return k8s.ApiClient(cfg)


def _create(api: k8s.ApiClient, ns: str, obj: dict[str, Any]) -> bool:
    """Create one object; True if created, False if it already existed (409)."""
    core = k8s.CoreV1Api(api)
    fn = {"Pod": core.create_namespaced_pod, "Service": core.create_namespaced_service,
          "ConfigMap": core.create_namespaced_config_map}[obj["kind"]]
    try:
        fn(ns, obj)
        return True
    except ApiException as err:
        if err.status == 409:
            return False
        raise


def _delete(api: k8s.ApiClient, ns: str, kind: str, name: str) -> None:
    core = k8s.CoreV1Api(api)
    fn = {"Pod": core.delete_namespaced_pod, "Service": core.delete_namespaced_service,
          "ConfigMap": core.delete_namespaced_config_map}[kind]
    try:
        fn(name, ns, grace_period_seconds=0, propagation_policy="Background")
    except ApiException as err:
        if err.status != 404:
            raise


def delete_all(api: k8s.ApiClient, ns: str, items: Iterable[tuple[str, str]]) -> None:
    """Delete objects in parallel; already gone is fine."""
    list(_pool.map(lambda kn: _delete(api, ns, kn[0], kn[1]), list(dict.fromkeys(items))))


def create_gang(api: k8s.ApiClient, ns: str, objects: Sequence[dict[str, Any]]) -> int:
    """Create Service/ConfigMap, then all pods in parallel; on any failure delete the pods
    created by this call and raise :class:`GangCreateError`. Returns pods newly created."""
    pods = [o for o in objects if o["kind"] == "Pod"]
    for obj in objects:
        if obj["kind"] != "Pod":
            _create(api, ns, obj)

    def one(pod: dict[str, Any]) -> tuple[str, bool | Exception]:
        try:
            return pod["metadata"]["name"], _create(api, ns, pod)
        except Exception as err:
            return pod["metadata"]["name"], err

    results = list(_pool.map(one, pods))
    errors = [(n, r) for n, r in results if isinstance(r, Exception)]
    if errors:
        created = [("Pod", n) for n, r in results if r is True]
        delete_all(api, ns, created)
        name, err = errors[0]
        raise GangCreateError(f"pod {name}: {err}; rolled back {len(created)} pods")
    return sum(1 for _, r in results if r is True)


def patch_status(api: k8s.ApiClient, ns: str, name: str, status: dict[str, Any]
                 ) -> dict[str, Any]:
    """Merge-patch the job's status subresource (None values delete keys); the new object."""
    return k8s.CustomObjectsApi(api).api_client.call_api(
        f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{ns}/{c.PLURAL}/{name}/status", "PATCH",
        body={"status": status}, header_params={"Content-Type": "application/merge-patch+json"},
        auth_settings=["BearerToken"], response_type="object", _return_http_data_only=True)


def read_plan_json(api: k8s.ApiClient, ns: str, configmap: str) -> str | None:
    """plan.json of a plan ConfigMap, or None when it is gone."""
    try:
        cm = k8s.CoreV1Api(api).read_namespaced_config_map(configmap, ns)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return (cm.data or {}).get(c.PLAN_CONFIGMAP_KEY)


def dumps(obj: Any) -> str:
    """Compact JSON for log lines."""
    return json.dumps(obj, separators=(",", ":"), default=str)
