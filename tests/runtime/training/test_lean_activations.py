"""The memory-lean layer ops of ``runtime.model``: the RMSNorm keeps only its input and the MLP's
activation + down projection keep only the projections' outputs for the backward, and both give
the gradients of the plain composition (autograd through every op)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hettrain.runtime.model import RMSNorm, _ActDown, defer_weight_grads, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


def _saved_storages(fn, exclude: tuple[torch.Tensor, ...]) -> tuple[dict[int, int], torch.Tensor]:
    """The storages (pointer -> bytes) that ``fn()`` saves for its backward, parameters
    excluded, and ``fn()``'s output."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def _leaf(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.7).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gives_autograds_gradients_and_keeps_only_its_input(dtype):
    x, w = _leaf((2, 5, 16), dtype, 0), _leaf((16,), dtype, 1)
    norm = RMSNorm(16, 1e-5)
    norm.weight = torch.nn.Parameter(w.detach().clone())
    g = torch.randn(2, 5, 16).to(dtype)

    saved, out = _saved_storages(lambda: norm(x), (norm.weight,))
    assert list(saved.values()) == [x.numel() * x.element_size()]  # x alone
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)

    ref = rms_norm(x, w, 1e-5)  # plain autograd through every op
    rgx, rgw = torch.autograd.grad(ref, (x, w), g)
    assert torch.equal(out, ref)
    assert torch.equal(gx, rgx) and torch.equal(gw, rgw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_act_down_gives_autograds_gradients_and_keeps_only_the_projections(dtype, gated):
    up = _leaf((2, 5, 24), dtype, 2)
    gate = _leaf((2, 5, 24), dtype, 3) if gated else None
    w = torch.nn.Parameter(_leaf((8, 24), dtype, 4).detach())
    g = torch.randn(2, 5, 8).to(dtype)
    inputs = (up, w) + ((gate,) if gated else ())

    saved, out = _saved_storages(lambda: _ActDown.apply(up, w, gate), (w,))
    kept = [up] + ([gate] if gated else [])
    assert sorted(saved.values()) == sorted(t.numel() * t.element_size() for t in kept)
    got = torch.autograd.grad(out, inputs, g)

    act = F.silu(gate) * up if gated else F.gelu(up)
    ref = F.linear(act, w)
    want = torch.autograd.grad(ref, inputs, g)
    assert torch.equal(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_act_down_defers_the_down_weight_gradient_to_the_w_pass():
    up, gate = _leaf((3, 4, 12), torch.float32, 5), _leaf((3, 4, 12), torch.float32, 6)
    w = torch.nn.Parameter(_leaf((6, 12), torch.float32, 7).detach())
    g = torch.randn(3, 4, 6)
    with defer_weight_grads() as store:
        _ActDown.apply(up, w, gate).backward(g)
    assert w.grad is None and up.grad is not None and len(store.items) == 1
    store.flush()
    w2 = torch.nn.Parameter(w.detach().clone())
    F.linear(F.silu(gate.detach()) * up.detach(), w2).backward(g)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-7)
