"""The CRD YAML parses into the schema it means: a flow-style ``{... description: a, b}``
splits at the comma into a stray property key, which the apiserver rejects on apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = sorted((ROOT / "crds").glob("*.yaml")) + sorted(
    (ROOT / "charts" / "hettrain-operator" / "crds").glob("*.yaml"))
SCHEMA_KEYWORDS = {"type", "description", "properties", "items", "required", "enum", "format",
                   "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
                   "maxLength", "pattern", "minItems", "maxItems", "uniqueItems",
                   "additionalProperties", "default", "nullable", "oneOf", "anyOf", "allOf",
                   "not", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
                   "x-kubernetes-validations", "x-kubernetes-list-type",
                   "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "minProperties",
                   "maxProperties", "multipleOf", "example", "title"}


def _bad_keys(schema: Any, path: str) -> list[str]:
    """Keys of schema objects that are no schema keyword (property names are checked as the
    schemas under ``properties``)."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out
    out += [f"{path}: {k!r}" for k in schema if k not in SCHEMA_KEYWORDS]
    for name, sub in (schema.get("properties") or {}).items():
        if not isinstance(name, str) or " " in name:
            out.append(f"{path}.properties: {name!r}")
        out += _bad_keys(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _bad_keys(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _bad_keys(schema["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("path", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_schema_key_is_a_keyword(path: Path) -> None:
    assert CRDS
    bad = []
    for doc in yaml.safe_load_all(path.read_text()):
        for version in (doc or {}).get("spec", {}).get("versions") or []:
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            bad += _bad_keys(schema, f"{doc['metadata']['name']}/{version['name']}")
    assert not bad, bad


def test_a_comma_in_a_flow_description_is_caught() -> None:
    schema = yaml.safe_load("properties:\n  x: {type: boolean, description: a, b c}\n")
    assert _bad_keys(schema, "v") == ["v.x: 'b c'"]
