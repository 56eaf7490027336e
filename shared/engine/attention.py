"""PagedAttention: one step's attention over the paged KV cache, shared by all layers.

Built once per step from the AttentionMetadata; each layer calls `forward`, which writes
the step's K/V into their slots, then attends over each request's blocks.
"""

from __future__ import annotations

import torch

from pdserve.kernels import ops
from pdserve.shared.engine.attn_metadata import AttentionMetadata


class PagedAttention:
    def __init__(self, metadata: AttentionMetadata, backend: str, block_size: int,
                 num_kv_heads: int) -> None:
        self.metadata = metadata
        self.backend = backend
        # NOTE: the torch (CPU) path builds its gather indices, and checks the slots for
        # padding, once per step, not per layer.
        is_torch = backend == "torch"
        self.torch_metadata = (ops.prepare_torch_metadata(metadata, block_size, num_kv_heads)
                               if is_torch else None)
        self.slot_has_skips = bool((metadata.slot_mapping < 0).any()) if is_torch else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """query [T, num_heads, D], key/value [T, num_kv_heads, D] -> [T, num_heads, D]."""
        ops.store_kv_cache(key, value, k_cache, v_cache, self.metadata.slot_mapping,
                               backend=self.backend, has_skips=self.slot_has_skips)
        return ops.paged_attention(query, k_cache, v_cache, self.metadata, scale,
                                       backend=self.backend, torch_metadata=self.torch_metadata)
