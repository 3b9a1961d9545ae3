"""The spec parser: defaults, presets, and a clear error naming the field for every bad input."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hettrain.api.spec import (
    MODEL_PRESETS,
    JobSpec,
    SpecError,
    parse_job_manifest,
    parse_job_spec,
)

BASE: dict[str, Any] = {
    "model": {"preset": "llama3-8b"},
    "training": {"globalBatch": 512, "steps": 100},
}


def with_(path: str, value: Any) -> dict[str, Any]:
    """BASE with one dotted path set (value None deletes it)."""
    spec = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return spec


def test_defaults_and_preset() -> None:
    spec = parse_job_spec(BASE)
    assert isinstance(spec, JobSpec)
    assert spec.model.layers == 32 and spec.model.kv_heads == 8 and spec.model.gated_mlp
    assert spec.training.precision == "bf16" and spec.training.micro_batch is None
    assert spec.failure_policy.mode == "Shrink" and spec.cross_dc.mode == "sync"
    assert not spec.suspend


@pytest.mark.parametrize(
    ("preset", "billions"),
    [
        pytest.param("llama3-8b", 8.03, id="llama3-8b"),
        pytest.param("llama3-70b", 70.6, id="llama3-70b"),
        pytest.param("llama3-405b", 405.8, id="llama3-405b"),
        pytest.param("gpt3-175b", 174.6, id="gpt3-175b"),
    ],
)
def test_preset_parameter_counts_match_published_sizes(preset: str, billions: float) -> None:
    model = parse_job_spec(with_("model.preset", preset)).model
    assert model.parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_explicit_model_overrides_preset() -> None:
    spec = parse_job_spec(with_("model.layers", 16))
    assert spec.model.layers == 16 and spec.model.hidden == MODEL_PRESETS["llama3-8b"]["hidden"]


def test_explicit_model_without_preset() -> None:
    spec = parse_job_spec(
        {
            "model": {"layers": 2, "hidden": 64, "heads": 4, "seqLen": 32, "vocab": 256},
            "training": {"globalBatch": 8, "steps": 3, "microBatch": 2},
        }
    )
    assert spec.model.ffn_hidden == 256 and spec.model.kv_heads == 4
    assert spec.training.micro_batch == 2


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        pytest.param(with_("training.globalBatch", 0), "spec.training.globalBatch", ">= 1",
                     id="batch-zero"),
        pytest.param(with_("training.globalBatch", None), "spec.training.globalBatch",
                     "required", id="batch-missing"),
        pytest.param(with_("training.globalBatch", "512"), "spec.training.globalBatch",
                     "integer", id="batch-string"),
        pytest.param(with_("training.microBatch", 3), "spec.training.microBatch",
                     "divisible", id="microbatch-not-divisor"),
        pytest.param(with_("training.precision", "fp8"), "spec.training.precision",
                     "one of", id="precision-enum"),
        pytest.param(with_("model.preset", "llama9"), "spec.model.preset", "unknown preset",
                     id="preset-unknown"),
        pytest.param(with_("model.heads", 33), "spec.model.heads", "divisible",
                     id="heads-not-divisor"),
        pytest.param(with_("model.layerz", 3), "spec.model.layerz", "unknown field",
                     id="typo"),
        pytest.param(with_("placement.vendors", ["nvidia", "apple"]),
                     "spec.placement.vendors[1]", "one of", id="vendor-enum"),
        pytest.param(with_("parallelism.tp", 3), "spec.parallelism.tp", "power of two",
                     id="tp-not-pow2"),
        pytest.param(with_("parallelism.pp", 64), "spec.parallelism.pp", "exceeds",
                     id="pp-too-deep"),
        pytest.param(with_("checkpoint", {"uri": "/c", "pvc": "p"}), "spec.checkpoint.pvc",
                     "either", id="checkpoint-both"),
        pytest.param(with_("failurePolicy.mode", "Pray"), "spec.failurePolicy.mode", "one of",
                     id="repair-mode"),
        pytest.param(with_("crossDC.outerMomentum", 1.0), "spec.crossDC.outerMomentum",
                     "[0, 1)", id="momentum"),
        pytest.param(with_("crossDC", {"mode": "compress", "compression": "none"}),
                     "spec.crossDC.compression", "compresses nothing", id="compress-none"),
        pytest.param(with_("suspend", "yes"), "spec.suspend", "true or false", id="suspend"),
        pytest.param(with_("model", []), "spec.model", "mapping", id="model-not-mapping"),
    ],
)
def test_bad_input_names_the_field(spec: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_job_spec(spec)
    assert err.value.field == field
    assert words in err.value.message


@pytest.mark.parametrize("mode", ["none", "selective", "attention-free", "full", "auto"])
def test_recompute_modes_parse(mode: str) -> None:
    assert parse_job_spec(with_("training.recompute", mode)).training.recompute == mode


def test_recompute_enum_error_lists_every_mode() -> None:
    with pytest.raises(SpecError) as err:
        parse_job_spec(with_("training.recompute", "attention"))
    assert err.value.field == "spec.training.recompute"
    assert ("must be one of none, selective, attention-free, full, auto (got 'attention')"
            in err.value.message)


def test_manifest_checks_kind_and_name() -> None:
    doc = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "HetTrainingJob",
           "metadata": {"name": "j"}, "spec": BASE}
    name, spec = parse_job_manifest(doc)
    assert name == "j" and spec.model.layers == 32
    with pytest.raises(SpecError, match="kind"):
        parse_job_manifest({**doc, "kind": "Job"})
    with pytest.raises(SpecError, match=r"metadata\.name"):
        parse_job_manifest({**doc, "metadata": {}})


def test_overlap_grad_reduce_defaults_on_and_names_its_field() -> None:
    base = {"model": {"preset": "gpt-tiny"}, "training": {"globalBatch": 8, "steps": 1},
            "data": {"synthetic": True}}
    assert parse_job_spec(base).training.overlap_grad_reduce is True
    off = copy.deepcopy(base)
    off["training"]["overlapGradReduce"] = False
    assert parse_job_spec(off).training.overlap_grad_reduce is False
    off["training"]["overlapGradReduce"] = "no"
    with pytest.raises(SpecError) as err:
        parse_job_spec(off)
    assert err.value.field == "spec.training.overlapGradReduce"
