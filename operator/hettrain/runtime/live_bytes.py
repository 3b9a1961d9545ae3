"""Live tensor bytes on any device, with their peak: what an allocator would hold, on the CPU.

``with LiveBytes() as live: ...`` counts every storage an operator allocates inside the block
(each once, however many views share it) from the operator that makes it until the last
tensor on it is freed, and keeps the peak (``live.peak``). Storages that existed before the
block (parameters, saved activations, the inputs) are not counted, nor are views of them or
in-place writes into them. It sees what goes through PyTorch's dispatcher, the backward's
operators included (a dispatch mode is thread-local, and the CPU runs the backward on the
calling thread); an allocator's own rounding and caching are not counted.

``runtime.memory`` uses it for what the saved-tensor hooks cannot see: the buffers a
backward allocates and frees as it runs (``cost.backward_transient_bytes``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated inside the block and still alive (``bytes``), and
    their peak (``peak``) (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[dict[int, weakref.ref], int]] = {}  # ptr -> (refs, bytes)
        self.bytes = 0
        self.peak = 0

    def _released(self, ptr: int, ref: weakref.ref) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        refs, nbytes = entry
        refs.pop(id(ref), None)
        if not refs:
            del self.live[ptr]
            self.bytes -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0:
                continue
            entry = self.live.get(ptr)
            if entry is None:
                if ptr in inputs:
                    continue  # a view of, or a write into, a storage from before the block
                entry = self.live[ptr] = ({}, nbytes)
                self.bytes += nbytes
                self.peak = max(self.peak, self.bytes)
            ref = weakref.ref(t, lambda r, p=ptr: self._released(p, r))
            entry[0][id(ref)] = ref
        return out
