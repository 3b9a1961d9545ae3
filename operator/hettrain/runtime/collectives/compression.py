"""Lossy codecs for the cross-DC hop (bf16, int8 with per-chunk scales) and error feedback.

Compressed payloads are exchanged as raw bytes (uint8) with ``all_gather`` and summed locally
in fp32, so no backend needs to sum int8/bf16 (gloo cannot sum int8 without overflow).
"""

from __future__ import annotations

import torch

CODECS = ("none", "bf16", "int8")
INT8_CHUNK = 4096  # elements sharing one fp32 scale


class Codec:
    """Compress a flat fp32 tensor to bytes and back. ``kind`` is one of :data:`CODECS`."""

    def __init__(self, kind: str, chunk: int = INT8_CHUNK) -> None:
        if kind not in CODECS:
            raise ValueError(f"compression must be one of {CODECS}, got {kind!r}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.kind = kind
        self.chunk = chunk

    def payload_bytes(self, n: int) -> int:
        """Size in bytes of the payload for ``n`` elements."""
        if self.kind == "none":
            return 4 * n
        if self.kind == "bf16":
            return 2 * n
        return n + 4 * (-(-n // self.chunk))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flat fp32 tensor -> uint8 payload."""
        x = x.detach().reshape(-1).float()
        if self.kind == "none":
            return x.clone().view(torch.uint8)
        if self.kind == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8)
        n = x.numel()
        chunks = -(-n // self.chunk)
        padded = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=x.device)
        padded[:n] = x
        blocks = padded.view(chunks, self.chunk)
        scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        q = torch.round(blocks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.reshape(-1)[:n].view(torch.uint8)])

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """uint8 payload -> flat fp32 tensor of ``n`` elements."""
        if self.kind == "none":
            return payload.view(torch.float32)[:n].clone()
        if self.kind == "bf16":
            return payload.view(torch.bfloat16)[:n].float()
        chunks = -(-n // self.chunk)
        scale = payload[: 4 * chunks].view(torch.float32)
        q = payload[4 * chunks: 4 * chunks + n].view(torch.int8).float()
        idx = torch.arange(n, device=payload.device) // self.chunk
        return q * scale[idx]


class ErrorFeedback:
    """Residuals kept per tensor key: what compression dropped is added before the next encode."""

    def __init__(self) -> None:
        self.residuals: dict[object, torch.Tensor] = {}

    def compress(self, key: object, x: torch.Tensor, codec: Codec) -> torch.Tensor:
        """Encode ``x + residual[key]`` and keep the new residual; returns the payload."""
        x = x.detach().reshape(-1).float()
        r = self.residuals.get(key)
        if r is not None and r.shape == x.shape:
            x = x + r
        payload = codec.encode(x)
        self.residuals[key] = x - codec.decode(payload, x.numel())
        return payload
