"""PagedAttention: one step's attention over the paged KV cache, shared by all layers.

Built once per step from the AttentionMetadata; each layer calls `forward`, which writes
the step's K/V into their slots, then attends over each request's blocks.
"""

from __future__ import annotations

import torch

from pdserve.kernels import ops
from pdserve.kernels.attn_metadata import AttentionMetadata


class PagedAttention:
    def __init__(self, metadata: AttentionMetadata, backend: str, block_size: int,
                 num_kv_heads: int, prefill_rows: bool = False) -> None:
        """prefill_rows (torch backend): prompt tokens attend as rows of the C kernel, as
        decodes do (`ops.prepare_torch_metadata`); the engine sets it for a bf16 cache on
        CPU, where torch's bf16 SDPA runs at fp32 speed or below."""
        self.metadata = metadata
        self.prefill_rows = prefill_rows
        self.backend = backend
        # NOTE: the torch (CPU) path builds its gather indices, and checks the slots for
        # padding, once per step, not per layer.
        is_torch = backend == "torch"
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.torch_metadata = (ops.prepare_torch_metadata(metadata, block_size, num_kv_heads,
                                                          prefill_rows=prefill_rows)
                               if is_torch else None)
        self._windowed_metadata: dict[int, ops.TorchAttentionMetadata] = {}
        """The torch path's indices per sliding window, built at a window's first layer."""
        self.slot_has_skips = bool((metadata.slot_mapping < 0).any()) if is_torch else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """query [T, num_heads, D], key/value [T, num_kv_heads, D] -> [T, num_heads, D].

        `sliding_window` W: the query at position p sees keys p - W + 1 ... p only (a local
        layer); `logits_soft_cap` c: scores c * tanh(s / c) (Gemma 2). None: off.
        """
        ops.store_kv_cache(key, value, k_cache, v_cache, self.metadata.slot_mapping,
                           backend=self.backend, has_skips=self.slot_has_skips)
        torch_metadata = self.torch_metadata
        if sliding_window and torch_metadata is not None:
            torch_metadata = self._windowed_metadata.get(sliding_window)
            if torch_metadata is None:
                torch_metadata = ops.prepare_torch_metadata(
                    self.metadata, self.block_size, self.num_kv_heads,
                    sliding_window=sliding_window, prefill_rows=self.prefill_rows)
                self._windowed_metadata[sliding_window] = torch_metadata
        return ops.paged_attention(query, k_cache, v_cache, self.metadata, scale,
                                   backend=self.backend, torch_metadata=torch_metadata,
                                   sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap)
