"""``spec.data``: parsed with field-path errors, carried in the plan, mounted from a PVC, and a
local token set whose tokenizer outgrows the model's vocab is refused by ``hettrain validate``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hettrain.api.spec import DataSpec, SpecError, parse_job_spec
from hettrain.cli import main
from hettrain.manifests.builders import JobRef, build_pods
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "jobs" / "opticks-tiny-local.yaml"
CLUSTER = REPO / "examples" / "clusters" / "local-cpu.yaml"
BASE = {"model": {"preset": "gpt-tiny"}, "training": {"globalBatch": 8, "steps": 2}}


def _spec(data):
    return parse_job_spec({**BASE, "data": data})


@pytest.mark.parametrize("data, want", [
    ({"uri": "s3://bucket/opticks"}, {"uri": "s3://bucket/opticks"}),
    ({"uri": "/mnt/sets/opticks"}, {"uri": "/mnt/sets/opticks"}),
    ({"pvc": "corpora", "path": "opticks/v1"}, {"uri": "/data/opticks/v1", "pvc": "corpora"}),
    ({"pvc": "corpora"}, {"uri": "/data", "pvc": "corpora"}),
    ({"synthetic": True}, {"synthetic": True}),
])
def test_data_forms_and_what_the_plan_carries(data, want):
    assert _spec(data).data.to_plan() == want


def test_no_data_section_means_an_empty_plan_section():
    assert parse_job_spec(BASE).data == DataSpec()
    assert DataSpec().to_plan() == {}


@pytest.mark.parametrize("data, field, words", [
    ({}, "spec.data", "names no data"),
    ({"synthetic": False}, "spec.data", "names no data"),
    ({"synthetic": True, "uri": "/x"}, "spec.data.synthetic", "remove uri/pvc"),
    ({"uri": "/x", "pvc": "p"}, "spec.data.uri", "either uri or pvc"),
    ({"path": "x"}, "spec.data.path", "set pvc"),
    ({"uri": "relative/dir"}, "spec.data.uri", "absolute path or a URI"),
    ({"pvc": "p", "path": "../up"}, "spec.data.path", "relative inside the claim"),
    ({"pvc": "p", "path": "/abs"}, "spec.data.path", "relative inside the claim"),
    ({"uri": ""}, "spec.data.uri", "non-empty string"),
    ({"synthetic": "yes"}, "spec.data.synthetic", "true or false"),
    ({"url": "/x"}, "spec.data.url", "unknown field"),
    ("s3://x", "spec.data", "must be a mapping"),
    ({"uri": "/" + "x" * 2048}, "spec.data.uri", "at most 2048 characters"),
])
def test_bad_data_names_the_field(data, field, words):
    with pytest.raises(SpecError) as err:
        _spec(data)
    assert err.value.field == field and words in err.value.message, str(err.value)


def test_the_plan_carries_data_through_json_and_pods_mount_the_pvc():
    spec = _spec({"pvc": "corpora", "path": "opticks"})
    plan = plan_job("j", spec, load_cluster(str(CLUSTER)))
    assert plan.data == {"uri": "/data/opticks", "pvc": "corpora"}
    assert Plan.from_json(plan.to_json()).data == plan.data
    assert Plan.from_json(replace(plan, data={}).to_json()).data == {}
    pods = build_pods(JobRef("j", "ns", "u"), spec, plan, attempt=1, resume=False)
    for pod in pods:
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["data"]["persistentVolumeClaim"] == {"claimName": "corpora",
                                                         "readOnly": True}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    plain = build_pods(JobRef("j", "ns", "u"), _spec({"uri": "s3://b/o"}), plan, 1, False)
    assert all("data" not in {v["name"] for v in p["spec"]["volumes"]} for p in plain)


def test_validate_refuses_a_local_token_set_larger_than_the_model_vocab(opticks_set, tmp_path,
                                                                       capsys):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["data"] = {"uri": str(opticks_set)}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(job)]) == 0
    assert main(["plan", str(job), "--cluster", str(CLUSTER), "--json"]) == 0
    assert f'"uri": "{opticks_set}"' in capsys.readouterr().out
    doc["spec"]["model"]["vocab"] = 1024
    job.write_text(yaml.safe_dump(doc))
    for argv in (["validate", str(job)], ["plan", str(job), "--cluster", str(CLUSTER)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "spec.model.vocab: 1024 is smaller than the tokenizer vocabulary" in err
        assert "(2048); set the model vocab to at least 2048" in err
    (opticks_set.parent / "broken").mkdir(exist_ok=True)
    (opticks_set.parent / "broken" / "manifest.json").write_text("{not json")
    doc["spec"]["data"] = {"uri": str(opticks_set.parent / "broken")}
    job.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(job)]) == 2
    assert "spec.data.uri: " in capsys.readouterr().err


def test_a_path_this_file_system_cannot_hold_is_left_to_the_runtime(tmp_path, capsys):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["data"] = {"uri": "/" + "n" * 300 + "/set"}  # one name > NAME_MAX
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(job)]) == 0


def test_the_example_job_validates_and_plans():
    assert main(["validate", str(EXAMPLE), "--cluster", str(CLUSTER)]) == 0
