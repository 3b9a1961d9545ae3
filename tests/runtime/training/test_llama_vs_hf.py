"""The runtime's Llama against Hugging Face ``transformers``' ``LlamaForCausalLM``.

A tiny random ``LlamaConfig`` (GQA, Llama 3.1 rope scaling, tied and untied embeddings) is
built by transformers; its weights are loaded BY NAME into our model, whole, as pipeline stage
slices (pp 1, 2, 3) and as TP shards (tp 2 on two gloo processes): logits, loss and every
gradient must equal transformers' within fp32 tolerance, in each activation recompute mode and
with ZB-H1's deferred weight gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from tests.runtime.collectives.collective_harness import run_world

from hettrain.api.spec import MODEL_PRESETS, RECOMPUTE_MODES, ModelSpec, parse_job_spec
from hettrain.planning.cost import embedding_params, layer_params
from hettrain.runtime.model import (
    StageModel,
    check_layout,
    defer_weight_grads,
    rope_inv_freq,
    whole_model,
)
from hettrain.runtime.tensor_parallel import shard_stage_

transformers = pytest.importorskip("transformers")

ATOL = 2e-5  # fp32; only summation orders differ (SDPA vs eager attention, TP partial sums)
SPLITS = {1: [(0, 3)], 2: [(0, 2), (2, 3)], 3: [(0, 1), (1, 2), (2, 3)]}

TINY_LLAMA = ModelSpec(layers=3, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, seq_len=16,
                       vocab=128, gated_mlp=True, name="hf-tiny", norm_eps=1e-5,
                       rope_theta=500000.0, rope_factor=8.0, rope_low_freq_factor=1.0,
                       rope_high_freq_factor=4.0, rope_original_max_positions=8192)
TIED = dataclasses.replace(TINY_LLAMA, tie_embeddings=True, norm_eps=1e-6, rope_factor=1.0,
                           rope_theta=10000.0, name="hf-tiny-tied")


def hf_config(spec: ModelSpec):
    """The ``LlamaConfig`` of ``spec``."""
    rope = None
    if spec.rope_factor != 1.0:
        rope = {"rope_type": "llama3", "factor": spec.rope_factor,
                "low_freq_factor": spec.rope_low_freq_factor,
                "high_freq_factor": spec.rope_high_freq_factor,
                "original_max_position_embeddings": spec.rope_original_max_positions}
    return transformers.LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=131072,
        rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta, rope_scaling=rope,
        tie_word_embeddings=spec.tie_embeddings, attention_bias=False, mlp_bias=False,
        hidden_act="silu", attn_implementation="eager")


def hf_model(spec: ModelSpec, seed: int = 0):
    """A random ``LlamaForCausalLM`` (norm weights perturbed too, so they are checked)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(spec)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_reference(spec: ModelSpec, tokens: torch.Tensor):
    """transformers' logits, loss (labels = the tokens, shifted inside) and gradients."""
    model = hf_model(spec)
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return model, out.logits.detach(), out.loss.detach(), grads


def stage_grads(stages: list[StageModel]) -> dict[str, torch.Tensor]:
    """Our gradients by name; the tied output layer's copy on a last stage is summed into the
    embedding's (what training tied embeddings across stages would have to do)."""
    grads = {n: p.grad for st in stages for n, p in st.named_parameters()}
    if "lm_head.weight" in grads and stages[0].spec.tie_embeddings:
        grads["model.embed_tokens.weight"] = (grads["model.embed_tokens.weight"]
                                              + grads.pop("lm_head.weight"))
    return grads


def build_stages(spec: ModelSpec, pp: int, weights: dict[str, torch.Tensor],
                 recompute: str = "none") -> list[StageModel]:
    """Our pipeline stage slices, loaded by Hugging Face name from ``weights``."""
    stages = []
    for s, (a, b) in enumerate(SPLITS[pp]):
        st = StageModel(spec, a, b, has_embedding=s == 0, has_head=s == pp - 1, seed=9,
                        recompute=recompute)
        st.load_state_dict({k: weights[k] for k in st.state_dict()}, strict=True)
        stages.append(st)
    return stages


def run_chain(stages: list[StageModel], tokens: torch.Tensor, defer: bool = False):
    """Forward the chained stages and backward the loss; returns logits and loss."""
    x = tokens
    for st in stages:
        x = st(x)
    loss = stages[-1].loss(x[:, :-1], tokens[:, 1:])  # vocab-parallel when the head is sharded
    if defer:
        with defer_weight_grads() as store:
            loss.backward()
        store.flush()
    else:
        loss.backward()
    return x.detach(), loss.detach()


def _tokens(spec: ModelSpec) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (2, spec.seq_len), generator=torch.Generator()
                         .manual_seed(1))


@pytest.mark.parametrize("spec", [TINY_LLAMA, TIED], ids=["untied-rope-scaled", "tied"])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_stage_slices_match_transformers_logits_loss_and_grads(spec, pp):
    tokens = _tokens(spec)
    hf, logits, loss, grads = hf_reference(spec, tokens)
    stages = build_stages(spec, pp, hf.state_dict())
    got_logits, got_loss = run_chain(stages, tokens)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    ours = stage_grads(stages)
    assert ours.keys() == grads.keys()  # every transformers parameter, by its name
    for n, g in ours.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_rope_frequencies_equal_transformers_llama3_scaling():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    ours = rope_inv_freq(TINY_LLAMA)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config(TINY_LLAMA), "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    wavelen = 2 * torch.pi / rope_inv_freq(dataclasses.replace(TINY_LLAMA, rope_factor=1.0))
    # the tiny config exercises all three bands: kept, interpolated and divided by the factor
    assert (wavelen < 2048).any() and ((wavelen > 2048) & (wavelen < 8192)).any()
    assert (wavelen > 8192).any()


