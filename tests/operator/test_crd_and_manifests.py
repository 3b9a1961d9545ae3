"""The CRD agrees with the spec parser; child manifests follow the naming/env/affinity contract."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from optest_helpers import hetero_nodes, job_body

from hettrain.api import constants as c
from hettrain.api import spec as S
from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.manifests.builders import JobRef, build_pods, dns_name, pod_name
from hettrain.planning.inventory import inventory_from_nodes
from hettrain.planning.planner import plan_job

CRD = Path(__file__).resolve().parents[2] / "crds" / "hettrainingjobs.hettrain.dev.yaml"


def _schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _sample(schema: dict[str, Any], name: str) -> Any:
    """A valid value for one CRD property (first enum value, minimum, or a plain default)."""
    t = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if t == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if t == "number":
        return 0.5
    if t == "boolean":
        return False
    if t == "string":
        return "x"
    if t == "array":
        return [_sample(schema["items"], name)] * max(1, schema.get("minItems", 1))
    if t == "object" and "additionalProperties" in schema:
        return {"k": "v"}
    if t == "object" and "properties" in schema:
        return {k: _sample(v, f"{name}.{k}") for k, v in schema["properties"].items()}
    raise AssertionError(f"{name}: unexpected schema {schema}")


def test_every_crd_spec_property_is_accepted_by_the_parser_and_unknowns_are_rejected():
    spec = _schema()["properties"]
    base = job_body()["spec"]
    for section, sub in spec.items():
        if sub.get("type") == "object" and "properties" in sub:
            for prop, ps in sub["properties"].items():
                if prop in ("preset",):
                    continue
                doc = {**base, section: {**base.get(section, {}), prop: _sample(ps, prop)}}
                if section == "checkpoint" and prop == "pvc":
                    doc[section].pop("uri", None)
                try:
                    parse_job_spec(doc)
                except SpecError as err:
                    assert err.field != f"spec.{section}.{prop}" or "unknown" not in err.message, (
                        f"parser does not know spec.{section}.{prop}")
        else:
            parse_job_spec({**base, section: _sample(sub, section)})


def test_every_parser_field_is_in_the_crd():
    spec = _schema()["properties"]
    sections = {"model": S.ModelSpec, "training": S.TrainingSpec, "placement": S.PlacementSpec,
                "parallelism": S.ParallelismSpec, "crossDC": S.CrossDCSpec,
                "checkpoint": S.CheckpointSpec, "failurePolicy": S.FailurePolicy}
    renames = {"max_gpus": "maxGPUs", "min_gpus": "minGPUs", "outer_lr": "outerLearningRate",
               # training loop fields kept flat in the plan JSON, grouped in the CRD
               "decay_norms": "weightDecayExclude", "decay_biases": "weightDecayExclude",
               "decay_embeddings": "weightDecayExclude", "adam_beta1": "adamBetas",
               "adam_beta2": "adamBetas", "validation_interval": "validation",
               "validation_batches": "validation",
               "async_save": "async",
               # Llama 3.1 RoPE scaling: flat in the plan JSON, one object in the CRD
               "rope_factor": "ropeScaling", "rope_low_freq_factor": "ropeScaling",
               "rope_high_freq_factor": "ropeScaling", "rope_original_max_positions": "ropeScaling"}

    def camel(n: str) -> str:
        return renames.get(n) or re.sub(r"_(\w)", lambda m: m.group(1).upper(), n)

    for key, cls in sections.items():
        props = spec[key]["properties"]
        for f in cls.__dataclass_fields__:
            if key == "training" and f in S.PLANNER_TRAINING_FIELDS:
                assert camel(f) not in props, f"spec.training.{camel(f)}: the planner's only"
                continue
            assert camel(f) in props, f"spec.{key}.{camel(f)} missing from the CRD"
    for f in S.JobSpec.__dataclass_fields__:
        assert camel(f) in spec or f == "cross_dc", f"spec.{camel(f)} missing from the CRD"
    enums = {("training", "precision"): S.PRECISIONS, ("training", "recompute"):
             S.RECOMPUTE_SPEC_MODES, ("parallelism", "schedule"): S.SCHEDULES,
             ("crossDC", "mode"): S.CROSS_DC_SPEC_MODES, ("crossDC", "compression"): S.COMPRESSIONS,
             ("failurePolicy", "mode"): S.REPAIR_MODES}
    for (sec, prop), values in enums.items():
        assert tuple(spec[sec]["properties"][prop]["enum"]) == values
    assert tuple(spec["model"]["properties"]["preset"]["enum"]) == tuple(S.MODEL_PRESETS)
    assert tuple(spec["placement"]["properties"]["vendors"]["items"]["enum"]) == c.VENDORS


def test_descriptions_start_with_the_field_name():
    def walk(props: dict[str, Any]) -> None:
        for name, s in props.items():
            if "description" in s:
                assert s["description"].startswith(name), (name, s["description"])
            walk(s.get("properties", {}))
    walk(_schema()["properties"])


@pytest.mark.parametrize("parts", [("a" * 80, "a1", "r0"), ("Job_X", 1), ("x", "a12", "r4096")])
def test_dns_names_are_valid_labels_and_stable(parts):
    name = dns_name(*parts)
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name)
    assert name == dns_name(*parts)


def test_pods_pin_nodes_request_vendor_resource_and_carry_env():
    spec = parse_job_spec({**job_body()["spec"], "checkpoint": {"pvc": "ckpt"},
                           "priorityClassName": "high", "schedulerName": "gang"})
    nodes = hetero_nodes(2, 2, 8)
    plan = plan_job("job1", spec, inventory_from_nodes(nodes))
    pods = build_pods(JobRef("job1", "ns", "u"), spec, plan, 3, True)
    assert len(pods) == len(plan.nodes())
    covered = []
    for pod, node in zip(pods, plan.nodes(), strict=True):
        ranks = plan.ranks_on(node)
        ps = pod["spec"]
        term = ps["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [node]
        ctr = ps["containers"][0]
        env = {e["name"]: e["value"] for e in ctr["env"]}
        assert env[c.ENV_NODE_RANK_START] == str(ranks[0].rank)
        assert env[c.ENV_LOCAL_WORLD_SIZE] == str(len(ranks))
        assert env[c.ENV_WORLD_SIZE] == str(plan.world_size)
        assert env[c.ENV_RESUME] == "1" and env[c.ENV_CHECKPOINT_URI] == "/checkpoints/ns/job1"
        stage = plan.stages[ranks[0].stage]
        assert env[c.ENV_BACKEND] == stage.backend
        assert ctr["resources"]["requests"] == {c.VENDOR_RESOURCES[stage.vendor]: str(len(ranks))}
        assert env[c.ENV_MASTER_ADDR] == f"{pod_name('job1', 3, 0)}.job1-ranks.ns.svc"
        assert ps["restartPolicy"] == "Never" and ps["priorityClassName"] == "high"
        assert ps["schedulerName"] == "gang"
        assert pod["metadata"]["ownerReferences"][0]["controller"] is True
        assert any(v.get("persistentVolumeClaim") == {"claimName": "ckpt"} for v in ps["volumes"])
        covered.extend(r.rank for r in ranks)
    assert sorted(covered) == list(range(plan.world_size))
