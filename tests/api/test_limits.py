"""The spec's upper bounds (api/limits.py) are the CRD's maximums, and the parser enforces them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from hettrain.api.limits import SPEC_MAX_LENGTHS, SPEC_MAXIMUMS
from hettrain.api.spec import SpecError, parse_job_spec

ROOT = Path(__file__).resolve().parents[2]
CRDS = [ROOT / "crds" / "hettrainingjobs.hettrain.dev.yaml",
        ROOT / "charts" / "hettrain-operator" / "crds" / "hettrainingjobs.hettrain.dev.yaml"]
BASE = {"model": {"layers": 4, "hidden": 64, "heads": 4, "seqLen": 64, "vocab": 256},
        "training": {"globalBatch": 8, "steps": 1}}


def _spec_schema(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _walk(schema: dict[str, Any], path: str):
    """(dotted path, schema) of every property below ``schema``; list items as ``[]``, map
    values as ``{}``."""
    for name, sub in schema.get("properties", {}).items():
        yield f"{path}.{name}", sub
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield f"{path}[]", schema["items"]
    if isinstance(schema.get("additionalProperties"), dict):
        yield f"{path}{{}}", schema["additionalProperties"]


def test_both_crd_copies_are_identical() -> None:
    assert CRDS[0].read_text() == CRDS[1].read_text()


@pytest.mark.parametrize("crd", CRDS, ids=["crds", "chart"])
def test_every_numeric_spec_field_has_the_parsers_maximum(crd: Path) -> None:
    fields = dict(_walk(_spec_schema(crd), "spec"))
    numeric = {p: s for p, s in fields.items() if s.get("type") in ("integer", "number")}
    assert numeric, "no numeric fields found"
    for path, schema in numeric.items():
        assert path in SPEC_MAXIMUMS, f"{path}: numeric CRD field without an entry in " \
                                      "api/limits.py SPEC_MAXIMUMS (and a CRD maximum)"
        assert schema.get("maximum") == SPEC_MAXIMUMS[path], path
    for path in SPEC_MAXIMUMS:
        assert path in numeric, f"{path} is in SPEC_MAXIMUMS but not a numeric CRD field"
    for path, limit in SPEC_MAX_LENGTHS.items():
        assert fields[path].get("maxLength") == limit, path


def _with(path: str, value: Any) -> dict[str, Any]:
    """BASE with the field at ``path`` (``spec.section.field`` or ``spec.field``) set."""
    doc = copy.deepcopy(BASE)
    parts = path.split(".")[1:]
    node = doc
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    # fields bounded by others: raise those too, while they stay within their own maximum
    linked = {"spec.training.microBatch": ("training", "globalBatch"),
              "spec.parallelism.dp": ("training", "globalBatch"),
              "spec.parallelism.pp": ("model", "layers")}
    if path in linked:
        section, key = linked[path]
        if value <= SPEC_MAXIMUMS[f"spec.{section}.{key}"]:
            doc[section][key] = value
    return doc


@pytest.mark.parametrize("path", sorted(p for p in SPEC_MAXIMUMS if not p.endswith("[]")))
def test_parser_refuses_one_above_the_maximum_naming_the_field(path: str) -> None:
    limit = SPEC_MAXIMUMS[path]
    above = limit * 2 if isinstance(limit, float) else limit + 1
    with pytest.raises(SpecError) as err:
        parse_job_spec(_with(path, above))
    assert err.value.field == path and "<=" in err.value.message
    try:  # at the maximum the field itself is fine (other rules may still object)
        parse_job_spec(_with(path, limit))
    except SpecError as exc:
        assert exc.field != path or "<=" not in exc.message, str(exc)


def test_parser_refuses_adam_betas_at_or_above_one() -> None:
    """The one list-item bound: ``adamBetas[]`` < 1 (exclusive), refused naming the list."""
    for betas in ([1.0, 0.95], [0.9, 2.0]):
        with pytest.raises(SpecError) as err:
            parse_job_spec(_with("spec.training.adamBetas", betas))
        assert err.value.field == "spec.training.adamBetas" and "[0, 1)" in err.value.message
    parse_job_spec(_with("spec.training.adamBetas", [0.9, 0.95]))


@pytest.mark.parametrize("path", sorted(SPEC_MAX_LENGTHS))
def test_parser_refuses_strings_longer_than_the_crd_allows(path: str) -> None:
    long = "a" * (SPEC_MAX_LENGTHS[path] + 1)
    field = path.removesuffix("[]").removesuffix("{}")
    value: Any = [long] if path.endswith("[]") else {"k": long} if path.endswith("{}") else long
    with pytest.raises(SpecError) as err:
        parse_job_spec(_with(field, value))
    assert err.value.field.startswith(field) and "at most" in err.value.message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 10**400])
@pytest.mark.parametrize("path", ["spec.training.learningRate", "spec.crossDC.outerLearningRate",
                                  "spec.crossDC.outerMomentum",
                                  "spec.failurePolicy.debounceSeconds"])
def test_non_finite_floats_are_refused(path: str, value: float) -> None:
    with pytest.raises(SpecError) as err:
        parse_job_spec(_with(path, value))
    assert err.value.field == path
    assert len(str(err.value)) < 200  # a 400-digit integer is not echoed in full
