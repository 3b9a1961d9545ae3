"""``spec.data``: parsed with field-path errors, carried in the plan, mounted from a PVC, and a
local token set whose tokenizer outgrows the model's vocab is refused by ``hettrain validate``."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hettrain.api.spec import DataSpec, SpecError, parse_job_spec, require_data
from hettrain.cli import main
from hettrain.manifests.builders import JobRef, build_pods
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job
from hettrain.planning.support import unsupported
from hettrain.runtime.dataset import open_data

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


def test_synthetic_data_only_when_the_spec_says_so():
    """A spec without data still parses (pure planning: the simulator, the benchmarks), but
    whatever trains refuses it naming spec.data / plan.data: ``require_data`` (operator,
    ``hettrain validate``/``plan``), the CRD, ``planning.support`` (runtime start-up) and the
    runtime's data reader."""
    spec = parse_job_spec(BASE)
    assert spec.data == DataSpec() and DataSpec().to_plan() == {}
    with pytest.raises(SpecError) as err:
        require_data(spec)
    assert err.value.field == "spec.data" and "synthetic: true" in err.value.message
    for data in ({"synthetic": True}, {"uri": "/sets/x"}, {"pvc": "corpora", "path": "x"}):
        require_data(_spec(data))  # named: accepted
    cluster = load_cluster(str(CLUSTER))
    plan = plan_job("j", spec, cluster)
    assert plan.data == {}
    refused = unsupported(plan)
    assert len(refused) == 1 and refused[0].startswith("plan.data is empty")
    assert "spec.data.synthetic: true" in refused[0]
    assert unsupported(plan_job("j", _spec({"synthetic": True}), cluster)) == []
    with pytest.raises(ValueError, match=r"plan.data=\{\} names no data"):
        open_data({}, seed=1, seq_len=8, vocab=256)
    for crd in (REPO / "crds", REPO / "charts" / "hettrain-operator" / "crds"):
        doc = yaml.safe_load((crd / "hettrainingjobs.hettrain.dev.yaml").read_text())
        schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert "data" in schema["properties"]["spec"]["required"]


def test_the_runtime_exits_2_on_a_plan_without_data(tmp_path):
    plan = plan_job("j", parse_job_spec(BASE), load_cluster(str(CLUSTER)))
    (tmp_path / "plan.json").write_text(plan.to_json())
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}", "HETTRAIN_PLAN_PATH": str(tmp_path / "plan.json"),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": str(plan.world_size),
           "HETTRAIN_RANK_START": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "hettrain.runtime"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: plan.data is empty") and proc.stderr.count("\n") == 1


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
