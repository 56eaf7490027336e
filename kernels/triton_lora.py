"""Triton SGMV kernels for batched multi-LoRA on CUDA (Punica's segmented gather matrix-vector
shrink / expand, Chen et al. 2023; S-LoRA, Sheng et al. 2023).

Inputs are grouped by adapter slot once per step (`shared/lora/mapping.py`):

    token_indices [L]   batch rows of the LoRA tokens, sorted by slot
    seg_start, seg_len, seg_slot [num_segments]: token_indices[start:start + len] use `slot`

    shrink:  t[i, :]      = x[token_indices[i], :] @ A[slot]^T      t [L, R] fp32
    expand:  y[row, :]   += t[i, :] @ B[slot]^T                      in place

Grid: (segment, block of BLOCK_M tokens, block of output columns); each output element is
owned by one program (a token appears in one segment), so the expand needs no atomics.
A[slot] is [R, K] and B[slot] is [N, R], zero-padded to the layer's largest rank; the dots
accumulate in fp32. Tested on CPU under TRITON_INTERPRET=1 against
`kernels.lora_cpu.lora_reference` (tests/kernels/test_lora_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, t_ptr, tok_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                        K, R, stride_xm, stride_as, stride_ar, stride_tm,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    n = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n
    rows = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(xt.to(tl.float32), at.to(tl.float32))
    out = t_ptr + (start + offs_m)[:, None] * stride_tm + offs_r[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(t_ptr, b_ptr, y_ptr, tok_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                        N, R, stride_tm, stride_bs, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    n = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n
    rows = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        tt = tl.load(t_ptr + (start + offs_m)[:, None] * stride_tm + offs_r[None, :],
                     mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        acc += tl.dot(tt, bt.to(tl.float32))
    mask = m_mask[:, None] & n_mask[None, :]
    out = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


BLOCK_M = 16
BLOCK_R = 16
BLOCK_K = 32
BLOCK_N = 32


def add_lora_sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  token_indices: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                  seg_slot: torch.Tensor, max_seg_len: int) -> None:
    """In place: y[t] += (x[t] @ lora_a[s]^T) @ lora_b[s]^T for each segment's tokens.

    Args:
        y: [num_tokens, N], contiguous rows; x: [num_tokens, K], contiguous rows.
        lora_a: [num_slots, R, K] contiguous; lora_b: [num_slots, N, R] contiguous.
        token_indices: [L] int32/int64 batch rows sorted by slot.
        seg_start, seg_len, seg_slot: [num_segments] int32.
        max_seg_len: the longest segment (sizes the grid).
    """
    num_segments = seg_start.shape[0]
    if num_segments == 0 or token_indices.shape[0] == 0:
        return
    assert x.stride(1) == 1 and y.stride(1) == 1, "rows must be contiguous"
    assert lora_a.is_contiguous() and lora_b.is_contiguous()
    _, R, K = lora_a.shape
    N = lora_b.shape[1]
    assert lora_b.shape[2] == R and x.shape[1] == K and y.shape[1] == N
    t = torch.empty((token_indices.shape[0], R), dtype=torch.float32, device=x.device)
    grid_m = triton.cdiv(max_seg_len, BLOCK_M)
    _sgmv_shrink_kernel[(num_segments, grid_m, triton.cdiv(R, BLOCK_R))](
        x, lora_a, t, token_indices, seg_start, seg_len, seg_slot, K, R,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _sgmv_expand_kernel[(num_segments, grid_m, triton.cdiv(N, BLOCK_N))](
        t, lora_b, y, token_indices, seg_start, seg_len, seg_slot, N, R,
        t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R)
