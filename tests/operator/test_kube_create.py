"""kube.apply.create against an in-memory API: a name taken by a leftover of an earlier job
of the same name (deleted and created again, garbage collection pending) is replaced; one
taken by anything else is never touched (ForeignObjectError)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hettrain.api import constants as c
from hettrain.kube import apply as kube


class FakeApi:
    """POST/GET/DELETE on one collection, keyed by name; DELETE honours a uid precondition."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []
        self.uids = 0

    def request(self, _api: Any, method: str, path: str, body: Any = None,
                content_type: str = "application/json", ok: tuple[int, ...] = ()
                ) -> tuple[int, dict[str, Any]]:
        name = path.rsplit("/", 1)[1]
        if method == "POST":
            name = body["metadata"]["name"]
            if name in self.objects:
                return 409, {}
            self.uids += 1
            obj = copy.deepcopy(body)
            obj["metadata"]["uid"] = f"obj-{self.uids}"
            self.objects[name] = obj
            return 201, obj
        if method == "GET":
            return (200, self.objects[name]) if name in self.objects else (404, {})
        if method == "DELETE":
            obj = self.objects.get(name)
            if obj is None:
                return 404, {}
            if body["preconditions"]["uid"] != obj["metadata"]["uid"]:
                return 409, {}
            del self.objects[name]
            self.deleted.append(name)
            return 200, {}
        raise AssertionError(method)


def _child(job: str, job_uid: str | None) -> dict[str, Any]:
    refs = [] if job_uid is None else [{
        "apiVersion": c.API_VERSION, "kind": c.KIND, "name": job, "uid": job_uid,
        "controller": True}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{job}-ranks", "ownerReferences": refs}}


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    monkeypatch.setattr(kube, "request", fake.request)
    return fake


def test_a_leftover_of_an_earlier_job_of_the_same_name_is_replaced(api: FakeApi) -> None:
    assert kube.create(None, "ns", _child("alpha", "uid-old")) is True
    assert kube.create(None, "ns", _child("alpha", "uid-new")) is True
    assert api.deleted == ["alpha-ranks"]
    refs = api.objects["alpha-ranks"]["metadata"]["ownerReferences"]
    assert refs[0]["uid"] == "uid-new"
    assert kube.create(None, "ns", _child("alpha", "uid-new")) is False  # ours: a 409 only


@pytest.mark.parametrize("squatter", [_child("alpha", None), _child("beta", "uid-b")],
                         ids=["no-owner", "another-job"])
def test_anything_else_holding_the_name_is_foreign_and_left_alone(
        api: FakeApi, squatter: dict[str, Any]) -> None:
    squatter["metadata"]["name"] = "alpha-ranks"
    kube.create(None, "ns", squatter)
    with pytest.raises(kube.ForeignObjectError) as err:
        kube.create(None, "ns", _child("alpha", "uid-new"))
    assert err.value.kind == "Service" and api.deleted == []
    assert api.objects["alpha-ranks"]["metadata"]["ownerReferences"] == squatter[
        "metadata"]["ownerReferences"]
