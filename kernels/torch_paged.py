"""Fast CPU paged attention: decodes batched, per-step metadata built once for all layers.

How a mixed batch runs (PagedAttention, Kwon et al. 2023, for the cache layout):

- Decode rows (q_len == 1) are all handled by one call, never a per-request loop. With the
  native kernel (`kernels/cpu_native.py`: C + OpenMP, compiled at first use; fp32, or a
  bf16 cache with fp32 sums) each row
  reads its blocks straight from the cache: no gathered copy, no padding, ~1 read of the
  K/V. Without it (no C compiler, or another dtype) rows are sorted by length and bucketed;
  each bucket gathers K/V rows through the block table
  into a padded [n * num_kv_heads, padded_len, head_dim] tensor, and runs one
  `baddbmm` (scores plus the additive length mask) -> softmax -> `bmm`, with each request's
  query heads grouped by kv head ([n * num_kv_heads, group_size, head_dim]), so GQA needs no
  repeated K/V.
- Chunked prefills (q_len > 1, few per step) loop per request: gather the request's K/V,
  then `scaled_dot_product_attention` (FlashAttention-style CPU kernel in torch) with a
  bottom-right causal mask, since the chunk's queries are the request's last q_len positions.
  With a bf16 cache the engine asks for `prefill_rows` instead: each prompt token is a row of
  the native kernel over the keys up to its position (torch's bf16 SDPA on CPUs without AMX
  runs its matmuls through fp32 at or below fp32's speed; the rows read the cache in place,
  with fp32 sums, and a row's result does not depend on its batch).

`prepare_torch_metadata` does all host-side index work (the `.tolist()` calls, the sort, the
gather indices and masks) once per step; pass its result to every layer's `paged_attention`:

    torch_metadata = prepare_torch_metadata(attn_metadata, block_size, num_kv_heads)  # a step
    out = paged_attention(..., attn_metadata, scale, torch_metadata=torch_metadata)  # a layer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_native import DecodeRows, load_native_kernel, paged_attention_rows

if TYPE_CHECKING:
    from pdserve.kernels.attn_metadata import AttentionMetadata

DECODE_BUCKET_SIZE = 16
"""Decode rows per gathered bucket in the torch-ops fallback (padding vs per-bucket cost)."""


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Decode rows of similar length, gathered together (torch-ops fallback only)."""

    query_rows: torch.Tensor
    """[n] int64, query/out row of each decode."""
    cache_rows: torch.Tensor
    """[n * num_kv_heads * padded_len] int64, rows of `cache.view(-1, head_dim)` to gather."""
    mask: torch.Tensor
    """[n * num_kv_heads, 1, padded_len] float32, 0 for real keys and -inf for padding."""
    padded_len: int


@dataclass(frozen=True, slots=True)
class PrefillSlice:
    """One request with q_len > 1: its query rows and the cache slots of all its keys."""

    start: int
    end: int
    slots: torch.Tensor
    """[num_keys] int64, cache slot of each key position it may see: all seq_len of them, or
    with a sliding window those from the first query's window on."""
    mask: torch.Tensor | None
    """[q_len, num_keys] bool (True = attend), or None when plain causal (q_len == seq_len,
    no window)."""


@dataclass(frozen=True, slots=True)
class TorchAttentionMetadata:
    """Per-step indices for the CPU path, shared by every layer of the step."""

    num_actual_tokens: int
    """query_start_loc[-1]; query rows past it are padding (their output is zero)."""
    block_size: int
    num_kv_heads: int
    decode_rows: DecodeRows
    """Every decode row (and verify row), longest seq_len first."""
    decode_buckets: tuple[DecodeBucket, ...]
    prefills: tuple[PrefillSlice, ...]
    sliding_window: int | None = None
    """The window these indices were built for (None: full attention)."""


