"""Host-staged, chunked, overlapped collectives between pools of different vendors.

Each chunk is copied device→host (into pinned memory on CUDA), its inter-pool op is issued
asynchronously on the (gloo) bridge group, and the next chunk's copy proceeds while it flies;
results are copied host→device as the handles complete. On a CPU device the copies are
no-ops, but the same chunking and async-handle code runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hettrain.runtime.collectives.compression import Codec, ErrorFeedback

CHUNK_BYTES = 4 << 20


def _to_host(chunk: torch.Tensor) -> torch.Tensor:
    if chunk.device.type == "cpu":
        return chunk
    host = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(chunk, non_blocking=True)
    return host


def _sync_device(t: torch.Tensor) -> None:
    """Wait for ``t``'s device copies to land in host memory (cuda: its current stream; hpu,
    npu: the device's ``synchronize``)."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    elif t.device.type != "cpu":
        sync = getattr(getattr(torch, t.device.type, None), "synchronize", None)
        if sync is not None:
            sync()


def chunk_slices(n: int, elem_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[slice]:
    """Contiguous slices of a flat tensor of ``n`` elements, each at most ``chunk_bytes``."""
    if chunk_bytes < elem_bytes:
        raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element ({elem_bytes})")
    step = max(1, chunk_bytes // elem_bytes)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)] or [slice(0, 0)]


class BridgeWork:
    """Handle of an in-flight :func:`bridged_all_reduce_async`; ``wait()`` lands the result."""

    def __init__(self, flat: torch.Tensor, pending: list) -> None:
        self.flat, self.pending = flat, pending
        self.chunks = len(pending)

    def wait(self) -> int:
        """Block until every chunk is summed and copied back; returns the number of chunks."""
        for sl, host, work, both in self.pending:
            work.wait()
            if both is not None:  # exchange: the same fixed-order sum on both members
                torch.add(both[0], both[1], out=host)
            if host.data_ptr() != self.flat[sl].data_ptr():
                self.flat[sl].copy_(host, non_blocking=True)
        self.pending = []
        return self.chunks


def bridged_all_reduce_async(
    flat: torch.Tensor,
    group: dist.ProcessGroup,
    chunk_bytes: int = CHUNK_BYTES,
    exchange: bool = False,
) -> BridgeWork:
    """Start the host-staged, chunked sum of ``flat`` over ``group``; see :class:`BridgeWork`.

    ``exchange`` (two-member groups only): each chunk is all-gathered and both members add the
    two copies in group order (identical results on both; one round trip per chunk where the
    ring all-reduce takes two, for the same bytes on the link: ``choice.use_exchange``).
    """
    if exchange and dist.get_world_size(group) != 2:
        raise ValueError(f"exchange needs a 2-member group, got {dist.get_world_size(group)}")
    slices = chunk_slices(flat.numel(), flat.element_size(), chunk_bytes)
    pending: list[tuple[slice, torch.Tensor, dist.Work, torch.Tensor | None]] = []
    for sl in slices:
        host = _to_host(flat[sl])
        _sync_device(flat)
        if exchange:
            both = torch.empty((2, host.numel()), dtype=host.dtype)
            work = dist.all_gather_into_tensor(both.view(-1), host.reshape(-1), group=group,
                                               async_op=True)
            pending.append((sl, host, work, both))
        else:
            pending.append((sl, host, dist.all_reduce(host, group=group, async_op=True), None))
    return BridgeWork(flat, pending)


def bridged_all_reduce_(
    flat: torch.Tensor,
    group: dist.ProcessGroup,
    chunk_bytes: int = CHUNK_BYTES,
    exchange: bool = False,
) -> int:
    """Sum a flat tensor in place over ``group`` via host memory, chunk by chunk, overlapped
    (``exchange``: see :func:`bridged_all_reduce_async`). Returns the number of chunks used.
    """
    return bridged_all_reduce_async(flat, group, chunk_bytes, exchange).wait()


def compressed_all_reduce_(
    flat: torch.Tensor,
    group: dist.ProcessGroup,
    codec: Codec,
    feedback: ErrorFeedback | None,
    key: object,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Sum a flat fp32 tensor over ``group``, exchanging compressed chunks (``all_gather``).

    With ``feedback``, each chunk's compression error is carried into the next call under
    ``(key, chunk index)``. Returns the payload bytes this rank contributed.
    """
    world = dist.get_world_size(group)
    slices = chunk_slices(flat.numel(), 4, chunk_bytes)
    pending = []
    sent = 0
    for i, sl in enumerate(slices):
        x = _to_host(flat[sl].float())
        _sync_device(flat)
        payload = (feedback.compress((key, i), x, codec) if feedback is not None
                   else codec.encode(x))
        outs = [torch.empty_like(payload) for _ in range(world)]
        pending.append((sl, outs, dist.all_gather(outs, payload, group=group, async_op=True)))
        sent += payload.numel()
    for sl, outs, work in pending:
        work.wait()
        n = sl.stop - sl.start
        total = codec.decode(outs[0], n)
        for p in outs[1:]:
            total += codec.decode(p, n)
        flat[sl].copy_(total.to(flat.dtype))
    return sent
