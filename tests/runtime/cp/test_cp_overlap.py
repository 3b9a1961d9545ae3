"""The order of a CP attention layer's exchanges, which the cost model's overlap assumes
(``planning.context.exposed_s``): one gather per key/value head group, all launched before
the first attention; each group's attention after its own gather and before the next group's
is waited for; in the backward each group's reduction launched right after its attention
backward, before the next group's attention backward, and all waited for only after the
last one (``runtime.context_parallel``). Recorded on a stand-in CP rank (no process group)
through a two-layer stage, for each recompute mode."""

from __future__ import annotations

import itertools
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tests.runtime.cp.plans import with_cp
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.planning import context
from hettrain.runtime import context_parallel
from hettrain.runtime.context_parallel import StandInContextParallel, enable_
from hettrain.runtime.memory import build_stage

# GQA 8/4: four key/value heads, so four head groups per layer at tp 1
MODEL = replace(TINY, layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, seq_len=64,
                vocab=256, gated_mlp=True)


class _Recording(StandInContextParallel):
    """A stand-in CP rank that logs each exchange as it is launched and waited for."""

    def __init__(self, log: list, *args) -> None:
        super().__init__(*args)
        self.log = log
        self._n = {"gather": 0, "reduce": 0}

    def _tag(self, kind: str, handle: tuple) -> tuple:
        i = self._n[kind]
        self._n[kind] += 1
        self.log.append((f"start-{kind}", i))
        return (*handle, i)

    def start_gather(self, x):
        return self._tag("gather", super().start_gather(x))

    def finish_gather(self, handle):
        self.log.append(("finish-gather", handle[-1]))
        return super().finish_gather(handle[:-1])

    def start_reduce(self, grad):
        return self._tag("reduce", super().start_reduce(grad))

    def finish_reduce(self, handle):
        self.log.append(("finish-reduce", handle[-1]))
        return super().finish_reduce(handle[:-1])


def _events(monkeypatch, recompute: str) -> list:
    plan = with_cp(tiny_plan([(0, 2, "a")], dp=1, model=MODEL, micro_batch=1,
                             num_microbatches=1, precision="fp32", recompute=recompute), 2)
    model, _ = build_stage(plan, 0)
    log: list = []
    enable_(model, _Recording(log, 2, 1, MODEL.seq_len))
    sdpa = F.scaled_dot_product_attention

    def logged_sdpa(q, k, v, **kw):
        log.append(("attention", q.shape[1]))
        out = sdpa(q, k, v, **kw)
        if out.requires_grad:  # its gradient arrives just before its backward runs
            out.register_hook(lambda g: log.append(("attention-backward", q.shape[1])))
        return out

    monkeypatch.setattr(context_parallel, "F",
                        types.SimpleNamespace(scaled_dot_product_attention=logged_sdpa))
    x = torch.randint(0, MODEL.vocab, (1, MODEL.seq_len // 2))
    out = model(x)
    forward = len(log)
    out.float().pow(2).mean().backward()
    return log[:forward], log[forward:]


def _layers(events: list) -> list[list]:
    """The forward's ``events`` cut into layers: each starts with a run of gather launches."""
    out: list[list] = []
    for i, e in enumerate(events):
        if e[0] == "start-gather" and (i == 0 or events[i - 1][0] != "start-gather"):
            out.append([])
        out[-1].append(e)
    return out


@pytest.mark.parametrize("recompute", ["none", "selective", "attention-free", "full"])
def test_gathers_run_under_the_attention_and_reductions_under_its_backward(monkeypatch,
                                                                         recompute):
    groups = context.head_groups(MODEL, 1)
    assert groups == 4
    forward, backward = _events(monkeypatch, recompute)
    layers = _layers(forward)
    assert len(layers) == MODEL.layers
    for events in layers:
        kinds = [e[0] for e in events]
        # every gather launched before any is waited for or any attention runs
        assert kinds[:groups] == ["start-gather"] * groups
        first = events[0][1]
        waits = [i for i, e in enumerate(events) if e[0] == "finish-gather"]
        assert [events[i][1] - first for i in waits] == list(range(groups))
        for g in range(groups):  # group g's attention (two query chunks) before wait g+1
            end = waits[g + 1] if g + 1 < groups else len(events)
            assert kinds[waits[g] + 1:end] == ["attention", "attention"]
    starts = [i for i, e in enumerate(backward) if e[0] == "start-reduce"]
    finishes = [i for i, e in enumerate(backward) if e[0] == "finish-reduce"]
    assert len(starts) == len(finishes) == groups * MODEL.layers
    for layer in range(MODEL.layers):
        s = starts[layer * groups:(layer + 1) * groups]
        f = finishes[layer * groups:(layer + 1) * groups]
        # the reductions launched one per group, each before the next group's attention
        # backward; all waited for only after the last one was launched
        for a, b in itertools.pairwise(s):
            assert "attention-backward" in [e[0] for e in backward[a:b]]
        assert max(s) < min(f)