def prepare_torch_metadata(
    attn_metadata: AttentionMetadata,
    block_size: int,
    num_kv_heads: int,
    bucket_size: int = DECODE_BUCKET_SIZE,
    sliding_window: int | None = None,
    prefill_rows: bool = False,
) -> TorchAttentionMetadata:
    """Builds the step's indices once (all host work), for every layer's `paged_attention`.

    Requests with one query token are decode rows; so is each query token of a request in
    `attn_metadata.verify_reqs` (a last token + speculative drafts), over the keys up to its
    own position (causal; their K/V is stored before attention reads it). Other requests
    are prefill slices. `bucket_size`: decode rows per bucket in the torch-ops fallback.
    `sliding_window`: build for layers that see only each query's last W keys (a model with
    local and global layers builds one per kind). `prefill_rows`: prompt tokens become
    decode rows too, as verify rows do (for the C kernel, which reads each row's keys from
    the cache: no gather, no SDPA). Its tensors are on the block table's device.
    """
    device = attn_metadata.block_table.device
    seq_lens = attn_metadata.seq_lens.tolist()
    starts = attn_metadata.query_start_loc.tolist()
    block_table = attn_metadata.block_table.long()
    verify_reqs = attn_metadata.verify_reqs
    decode_reqs: list[int] = []
    prefills: list[PrefillSlice] = []
    verify_rows: list[tuple[int, int, int]] = []  # (query row, batch index, seq_len)
    for req_idx, seq_len in enumerate(seq_lens):
        start, end = starts[req_idx], starts[req_idx + 1]
        if end - start == 1:
            decode_reqs.append(req_idx)
        elif req_idx in verify_reqs or prefill_rows:
            verify_rows.extend((start + j, req_idx, seq_len - (end - start) + 1 + j)
                               for j in range(end - start))
        elif end - start > 1:
            q_len = end - start
            key_lo = (max(0, seq_len - q_len - sliding_window + 1) if sliding_window else 0)
            slots = _cache_slots(block_table[req_idx : req_idx + 1], seq_len, block_size,
                                 key_lo)[0]
            prefills.append(PrefillSlice(start, end, slots, _prefill_mask(
                q_len, seq_len, key_lo, sliding_window, device)))
    # NOTE: longest first balances the native kernel's dynamic schedule across threads, and
    # puts rows of similar length next to each other for the fallback's buckets.
    decode_reqs.sort(key=lambda req_idx: -seq_lens[req_idx])
    rows = [(starts[i], i, seq_lens[i]) for i in decode_reqs]
    if verify_rows:
        rows = sorted(rows + verify_rows, key=lambda row: -row[2])
    decode_rows = DecodeRows(
        query_rows=torch.tensor([r[0] for r in rows], dtype=torch.int64, device=device),
        batch_indices=torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device),
        seq_lens=torch.tensor([r[2] for r in rows], dtype=torch.int32, device=device),
        max_seq_len=max((r[2] for r in rows), default=0))
    buckets = tuple(
        _decode_bucket(block_table, *(x[i : i + bucket_size] for x in decode_rows[:3]),
                       rows[i][2], block_size, num_kv_heads, sliding_window)
        for i in range(0, len(rows), bucket_size)
    )
    return TorchAttentionMetadata(
        num_actual_tokens=starts[-1], block_size=block_size, num_kv_heads=num_kv_heads,
        decode_rows=decode_rows, decode_buckets=buckets, prefills=tuple(prefills),
        sliding_window=sliding_window)