@pytest.mark.parametrize("spec", [TINY_LLAMA, TIED], ids=["untied", "tied"])
def test_parameter_count_matches_transformers(spec):
    hf = hf_model(spec)
    n = sum(p.numel() for p in hf.parameters())
    assert spec.parameters() == n
    ends = (1 if spec.tie_embeddings else 2) * embedding_params(spec) + spec.hidden
    assert spec.layers * layer_params(spec) + ends == n


def test_whole_model_equals_the_concatenation_of_seeded_slices():
    whole = whole_model(TINY_LLAMA, seed=4).state_dict()
    parts = {}
    for s, (a, b) in enumerate(SPLITS[3]):
        parts.update(StageModel(TINY_LLAMA, a, b, has_embedding=s == 0, has_head=s == 2,
                                seed=4).state_dict())
    assert parts.keys() == whole.keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)
    assert sorted(whole) == sorted(hf_model(TINY_LLAMA).state_dict())  # Hugging Face names


def test_tied_slices_start_from_the_same_weights_and_pp_over_1_is_refused():
    whole = whole_model(TIED, seed=4)
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    last = StageModel(TIED, 2, 3, has_embedding=False, has_head=True, seed=4)
    assert torch.equal(last.lm_head.weight, whole.model.embed_tokens.weight)
    check_layout(TIED, 1)
    with pytest.raises(ValueError, match=r"plan.model.tie_embeddings with plan.pp=2.*"
                                         r"tieEmbeddings: false"):
        check_layout(TIED, 2)


@pytest.mark.parametrize("defer", [False, True], ids=["plain", "zb-h1-deferred"])
def test_recompute_modes_give_identical_gradients(defer):
    tokens = _tokens(TINY_LLAMA)
    weights = hf_model(TINY_LLAMA).state_dict()
    results = {}
    for mode in RECOMPUTE_MODES:
        stages = build_stages(TINY_LLAMA, 2, weights, recompute=mode)
        _, loss = run_chain(stages, tokens, defer=defer)
        results[mode] = (loss, {n: p.grad for st in stages for n, p in st.named_parameters()})
    loss0, g0 = results["none"]
    for mode in RECOMPUTE_MODES[1:]:
        loss, g = results[mode]
        assert torch.equal(loss, loss0), mode
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=0, atol=0, msg=f"{mode} {n}")


def test_full_recompute_keeps_fewer_activations():
    """Saved-tensor bytes of one forward: full < selective < none (the point of recompute)."""
    tokens = _tokens(TINY_LLAMA)
    saved = {}
    for mode in RECOMPUTE_MODES:
        model = whole_model(TINY_LLAMA, seed=1, recompute=mode)
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens)
        saved[mode] = total[0]
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_presets_are_real_llama_configs():
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        m = parse_job_spec({"model": {"preset": name},
                            "training": {"globalBatch": 8, "steps": 1}}).model
        assert (m.rope_theta, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
                m.rope_original_max_positions) == (500000.0, 8.0, 1.0, 4.0, 8192), name
        assert m.gated_mlp and m.kv_heads == 8 and not m.tie_embeddings and m.vocab == 128256
    assert parse_job_spec({"model": {"preset": "llama3-8b"}, "training": {
        "globalBatch": 8, "steps": 1}}).model.parameters() == 8_030_261_248  # Llama 3.1 8B
    tiny = ModelSpec(**MODEL_PRESETS["llama-tiny"], name="llama-tiny")
    assert tiny.kv_heads < tiny.heads and tiny.gated_mlp


# ---------------------------------------------------------------- tensor parallel (2 processes)


def _tp_worker(rank: int, world: int, spec: ModelSpec) -> dict:
    """On each of 2 gloo ranks: pp 1, 2 and 3 stage splits, TP-sharded 2 ways, across the
    recompute modes (and deferred for ZB-H1), against transformers' logits, loss and (sliced)
    gradients."""
    tokens = _tokens(spec)
    hf, logits, loss, grads = hf_reference(spec, tokens)
    weights = hf.state_dict()
    group = dist.new_group([0, 1])
    checked = 0
    for pp, mode, defer in ((1, "none", False), (2, "selective", True), (3, "full", False),
                            (3, "full", True), (2, "attention-free", True)):
        stages = build_stages(spec, pp, weights, recompute=mode)
        shards = [shard_stage_(st, spec, 2, rank, group, [0, 1]) for st in stages]
        got_logits, got_loss = run_chain(stages, tokens, defer=defer)
        # vocab-parallel head: this rank's logit columns; the loss over the whole vocabulary
        cols = spec.vocab // 2
        assert got_logits.shape[-1] == cols
        torch.testing.assert_close(got_logits, logits[..., rank * cols:(rank + 1) * cols],
                                   rtol=0, atol=ATOL)
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
        sharded = {n: info for info in shards for n in info.shards}
        ours = stage_grads(stages)
        assert ours.keys() == grads.keys()
        for n, g in ours.items():
            want = sharded[n].local(n, grads[n]) if n in sharded else grads[n]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6,
                                       msg=f"pp={pp} {mode} {n}")
            checked += 1
        # + the embedding and the head rows (one tensor when tied in one stage)
        vocab = 1 if spec.tie_embeddings and pp == 1 else 2
        assert sum(len(i.shards) for i in shards) == 7 * spec.layers + vocab
        assert "model.embed_tokens.weight" in sharded
    return {"checked": checked}


@pytest.mark.parametrize("spec", [TINY_LLAMA, TIED], ids=["untied", "tied"])
def test_tp2_shards_match_transformers_for_pp_1_2_3(spec):
    out = run_world(2, _tp_worker, spec, timeout=600)
    assert out[0]["checked"] == out[1]["checked"] > 0
