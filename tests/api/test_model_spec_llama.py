"""spec.model's Llama fields: defaults, preset values, overrides, field-path errors."""

from __future__ import annotations

import json

import pytest

from hettrain.api.spec import MODEL_PRESETS, ModelSpec, SpecError, parse_job_spec
from hettrain.planning.cost import stage_memory
from hettrain.planning.plan import Plan


def _model(**model):
    return parse_job_spec({"model": model, "training": {"globalBatch": 8, "steps": 1}}).model


def test_custom_model_defaults_are_plain_rope_untied():
    m = _model(layers=2, hidden=32, heads=4, seqLen=16, vocab=64)
    assert (m.norm_eps, m.rope_theta, m.rope_factor, m.tie_embeddings) == (1e-5, 1e4, 1.0, False)


def test_overrides_on_a_preset():
    m = _model(preset="llama-tiny", normEps=1e-6, ropeTheta=10000, tieEmbeddings=True,
               ropeScaling={"factor": 32, "lowFreqFactor": 1, "highFreqFactor": 4,
                            "originalMaxPositionEmbeddings": 4096})
    assert (m.norm_eps, m.rope_theta, m.rope_factor, m.rope_original_max_positions) == (
        1e-6, 10000.0, 32.0, 4096)
    assert m.tie_embeddings and m.layers == MODEL_PRESETS["llama-tiny"]["layers"]
    untied = _model(preset="llama-tiny")
    assert m.parameters() == untied.parameters() - m.vocab * m.hidden


@pytest.mark.parametrize("model,field", [
    ({"normEps": 0}, "spec.model.normEps"),
    ({"ropeTheta": 0.5}, "spec.model.ropeTheta"),
    ({"ropeScaling": {"factor": 0.5}}, "spec.model.ropeScaling.factor"),
    ({"ropeScaling": {"lowFreqFactor": 4, "highFreqFactor": 1}},
     "spec.model.ropeScaling.highFreqFactor"),
    ({"ropeScaling": {"fator": 8}}, "spec.model.ropeScaling.fator"),
    ({"ropeScaling": 8}, "spec.model.ropeScaling"),
    ({"tieEmbeddings": "yes"}, "spec.model.tieEmbeddings"),
])
def test_bad_llama_fields_name_the_field(model, field):
    with pytest.raises(SpecError) as err:
        _model(preset="llama-tiny", **model)
    assert err.value.field == field


def test_old_plan_json_without_the_new_fields_still_parses():
    from tests.runtime.training.plans import tiny_plan
    d = json.loads(tiny_plan([(0, 4, "a")], dp=1).to_json())
    for k in ("norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_positions", "tie_embeddings"):
        d["model"].pop(k)
    assert Plan.from_dict(d).model == ModelSpec(**d["model"])


def test_tied_single_stage_counts_the_embedding_once():
    m = _model(preset="llama-tiny")
    t = _model(preset="llama-tiny", tieEmbeddings=True)
    tr = parse_job_spec({"model": {"preset": "llama-tiny"},
                         "training": {"globalBatch": 8, "steps": 1}}).training
    kw = dict(tp=1, dp=1, micro_batch=1, in_flight=1, first=True, last=True)
    diff = stage_memory(m, tr, **kw).fixed - stage_memory(t, tr, **kw).fixed
    assert diff == m.vocab * m.hidden * 18  # bf16 + fp32 grads + Adam (2 + 4 + 12 bytes)


def test_tied_embeddings_refuse_a_pinned_pipeline_and_plan_one_stage():
    with pytest.raises(SpecError) as err:
        parse_job_spec({"model": {"preset": "llama-tiny", "tieEmbeddings": True},
                        "training": {"globalBatch": 8, "steps": 1},
                        "parallelism": {"pp": 2}})
    assert err.value.field == "spec.parallelism.pp" and "tieEmbeddings" in err.value.message
    from pathlib import Path

    from hettrain.planning.inventory import load_cluster
    from hettrain.planning.planner import plan_job
    root = Path(__file__).resolve().parents[2]
    inv = load_cluster(root / "examples/clusters/local-cpu.yaml")
    doc = {"model": {"preset": "llama-tiny"}, "training": {"globalBatch": 8, "steps": 1}}
    assert plan_job("j", parse_job_spec(doc), inv).pp > 1  # untied: the planner pipelines
    doc["model"]["tieEmbeddings"] = True
    plan = plan_job("j", parse_job_spec(doc), inv)
    assert plan.pp == 1 and plan.model.tie_embeddings
