"""Hugging Face safetensors import into stage slices / TP shards and export back
(``spec.model.pretrained``), against a tiny model saved by ``transformers`` itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tests.runtime.collectives.collective_harness import run_world
from tests.runtime.training.test_llama_vs_hf import SPLITS, TINY_LLAMA, hf_model, run_chain

from hettrain.runtime.model import StageModel
from hettrain.runtime.tensor_parallel import shard_stage_
from hettrain.runtime.weights import (
    checkpoint_state,
    load_pretrained,
    save_safetensors,
    stage_state,
    weight_files,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _save_hf(spec, path, shard_size=None):
    """A random transformers model saved with ``save_pretrained`` (optionally sharded)."""
    hf = hf_model(spec)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    hf.save_pretrained(path, safe_serialization=True, **kw)
    return hf


def _file_tensors(path):
    out = {}
    for name, file in weight_files(path).items():
        out[name] = safetensors_torch.load_file(str(file))[name]
    return out


def _stages(spec, pp, seed=7):
    return [StageModel(spec, a, b, has_embedding=s == 0, has_head=s == pp - 1, seed=seed)
            for s, (a, b) in enumerate(SPLITS[pp])]


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded-index"])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_import_into_slices_then_export_is_byte_identical(tmp_path, sharded, pp):
    src = tmp_path / "hf"
    hf = _save_hf(TINY_LLAMA, src, "40KB" if sharded else None)
    assert (src / "model.safetensors.index.json").exists() == sharded
    original = _file_tensors(src)
    stages = _stages(TINY_LLAMA, pp)
    read = sum(load_pretrained(st, src) for st in stages)
    assert read == sum(t.numel() for t in original.values())
    out = save_safetensors(stage_state(stages), tmp_path / "out")
    back = safetensors_torch.load_file(str(out))
    assert back.keys() == original.keys()
    for k, t in original.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert back[k].numpy().tobytes() == t.numpy().tobytes(), k
    # the loaded slices compute transformers' logits
    tokens = torch.randint(0, TINY_LLAMA.vocab, (2, TINY_LLAMA.seq_len))
    logits, _ = run_chain(stages, tokens)
    torch.testing.assert_close(logits, hf(input_ids=tokens).logits.detach(), rtol=0, atol=2e-5)
    # and transformers reads the export
    again = transformers.LlamaForCausalLM(hf.config).float()
    missing, unexpected = again.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    for k, t in again.state_dict().items():
        assert torch.equal(t, original[k]), k


def test_tied_model_round_trip_keeps_one_embedding(tmp_path):
    tied = dataclasses.replace(TINY_LLAMA, tie_embeddings=True)
    src = tmp_path / "hf"
    _save_hf(tied, src)
    original = _file_tensors(src)
    assert "lm_head.weight" not in original  # transformers omits the tied copy
    whole = _stages(tied, 1)
    load_pretrained(whole[0], src)
    back = safetensors_torch.load_file(str(save_safetensors(stage_state(whole), tmp_path / "o")))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    last = StageModel(tied, 2, 3, has_embedding=False, has_head=True, seed=1)
    load_pretrained(last, src)  # a last stage's copy is read from the embedding
    assert torch.equal(last.lm_head.weight, original["model.embed_tokens.weight"])


def test_mismatched_weights_are_refused_naming_the_field(tmp_path):
    src = tmp_path / "hf"
    _save_hf(TINY_LLAMA, src)
    wider = dataclasses.replace(TINY_LLAMA, ffn_hidden=128)
    with pytest.raises(ValueError, match=r"spec.model.pretrained=.*'model.layers.0.mlp.gate_proj"
                                         r".weight' has shape \[96, 64\].*\[128, 64\]"):
        load_pretrained(_stages(wider, 1)[0], src)
    deeper = dataclasses.replace(TINY_LLAMA, layers=4)
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.3"):
        load_pretrained(StageModel(deeper, 3, 4, has_embedding=False, has_head=False, seed=1),
                        src)
    with pytest.raises(ValueError, match=r"spec.model.pretrained=.*no safetensors file"):
        load_pretrained(_stages(TINY_LLAMA, 1)[0], tmp_path)


def test_export_from_a_dcp_checkpoint(tmp_path):
    src = tmp_path / "hf"
    _save_hf(TINY_LLAMA, src)
    whole = _stages(TINY_LLAMA, 1)[0]
    load_pretrained(whole, src)
    state = dict(whole.state_dict())
    state["optim.model.norm.weight.exp_avg"] = torch.zeros(TINY_LLAMA.hidden)
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    out = save_safetensors(checkpoint_state(tmp_path / "step-1"), tmp_path / "x.safetensors")
    back = safetensors_torch.load_file(str(out))
    original = _file_tensors(src)
    assert back.keys() == original.keys()  # optimizer state dropped
    assert all(torch.equal(back[k], original[k]) for k in original)


def _tp_load_worker(rank: int, world: int, src: str) -> int:
    """Each of 2 TP ranks reads only its slices; the slices equal transformers' tensors."""
    original = _file_tensors(src)
    group = dist.new_group([0, 1])
    total = 0
    for pp in (1, 3):
        stages = _stages(TINY_LLAMA, pp)
        shards = [shard_stage_(st, TINY_LLAMA, 2, rank, group, [0, 1]) for st in stages]
        read = sum(load_pretrained(st, src, info) for st, info in zip(stages, shards,
                                                                        strict=True))
        assert read == sum(p.numel() for st in stages for p in st.parameters())
        for st, info in zip(stages, shards, strict=True):
            for n, p in st.named_parameters():
                want = info.local(n, original[n]) if n in info.shards else original[n]
                assert torch.equal(p.detach(), want), n
                if n in info.shards:  # the full tensor is reassembled by the TP gather
                    assert torch.equal(info.gather(n, p), original[n]), n
        total += read
    return total


def test_tp2_ranks_read_only_their_slices(tmp_path):
    src = tmp_path / "hf"
    _save_hf(TINY_LLAMA, src, "40KB")
    reads = run_world(2, _tp_load_worker, str(src), timeout=180)
    full = 2 * TINY_LLAMA.parameters()  # pp=1 and pp=3 each hold the model once
    assert reads[0] == reads[1] < full  # each rank read less than the whole model
