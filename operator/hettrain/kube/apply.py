"""Apply a reconcile Decision to the API server: deletes, then a gang create (all or none).

Every call is a raw JSON request (no client model encoding/validation): the objects are the
plain dicts the pure builders return, and resourceVersions stay opaque strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from hettrain.api import constants as c
from hettrain.manifests.ownership import controller_job, owned_by

#: Concurrent API requests when creating/deleting a gang (``HETTRAIN_CREATE_PARALLELISM``).
PARALLELISM = max(1, int(os.environ.get("HETTRAIN_CREATE_PARALLELISM", "16")))
REQUEST_TIMEOUT_S = 30.0
_MERGE_PATCH = "application/merge-patch+json"
_PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps",
            "NetworkPolicy": "networkpolicies"}
_GROUP_PATHS = {"NetworkPolicy": "/apis/networking.k8s.io/v1"}
_pool = ThreadPoolExecutor(max_workers=PARALLELISM, thread_name_prefix="hettrain-kube")


class GangCreateError(RuntimeError):
    """Some pods of a gang could not be created; the ones created were deleted again."""


class ForeignObjectError(RuntimeError):
    """An object with a child's name exists but the job does not own it: never adopted,
    merged into or deleted. ``kind`` is the child's kind."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


def load_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An API client from in-cluster config, else ``kubeconfig``/$KUBECONFIG."""
    try:
        k8s_config.load_incluster_config()
        cfg = k8s.Configuration.get_default_copy()
    except k8s_config.ConfigException:
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = max(32, PARALLELISM)
    return k8s.ApiClient(cfg)


def raw_request(api: k8s.ApiClient, method: str, path: str, body: Any = None,
                content_type: str = "application/json",
                timeout: float | tuple[float, float] = REQUEST_TIMEOUT_S
                ) -> tuple[int, str, bytes]:
    """One request with either generation of the kubernetes client (37+: ``param_serialize``;
    36: the older ``call_api``); returns (status, reason, raw body), never raising on a
    non-2xx status."""
    headers = {"Content-Type": content_type, "Accept": "application/json"}
    if hasattr(api, "param_serialize"):
        params = api.param_serialize(method=method, resource_path=path, header_params=headers,
                                     body=body, auth_settings=["BearerToken"])
        resp = api.call_api(*params, _request_timeout=timeout)
        return resp.status, str(resp.reason), resp.read()
    try:
        resp = api.call_api(path, method, header_params=headers, body=body,
                            auth_settings=["BearerToken"], _preload_content=False,
                            _return_http_data_only=True, _request_timeout=timeout)
    except ApiException as err:
        data = err.body if isinstance(err.body, bytes) else str(err.body or "").encode()
        return int(err.status or 0), str(err.reason), data
    return resp.status, str(resp.reason), resp.data


def request(api: k8s.ApiClient, method: str, path: str, body: Any = None,
            content_type: str = "application/json", ok: Sequence[int] = ()
            ) -> tuple[int, dict[str, Any]]:
    """One JSON request; returns (status, body). Raises ApiException unless 2xx or in ``ok``."""
    status, reason, data = raw_request(api, method, path, body, content_type)
    if not (200 <= status < 300 or status in ok):
        raise ApiException(status=status, reason=reason, body=data)
    return status, (json.loads(data) if data else {})


def _collection(ns: str, kind: str) -> str:
    if kind not in _PLURALS:
        raise ValueError(f"kind {kind!r} is not a child kind; expected one of {list(_PLURALS)}")
    return f"{_GROUP_PATHS.get(kind, '/api/v1')}/namespaces/{quote(ns)}/{_PLURALS[kind]}"


def job_path(ns: str, name: str) -> str:
    """API path of one HetTrainingJob."""
    return f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{quote(ns)}/{c.PLURAL}/{quote(name)}"


def create(api: k8s.ApiClient, ns: str, obj: dict[str, Any], replace: bool = False) -> bool:
    """Create one object; True if created. Already there (409): False if the job (the
    object's own controller ownerReference, by uid) owns it, or with ``replace`` its
    ``data``/labels are overwritten by a merge patch (ConfigMaps of a not-yet-launched
    attempt). A leftover of an earlier job of the same name (other uid) is replaced. Any
    other existing object the job does not own raises :class:`ForeignObjectError`."""
    path = _collection(ns, obj["kind"])
    status, _ = request(api, "POST", path, obj, ok=(409,))
    if status != 409:
        return True
    name = obj["metadata"]["name"]
    owner = controller_job(obj)
    got, existing = request(api, "GET", f"{path}/{quote(name)}", ok=(404,))
    if got == 404:  # deleted meanwhile: the next pass creates it
        return False
    if owner is not None and _leftover_of_namesake(existing, owner):
        # a child of an earlier job of the same name (deleted and created again; the garbage
        # collector has not removed it yet): not a foreign object, so remove it now (uid
        # precondition) and create ours instead of failing the launch with ForeignObject
        request(api, "DELETE", f"{path}/{quote(name)}",
                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                 "propagationPolicy": "Background",
                 "preconditions": {"uid": existing["metadata"]["uid"]}}, ok=(404, 409))
        status, _ = request(api, "POST", path, obj, ok=(409,))
        if status == 409:
            raise RuntimeError(f"{obj['kind']} {ns}/{name}: the leftover of an earlier job "
                               f"{owner[0]} is still being deleted; retrying")
        return True
    if owner is None or not owned_by(existing, owner[1]):
        raise ForeignObjectError(
            f"{obj['kind']} {ns}/{name} exists but is not owned by job {owner and owner[0]}; "
            "delete or rename it (the operator never adopts objects it does not own)",
            kind=str(obj["kind"]))
    if replace:
        patch = {"metadata": {"labels": obj["metadata"].get("labels") or {},
                              "resourceVersion": existing["metadata"]["resourceVersion"]},
                 "data": obj.get("data") or {}}
        request(api, "PATCH", f"{path}/{quote(name)}", patch, _MERGE_PATCH)
    return False


def _leftover_of_namesake(existing: dict[str, Any], owner: tuple[str, str]) -> bool:
    """Whether ``existing`` is controlled by a HetTrainingJob of the same name as ``owner``
    but another uid: an earlier, deleted job of that name (two live jobs never share a
    namespace and name), whose children the garbage collector removes anyway."""
    prev = controller_job(existing)
    return prev is not None and prev[0] == owner[0] and prev[1] != owner[1]


def delete(api: k8s.ApiClient, ns: str, kind: str, name: str, owner_uid: str | None = None
           ) -> bool:
    """Delete one object at once (grace 0, children in background); False if already gone.

    With ``owner_uid`` the object is read first and deleted only if that job controls it,
    with a uid precondition (a foreign object of the same name is left alone: False)."""
    path = f"{_collection(ns, kind)}/{quote(name)}"
    body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1",
                            "gracePeriodSeconds": 0, "propagationPolicy": "Background"}
    if owner_uid is not None:
        got, existing = request(api, "GET", path, ok=(404,))
        if got == 404 or not owned_by(existing, owner_uid):
            return False
        body["preconditions"] = {"uid": existing["metadata"]["uid"]}
    status, _ = request(api, "DELETE", path, body, ok=(404, 409))
    return status not in (404, 409)


def delete_all(api: k8s.ApiClient, ns: str, items: Iterable[tuple[str, str]],
               owner_uid: str | None = None) -> None:
    """Delete objects in parallel; already gone is fine. Pods (observed as the job's own)
    go directly; other kinds only if ``owner_uid`` controls them (when given)."""
    list(_pool.map(lambda kn: delete(api, ns, kn[0], kn[1],
                                     None if kn[0] == "Pod" else owner_uid),
                   list(dict.fromkeys(items))))


def run_all(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run independent API calls in parallel; results in order, the first error re-raised
    after all have finished."""
    futures = [_pool.submit(fn) for fn in calls]
    results, first_error = [], None
    for fut in futures:
        try:
            results.append(fut.result())
        except Exception as err:
            first_error = first_error or err
            results.append(None)
    if first_error is not None:
        raise first_error
    return results


def create_gang(api: k8s.ApiClient, ns: str, pods: Sequence[dict[str, Any]]) -> int:
    """Create all pods in parallel; on any failure delete the pods created by this call and
    raise :class:`GangCreateError`. Returns the number of pods newly created (409 = exists)."""

    def one(pod: dict[str, Any]) -> tuple[str, bool | Exception]:
        try:
            return pod["metadata"]["name"], create(api, ns, pod)
        except Exception as err:
            return pod["metadata"]["name"], err

    results = list(_pool.map(one, pods))
    errors = [(n, r) for n, r in results if isinstance(r, Exception)]
    if errors:
        created = [("Pod", n) for n, r in results if r is True]
        delete_all(api, ns, created)
        name, err = errors[0]
        detail = getattr(err, "body", None) or err
        raise GangCreateError(f"pod {name}: {detail}; rolled back {len(created)} pods")
    return sum(1 for _, r in results if r is True)


def list_nodes(api: k8s.ApiClient) -> list[dict[str, Any]]:
    """All Nodes as plain dicts (one LIST)."""
    _, body = request(api, "GET", "/api/v1/nodes")
    return list(body.get("items") or [])


def get_job(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    """The HetTrainingJob as the API has it now, or None when it is gone."""
    status, body = request(api, "GET", job_path(ns, name), ok=(404,))
    return None if status == 404 else body


def patch_status(api: k8s.ApiClient, ns: str, name: str, status: dict[str, Any]
                 ) -> dict[str, Any]:
    """Merge-patch the job's status subresource (None values delete keys); the new object."""
    _, body = request(api, "PATCH", job_path(ns, name) + "/status", {"status": status},
                      _MERGE_PATCH)
    return body


def read_plan_json(api: k8s.ApiClient, ns: str, configmap: str, owner_uid: str | None = None
                   ) -> str | None:
    """plan.json of a plan ConfigMap, or None when it is gone (or, with ``owner_uid``, not
    that job's own)."""
    status, cm = request(api, "GET", f"{_collection(ns, 'ConfigMap')}/{quote(configmap)}",
                         ok=(404,))
    if status == 404 or (owner_uid is not None and not owned_by(cm, owner_uid)):
        return None
    return (cm.get("data") or {}).get(c.PLAN_CONFIGMAP_KEY)


def dumps(obj: Any) -> str:
    """Compact JSON for log lines."""
    return json.dumps(obj, separators=(",", ":"), default=str)