def _cache_slots(block_table: torch.Tensor, length: int, block_size: int,
                 start: int = 0) -> torch.Tensor:
    """[n, length - start] int64 slots of positions start..length-1 of each row's block
    table."""
    positions = torch.arange(start, length, device=block_table.device)
    return block_table[:, positions // block_size] * block_size + positions % block_size


def _prefill_mask(q_len: int, seq_len: int, key_lo: int, sliding_window: int | None,
                  device: torch.device) -> torch.Tensor | None:
    """[q_len, seq_len - key_lo] bool: query row r (position seq_len - q_len + r) sees key
    key_lo + j when it is not after it and, with a window, within its last W positions."""
    if q_len == seq_len and not sliding_window:
        return None
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(key_lo, seq_len, device=device)[None, :]
    visible = key_pos <= query_pos
    if sliding_window:
        visible &= key_pos > query_pos - sliding_window
    return visible


def _decode_bucket(
    block_table: torch.Tensor,
    query_rows: torch.Tensor,
    batch_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    block_size: int,
    num_kv_heads: int,
    sliding_window: int | None = None,
) -> DecodeBucket:
    """`max_len`: the bucket's longest seq_len (its first row's: rows are longest first)."""
    padded_len = -(-max_len // block_size) * block_size
    slots = _cache_slots(block_table[batch_indices], padded_len, block_size)  # [n, padded_len]
    device = block_table.device
    positions = torch.arange(padded_len, device=device)[None, :]
    lens = seq_lens[:, None].long()
    is_pad = positions >= lens
    if sliding_window:
        is_pad |= positions < lens - sliding_window
    # NOTE: padding re-reads the row's last position, never the slots past seq_len or before
    # the window: those (and the null block, which stands for freed blocks) may hold NaN from
    # an uninitialized cache, and a masked NaN still poisons the softmax and the 0 * v
    # products.
    slots = torch.where(is_pad, slots.gather(1, lens - 1), slots)
    heads = torch.arange(num_kv_heads, device=device)
    cache_rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [n, kvh, padded_len]
    mask = torch.zeros(is_pad.shape, device=device).masked_fill_(is_pad, float("-inf"))
    mask = mask.repeat_interleave(num_kv_heads, dim=0).unsqueeze(1)
    return DecodeBucket(query_rows, cache_rows.reshape(-1), mask, padded_len)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    has_skips: bool | None = None,
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens] int64
    (-1 = skip). In place. `has_skips`: whether slot_mapping holds a -1 (None: check here;
    PagedAttention checks once per step instead of once per layer)."""
    if has_skips is None:
        has_skips = bool((slot_mapping < 0).any())
    if has_skips:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # NOTE: a slot is a row of the cache seen as [num_blocks * block_size, kv_heads, D]:
    # index_copy_ writes whole rows, one op per cache, with no block-id / offset tensors
    # (advanced indexing with two index tensors took about 2x its time at 64 tokens).
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                         key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                         value.to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    torch_metadata: TorchAttentionMetadata | None = None,
    use_native: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention` on CPU; the same contract as `kernels.reference`.

    `torch_metadata`: from `prepare_torch_metadata` for this step and this `sliding_window`;
    built here when None (host time on every layer, so the model runner builds it once per
    step). `use_native`: decodes run the compiled C kernel when it is available (fp32, or a bf16
    cache with fp32 sums).
    `sliding_window`, `logits_soft_cap`: as `kernels.ops.paged_attention`.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape
    metadata = torch_metadata
    if metadata is None:
        metadata = prepare_torch_metadata(attn_metadata, block_size, num_kv_heads,
                                          sliding_window=sliding_window)
    assert (metadata.block_size, metadata.num_kv_heads) == (block_size, num_kv_heads)
    assert metadata.sliding_window == sliding_window, "metadata built for another window"
    padded = metadata.num_actual_tokens < query.shape[0]
    out = torch.zeros_like(query) if padded else torch.empty_like(query)
    if metadata.decode_rows.query_rows.numel() > 0:
        native = None
        # NOTE: the C kernel reads host memory: CUDA tensors take the torch ops.
        if use_native and query.device.type == "cpu" and query.dtype == k_cache.dtype \
                and query.dtype in (torch.float32, torch.bfloat16):
            native = load_native_kernel(head_dim, num_kv_heads, num_heads // num_kv_heads,
                                        k_cache.dtype)
        if native is not None and k_cache.is_contiguous() and v_cache.is_contiguous():
            if query.stride(2) != 1 or query.stride(1) != head_dim:
                query = query.contiguous()
            block_table = attn_metadata.block_table.to(torch.int32).contiguous()
            # a bf16 cache: bf16 query and rows, fp32 sums, each row rounded to bf16 once
            paged_attention_rows(native, query, k_cache, v_cache, block_table,
                                 metadata.decode_rows, scale, out, sliding_window,
                                 logits_soft_cap)
        else:
            _decode_torch(query, k_cache, v_cache, metadata, scale, out, logits_soft_cap)
    for prefill in metadata.prefills:
        _prefill_torch(query, k_cache, v_cache, prefill, scale, out, logits_soft_cap)
    return out


def _decode_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: TorchAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = metadata.num_kv_heads
    group_size = num_heads // num_kv_heads
    k_rows = k_cache.reshape(-1, head_dim)  # a view for the (usual) contiguous cache
    v_rows = v_cache.reshape(-1, head_dim)
    for bucket in metadata.decode_buckets:
        n = bucket.query_rows.shape[0]
        batch_shape = (n * num_kv_heads, bucket.padded_len, head_dim)
        k = k_rows.index_select(0, bucket.cache_rows).view(batch_shape)
        v = v_rows.index_select(0, bucket.cache_rows).view(batch_shape)
        # [n, num_heads, head_dim] -> [n * num_kv_heads, group_size, head_dim]
        q = query.index_select(0, bucket.query_rows).view(n * num_kv_heads, group_size, head_dim)
        mask = bucket.mask.to(q.dtype)
        if logits_soft_cap:
            scores = torch.bmm(q, k.transpose(1, 2)) * scale
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap) + mask
        else:
            scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out.index_copy_(0, bucket.query_rows, torch.bmm(probs, v).view(n, num_heads, head_dim))


def _prefill_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefill: PrefillSlice,
    scale: float,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    k = k_cache.flatten(0, 1).index_select(0, prefill.slots)  # [num_keys, num_kv_heads, head_dim]
    v = v_cache.flatten(0, 1).index_select(0, prefill.slots)
    q = query[prefill.start : prefill.end]  # [q_len, num_heads, head_dim]
    if logits_soft_cap:
        out[prefill.start : prefill.end] = _soft_capped_attention(q, k, v, prefill.mask, scale,
                                                                  logits_soft_cap)
        return
    # NOTE: 4-D inputs ([1, heads, len, head_dim]) take torch's fused CPU kernel (flash
    # attention); 3-D ones fall back to the ~4x slower math path.
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=prefill.mask, is_causal=prefill.mask is None, scale=scale, enable_gqa=True)
    out[prefill.start : prefill.end] = attn[0].transpose(0, 1)


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
    """Attention with scores c * tanh(s / c) (Gemma 2), which SDPA cannot express: q
    [q_len, num_heads, D], k/v [num_keys, num_kv_heads, D], mask [q_len, num_keys] bool or
    None (plain causal) -> [q_len, num_heads, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, num_keys, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale
    scores = cap * torch.tanh(scores / cap)  # [num_heads, q_len, num_keys]
    if mask is None:
        mask = torch.ones(scores.shape[1:], dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1)
