"""The kernels' public ops: attention over the paged KV cache, `store_kv_cache` and
`paged_attention`, three backends.

- "torch": the CPU path (`kernels/torch_paged.py`); build `prepare_torch_metadata(...)` once
  per step and pass it as `torch_metadata=` to every layer.
- "triton": the CUDA kernels (`kernels/triton_*.py`), imported on first use so that importing
  `pdserve.kernels.ops` needs neither triton nor a GPU.
- "reference": the slow, obviously-correct torch reference (`kernels/reference.py`).

Every backend takes the step's `AttentionMetadata` (kernels/attn_metadata.py documents
its fields). Cache per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads,
head_dim]; block 0 is the null block. See docs/engine-contracts.md, section `kernels/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from pdserve.kernels import reference, torch_paged
from pdserve.kernels.torch_paged import TorchAttentionMetadata, prepare_torch_metadata

if TYPE_CHECKING:  # kernels imports nothing from shared at run time
    from pdserve.kernels.attn_metadata import AttentionMetadata

Backend = Literal["torch", "triton", "reference"]

__all__ = [
    "Backend",
    "TorchAttentionMetadata",
    "paged_attention",
    "prepare_torch_metadata",
    "store_kv_cache",
]


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: Backend = "torch",
    has_skips: bool | None = None,
) -> None:
    """Write this step's K/V into the cache, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim].
        value: [num_tokens, num_kv_heads, head_dim].
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; -1 skipped.
        backend: which implementation runs.
        has_skips: whether slot_mapping holds a -1, when the caller knows (torch backend;
            None: checked here, one reduction per call).
    """
    if backend == "torch":
        torch_paged.store_kv_cache(key, value, k_cache, v_cache, slot_mapping, has_skips)
    elif backend == "triton":
        from pdserve.kernels import triton_store

        triton_store.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    elif backend == "reference":
        reference.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        raise ValueError(f"unknown backend {backend!r}")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    backend: Backend = "torch",
    torch_metadata: TorchAttentionMetadata | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch (decodes and chunked prefills) over the paged cache.

    Request i's q_len_i query rows (`attn_metadata.query_start_loc`) are its last q_len_i
    positions and attend causally to its first seq_lens[i] keys; query head h reads kv head
    h // (num_heads // num_kv_heads). With `sliding_window` W the query at position p sees
    keys p - W + 1 ... p only (Mistral; Gemma's local layers; transformers' mask), and no
    backend reads a block that lies wholly before a request's first query's window (such
    blocks may have been freed: the null block). With `logits_soft_cap` c the scaled scores
    become c * tanh(s / c) (Gemma 2, Gemma Team 2024).

    Args:
        query: [num_tokens, num_heads, head_dim].
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim], this step's K stored.
        v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        attn_metadata: the step's `shared.engine.attn_metadata.AttentionMetadata`.
        scale: softmax scale.
        backend: which implementation runs.
        torch_metadata: "torch" backend only: this step's `prepare_torch_metadata(...)`
            built for the same `sliding_window`.
        sliding_window: None (full attention) or W >= 1 tokens.
        logits_soft_cap: None or c > 0.

    Returns:
        [num_tokens, num_heads, head_dim], query's dtype; rows past query_start_loc[-1]
        are zero.
    """
    args = (query, k_cache, v_cache, attn_metadata, scale)
    variant = {"sliding_window": sliding_window or None,
               "logits_soft_cap": logits_soft_cap or None}
    if backend == "torch":
        return torch_paged.paged_attention(*args, torch_metadata=torch_metadata, **variant)
    if backend == "triton":
        from pdserve.kernels import triton_decode, triton_prefill

        out = torch.zeros_like(query)
        triton_decode.paged_decode(*args, out, **variant)
        triton_prefill.paged_prefill(*args, out, **variant)
        return out
    if backend == "reference":
        return reference.paged_attention(*args, **variant)
    raise ValueError(f"unknown backend {backend!r}")
