"""Synthetic deterministic token stream: the global batch of a step is a pure function of
(seed, step), and each DP replica / microbatch takes a fixed slice of it, so the data a run
sees is independent of its layout.

Sequences come from a fixed pool (``POOL`` sequences of a noisy repeating byte pattern), so the
loss actually falls as the tiny model memorises them.
"""

from __future__ import annotations

from functools import lru_cache

import torch

POOL = 64


@lru_cache(maxsize=8)
def _pool(seed: int, seq_len: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 7)
    period = torch.randint(2, 9, (POOL, 1), generator=gen)
    pos = torch.arange(seq_len + 1).unsqueeze(0)
    base = torch.randint(0, vocab, (POOL, 1), generator=gen)
    seqs = (base + (pos % period) * 13) % vocab
    noise = torch.rand(seqs.shape, generator=gen) < 0.1
    return torch.where(noise, torch.randint(0, vocab, seqs.shape, generator=gen), seqs)


def global_batch(seed: int, step: int, batch: int, seq_len: int,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of shape ``[batch, seq_len]`` for optimizer step ``step``."""
    pool = _pool(seed, seq_len, vocab)  # cached: built once per run, read-only
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    idx = torch.randint(0, POOL, (batch,), generator=gen)
    seqs = pool[idx]
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def microbatches(seed: int, step: int, *, dp: int, dp_index: int, micro_batch: int,
                 num_microbatches: int, seq_len: int,
                 vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's microbatches of step ``step``: replica ``d`` owns rows
    ``[d*mb*M, (d+1)*mb*M)`` of the global batch, microbatch ``m`` the ``m``-th ``mb`` rows."""
    if not 0 <= dp_index < dp:
        raise ValueError(f"dp_index={dp_index} out of range for dp={dp}")
    x, y = global_batch(seed, step, dp * micro_batch * num_microbatches, seq_len, vocab)
    per = micro_batch * num_microbatches
    x, y = x[dp_index * per:(dp_index + 1) * per], y[dp_index * per:(dp_index + 1) * per]
    return [(x[m * micro_batch:(m + 1) * micro_batch], y[m * micro_batch:(m + 1) * micro_batch])
            for m in range(num_microbatches)]
